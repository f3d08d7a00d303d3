"""No host collective without a bound: a stopped or dead peer ends the job, it never hangs it.

Legend: R ranks. Three tools, for the three kinds of blocking host call an MPI job makes:

  arrival_barrier(comm, op, timeout_s)   a barrier built from point-to-point messages and polled
      in the calling thread; after timeout_s it raises PeerTimeoutError naming the peers that did
      not arrive. Also run before every collective that has no non-blocking form (window
      creation and freeing, NVSHMEM init): it proves every peer alive just before.
  Watchdog (one thread per process)     heartbeats to every peer every `period_s`, and deadlines
      for the main thread's blocking collectives (`guard(op)`). When a peer has been silent for
      timeout_s, or a guarded call has not returned after timeout_s, it prints ONE line
      (operator, this rank, the silent peers) and ends the job with MPI_Abort(EXIT_PEER).
      This covers the window between an arrival barrier and the collective after it, and names
      a stopped rank at any moment of the run (its heartbeats stop with it).
  LastResort (a helper process)          MPI_Init and MPI_Finalize hold Python's GIL (no thread
      runs) and block until every rank arrives. A helper forked before MPI_Init (never after:
      fork and MPI do not mix) is armed around both; past its deadline it names the launcher's
      stopped processes on this host (state T in /proc, their PMI_RANK) in one line and kills
      this rank (SIGKILL), so the launcher takes the job down (mpiexec exits 9 or 15).

NOTE (MPICH hydra, measured with the mpich 5.0 wheel): MPI_Abort(code) from any rank ends every
process, a stopped one included, and mpiexec exits with `code`. A process killed by a signal makes
hydra kill the others at once (mpiexec exits with the signal number, 9 for SIGKILL). A process that
exits with a non-zero status after MPI_Init also ends the job; before MPI_Init it does not (hence
the alarm, a signal death).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time

import numpy as np

from mok_proto.exitcodes import EXIT_PEER

ARRIVAL_TAG = 32001  # point-to-point tags reserved on the heap's communicator
HEARTBEAT_TAG = 32002
_GOODBYE = -1  # heartbeat payload that says "I finished; stop expecting heartbeats from me"
# Between printing the one line and ending the job: a line written just before the job ends may never
# be forwarded by the launcher (a loaded machine needs more than a scheduler tick)
FORWARD_S = 0.5


class PeerTimeoutError(RuntimeError):
    """A bounded host collective expired: which operator, which rank waited, for which peers."""

    def __init__(self, op: str, rank: int, peers, timeout_s: float):
        self.op, self.rank, self.peers, self.timeout_s = op, rank, list(peers), timeout_s
        names = ", ".join(str(p) for p in self.peers)
        super().__init__(f"{op}: rank {rank} waited {timeout_s:g} s for peer {names} "
                         f"(not arrived: stopped, dead or elsewhere)")


def abort(comm, line: str, code: int) -> None:
    """Print one line and end the whole job with MPI_Abort(code) (every process, stopped ones too)."""
    print(line, file=sys.stderr, flush=True)
    time.sleep(FORWARD_S)
    comm.Abort(code)


def _poll_until(done, deadline: float) -> bool:
    """Call done() until it returns True (-> True) or the deadline passes (-> False); backs off to 1 ms."""
    spins = 0
    while not done():
        if time.monotonic() > deadline:
            return False
        spins += 1
        if spins > 64:
            time.sleep(1e-3 if spins > 1024 else 1e-5)
    return True


# Per communicator (its Fortran handle): barriers entered so far, and per peer the highest
# arrival token received from it. A token carries its barrier's sequence number, so one that a
# late peer sent to a barrier this rank gave up on (timed out) is recognised as stale in the
# next barrier instead of being taken for an arrival there.
_BARRIERS: dict = {}


def _barrier_state(comm) -> dict:
    return _BARRIERS.setdefault(comm.py2f(), {"seq": 0, "seen": {}})


def arrival_barrier(comm, op: str, timeout_s: float) -> None:
    """Every rank tells every peer it arrived and waits (bounded) until all R-1 peers did."""
    rank, size = comm.rank, comm.size
    if size == 1:
        return
    state = _barrier_state(comm)
    state["seq"] += 1
    seq, seen = state["seq"], state["seen"]
    token = np.array([seq], np.int64)
    inbox = np.zeros(size, np.int64)
    peers = [p for p in range(size) if p != rank]
    arrived = {p for p in peers if seen.get(p, 0) >= seq}

    def post(p):
        return comm.Irecv([inbox[p:p + 1], 1], source=p, tag=ARRIVAL_TAG)

    def received(p):  # p's token in inbox[p] has arrived
        seen[p] = max(seen.get(p, 0), int(inbox[p]))

    recvs = {p: post(p) for p in peers if p not in arrived}
    sends = [comm.Isend([token, 1], dest=p, tag=ARRIVAL_TAG) for p in peers]

    def all_arrived():
        for p in peers:
            if p not in arrived and recvs[p].Test():
                received(p)
                if seen[p] >= seq:
                    arrived.add(p)
                else:  # a stale token (a barrier this rank timed out of): wait for this one's
                    recvs[p] = post(p)
        return len(arrived) == len(peers)

    deadline = time.monotonic() + timeout_s
    if not _poll_until(all_arrived, deadline):
        missing = [p for p in peers if p not in arrived]
        for p in missing:
            if _cancel(recvs[p]):  # matched before the cancel took: the token is consumed, keep it
                received(p)
        raise PeerTimeoutError(op, rank, missing, timeout_s)
    # Small messages complete locally (eager) once every peer has arrived; bounded all the same.
    if not _poll_until(lambda: all(request.Test() for request in sends), deadline + timeout_s):
        raise PeerTimeoutError(op, rank, peers, timeout_s)


RESYNC_MARKER = -1  # an arrival-tag payload no barrier sends (their tokens count from 1)


def resync_arrivals(comm) -> dict:
    """Collective, after a failure every rank agreed on (some ranks' arrival barriers may have
    timed out while others never entered theirs): every rank sends each peer RESYNC_MARKER on the
    arrival tag and receives from each peer up to that marker (MPI keeps one sender's messages in
    order), which takes every token still in flight; then all ranks restart their barrier count at
    the largest one among them, with nothing pending. Returns {peer: tokens dropped}."""
    state = _barrier_state(comm)
    peers = [p for p in range(comm.size) if p != comm.rank]
    marker, got = np.array([RESYNC_MARKER], np.int64), np.zeros(1, np.int64)
    sends = [comm.Isend([marker, 1], dest=p, tag=ARRIVAL_TAG) for p in peers]
    dropped = {}
    for p in peers:
        dropped[p] = -1
        got[0] = 0
        while got[0] != RESYNC_MARKER:
            comm.Recv([got, 1], source=p, tag=ARRIVAL_TAG)
            dropped[p] += 1
    for request in sends:
        request.Wait()
    state["seq"], state["seen"] = max(comm.allgather(state["seq"])), {}
    return dropped


def _cancel(request) -> bool:
    """Cancel a pending receive; True when it had matched a message first (its data arrived)."""
    from mpi4py import MPI

    request.Cancel()
    status = MPI.Status()
    request.Wait(status)  # a cancelled (or meanwhile matched) receive completes locally
    return not status.Is_cancelled()


class Watchdog:
    """Heartbeats and collective deadlines for one process; see the module docstring.

    Start it right after MPI_Init and close() it right after the job's last arrival barrier
    (before MPI_Finalize: no thread may call MPI then)."""

    def __init__(self, comm, timeout_s: float, period_s: float | None = None):
        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        self.timeout_s = float(timeout_s)
        self.period_s = period_s if period_s is not None else min(0.2, self.timeout_s / 10)
        now = time.monotonic()
        self.last_heard = {p: now for p in range(self.size) if p != self.rank}
        self._inbox = np.zeros(self.size, np.int64)
        self._recvs = {p: self._post_recv(p) for p in self.last_heard}
        self._sends: dict = {}
        self._beat = np.zeros(1, np.int64)
        self._guard = None  # (op, deadline) of the main thread's blocking call, if any
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mok-watchdog", daemon=True)
        self._thread.start()

    # -- main thread -------------------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self, op: str):
        """Bound a blocking collective of the main thread: past timeout_s the job is aborted."""
        self._guard = (op, time.monotonic() + self.timeout_s)
        try:
            yield
        finally:
            self._guard = None

    def close(self) -> None:
        """Stop the thread, say goodbye to every peer (they stop expecting heartbeats)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._beat[0] = _GOODBYE
        sends = [self.comm.Isend([self._beat, 1], dest=peer, tag=HEARTBEAT_TAG) for peer in self.last_heard]
        sends += [request for request in self._sends.values() if request is not None]
        for peer in self.last_heard:
            _cancel(self._recvs[peer])
        # Small messages complete locally (eager); bounded all the same.
        _poll_until(lambda: all(request.Test() for request in sends), time.monotonic() + self.timeout_s)
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    # -- watchdog thread ---------------------------------------------------------------------
    def _post_recv(self, peer):
        return self.comm.Irecv([self._inbox[peer:peer + 1], 1], source=peer, tag=HEARTBEAT_TAG)

    def _run(self):
        seq = 0
        while not self._stop.wait(self.period_s):
            seq += 1
            self._send_beats(seq)
            self._drain()
            problem = self._problem()
            if problem:
                abort(self.comm, problem, EXIT_PEER)

    def _send_beats(self, seq):
        self._beat[0] = seq
        for peer in self.last_heard:
            pending = self._sends.get(peer)
            if pending is None or pending.Test():  # at most one heartbeat in flight per peer
                self._sends[peer] = self.comm.Isend([self._beat, 1], dest=peer, tag=HEARTBEAT_TAG)

    def _drain(self):
        now = time.monotonic()
        for peer in list(self.last_heard):
            while self._recvs[peer].Test():
                if self._inbox[peer] == _GOODBYE:
                    del self.last_heard[peer]  # finished: no request left posted for it
                    break
                self.last_heard[peer] = now
                self._recvs[peer] = self._post_recv(peer)

    def _problem(self) -> str | None:
        now = time.monotonic()
        silent = sorted(p for p, t in self.last_heard.items() if now - t > self.timeout_s)
        guard = self._guard
        where = f"{guard[0]}: " if guard else ""
        if silent:
            peers = ", ".join(f"{p} silent for {now - self.last_heard[p]:.1f} s" for p in silent)
            return (f"mok_proto: {where}rank {self.rank}: peer {peers} (timeout {self.timeout_s:g} s): "
                    f"stopped or dead; ending the job (exit {EXIT_PEER})")
        if guard and now > guard[1]:
            # A peer that stopped after this rank entered the collective is silent for less than
            # timeout_s yet: name every peer quiet for several heartbeat periods.
            quiet = sorted(p for p, t in self.last_heard.items() if now - t > 4 * self.period_s)
            who = ("peer " + ", ".join(f"{p} silent for {now - self.last_heard[p]:.1f} s" for p in quiet)
                   + ": stopped or dead") if quiet else "every peer is alive but the collective did not finish"
            return (f"mok_proto: {where}rank {self.rank} waited {self.timeout_s:g} s; {who}; "
                    f"ending the job (exit {EXIT_PEER})")
        return None


_ACTIVE: list[Watchdog] = []  # the process's running watchdog (at most one)


def start(comm, timeout_s: float, **kwargs) -> Watchdog:
    """Start this process's watchdog (the demo does, right after MPI_Init)."""
    if _ACTIVE:
        raise RuntimeError("a watchdog is already running in this process")
    _ACTIVE.append(Watchdog(comm, timeout_s, **kwargs))
    return _ACTIVE[0]


def guard(op: str):
    """The running watchdog's deadline around a blocking collective; a no-op without one (then
    the caller's preceding arrival_barrier is the only bound)."""
    return _ACTIVE[0].guard(op) if _ACTIVE else contextlib.nullcontext()


class LastResort:
    """A helper process that kills this rank if an armed deadline passes (see the module docstring).
    Create it before MPI_Init; arm(op, timeout_s) / disarm(); it exits when this process does."""

    def __init__(self, rank: int):
        read_fd, self._write_fd = os.pipe()
        parent = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:  # helper: no MPI, no threads
            # NOTE: hold none of the rank's files (output pipes, the launcher's PMI socket): a
            # stopped helper must not keep the launcher waiting for them to close.
            os.closerange(0, read_fd)
            os.closerange(read_fd + 1, 1 << 16)
            os._exit(_last_resort_loop(read_fd, rank, parent))
        os.close(read_fd)

    def arm(self, op: str, timeout_s: float) -> None:
        os.write(self._write_fd, f"{float(timeout_s)} {op}\n".encode())

    def disarm(self) -> None:
        os.write(self._write_fd, b"0 -\n")


def _last_resort_loop(read_fd: int, rank: int, parent: int) -> int:
    """The helper's life: follow arm/disarm lines; past a deadline report and kill the parent."""
    deadline, op, timeout_s, pending = None, "", 0.0, b""
    while True:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([read_fd], [], [], wait)
        if not ready:
            if os.getppid() != parent:  # the rank is gone (its job ended meanwhile): nothing to end
                return 0
            stopped = ", ".join(f"{r} (pid {p})" for r, p in stopped_ranks_here(parent)) or "none found here"
            line = (f"mok_proto: {op}: rank {rank} waited {timeout_s:g} s for every rank; stopped ranks on "
                    f"this host: {stopped}; ending the job\n")
            with contextlib.suppress(OSError):  # the rank's stderr: appended to (a file), never waited on (a full pipe)
                err = os.open(f"/proc/{parent}/fd/2", os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
                try:
                    os.write(err, line.encode())
                finally:
                    os.close(err)
            time.sleep(FORWARD_S)
            if os.getppid() == parent:
                os.kill(parent, signal.SIGKILL)
            return 0
        data = os.read(read_fd, 4096)
        if not data:  # the rank exited
            return 0
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            seconds, op = line.decode().split(" ", 1)
            timeout_s = float(seconds)
            deadline = time.monotonic() + timeout_s if timeout_s > 0 else None


def stopped_ranks_here(rank_pid: int) -> list[tuple[int, int]]:
    """[(rank, pid)] of stopped processes started by the same launcher process as rank_pid (Linux
    /proc; the launcher's PMI_RANK in their environment). Empty where /proc is unreadable."""
    def stat(pid):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])  # state, parent pid

    found = []
    try:
        launcher = stat(rank_pid)[1]
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            state, parent = stat(pid)
            if parent != launcher or state not in "Tt":
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError):
            continue
        if b"PMI_RANK" in env:
            found.append((int(env[b"PMI_RANK"]), pid))
    return sorted(found)
