"""The watchdog's verdicts, on a fake communicator (the real thing runs in tests/test_faults.py)."""

import itertools
import signal
import subprocess
import sys
import time

import pytest

from mok_proto.symm import watchdog


class FakeRequest:
    def Test(self):
        return False

    def Cancel(self):
        pass

    def Wait(self, status=None):
        pass


class FakeComm:
    rank, size = 0, 3

    def Irecv(self, *args, **kwargs):
        return FakeRequest()

    def Isend(self, *args, **kwargs):
        return FakeRequest()

    def Abort(self, code):
        raise AssertionError(f"Abort({code}) from a test")


@pytest.fixture
def dog():
    d = watchdog.Watchdog(FakeComm(), timeout_s=0.05, period_s=100.0)  # the thread sleeps: verdicts by hand
    yield d
    d._stop.set()
    d._thread.join()


def test_last_resort_appends_its_line_and_kills_its_rank(tmp_path):
    """Past its deadline the helper adds one line to its rank's stderr (a log file keeps what it held)
    and ends the rank with SIGKILL."""
    log = tmp_path / "rank.err"
    log.write_text("earlier output\n")
    code = ("import time\nfrom mok_proto.symm import watchdog\nhelper = watchdog.LastResort(3)\n"
            "helper.arm('MPI finalize', 0.2)\ntime.sleep(30)\n")
    with log.open("a") as err:
        proc = subprocess.run([sys.executable, "-c", code], stderr=err, timeout=25)
    assert proc.returncode == -signal.SIGKILL
    lines = log.read_text().splitlines()
    assert lines[0] == "earlier output" and len(lines) == 2, lines
    assert lines[1].startswith("mok_proto: MPI finalize: rank 3 waited 0.2 s for every rank; stopped ranks"), lines


def test_silent_peer_is_named(dog):
    now = time.monotonic()
    dog.last_heard = {1: now, 2: now - 1.0}
    problem = dog._problem()
    assert "rank 0: peer 2 silent for 1.0 s" in problem and "exit 4" in problem and "peer 1" not in problem


def test_expired_collective_names_a_peer_that_stopped_inside_it(dog):
    """The guard can expire before the stopped peer's silence reaches the timeout: still named."""
    dog.timeout_s, dog.period_s = 10.0, 0.01
    now = time.monotonic()
    dog.last_heard = {1: now, 2: now - 0.5}
    dog._guard = ("gather of results", now - 1.0)
    problem = dog._problem()
    assert problem.startswith("mok_proto: gather of results: rank 0 waited 10 s; peer 2 silent for 0.5 s"), problem


def test_expired_collective_with_every_peer_alive(dog):
    dog.last_heard = {1: time.monotonic(), 2: time.monotonic()}
    dog.timeout_s = 10.0
    assert dog._problem() is None
    dog._guard = ("window creation (tokens)", time.monotonic() - 1.0)
    assert "every peer is alive but the collective did not finish" in dog._problem()


class Mailbox:
    """Point-to-point messages from peer 1 to rank 0 (size 2), delivered in order on Test()."""

    rank, size = 0, 2

    handles = itertools.count(1)

    def __init__(self):
        self.handle = next(Mailbox.handles)  # a fresh communicator: no barrier state of another
        self.queue = []  # tokens peer 1 sent that no receive has matched yet
        self.on_cancel = []  # tokens that match a receive while it is being cancelled

    def py2f(self):
        return -self.handle  # never a real communicator's handle

    def Irecv(self, buf, source, tag):
        box = self

        class Recv:
            done = False

            def Test(self):
                if not self.done and box.queue:
                    buf[0][0] = box.queue.pop(0)
                    self.done = True
                return self.done

            def Cancel(self):
                if not self.done and box.on_cancel:
                    buf[0][0] = box.on_cancel.pop(0)
                    self.done = True

            def Wait(self, status=None):  # cancelled unless it matched first
                if status is not None:
                    status.Set_cancelled(not self.done)

        return Recv()

    def Isend(self, *args, **kwargs):
        class Sent:
            def Test(self):
                return True

            def Wait(self):
                pass
        return Sent()

    def Recv(self, buf, source, tag):
        assert self.queue, "a blocking receive with nothing sent"
        buf[0][0] = self.queue.pop(0)

    def allgather(self, value):
        return [value, self.peer_seq]


def test_arrival_token_of_a_barrier_given_up_on_is_not_taken_for_the_next():
    """Rank 0 times out of barrier 1; peer 1 arrives there late (its token 1 is queued). Barrier 2
    must not pass on that stale token: it times out until peer 1's token 2 arrives."""
    comm = Mailbox()
    with pytest.raises(watchdog.PeerTimeoutError, match="peer"):
        watchdog.arrival_barrier(comm, "barrier 1", 0.05)
    comm.queue.append(1)  # peer 1 reached barrier 1 after rank 0 gave up on it
    with pytest.raises(watchdog.PeerTimeoutError):
        watchdog.arrival_barrier(comm, "barrier 2", 0.05)  # the stale token is dropped, not an arrival
    assert comm.queue == []
    comm.queue += [2, 3]  # peer 1's barrier 2 (which rank 0 gave up on) and barrier 3
    watchdog.arrival_barrier(comm, "barrier 3", 0.05)  # token 2 is stale, token 3 is the arrival
    assert comm.queue == []


def test_arrival_token_matched_during_the_cancel_counts():
    """Rank 0 gives up on barrier 1 while its receive matches peer 1's token 2 (peer 1, ahead,
    had given up on barrier 1 itself): that token is kept, so barrier 2 passes on it with no
    further message (dropping it would leave rank 0 waiting for a token peer 1 never resends)."""
    comm = Mailbox()
    comm.on_cancel.append(2)
    with pytest.raises(watchdog.PeerTimeoutError):
        watchdog.arrival_barrier(comm, "barrier 1", 0.05)
    watchdog.arrival_barrier(comm, "barrier 2", 0.05)
    assert watchdog._BARRIERS[comm.py2f()] == {"seq": 2, "seen": {1: 2}}


def test_resync_drops_stale_tokens_and_agrees_on_the_barrier_count():
    """After a failure: rank 0 timed out of barriers 1 and 2 (peer 1 entered neither); peer 1 then
    entered barrier 1 late (its token 1 is queued) and stopped there. The resync takes that token
    and the peer's marker, and both ranks count from the larger barrier count (2): the next barrier
    is 3 on both, so peer 1's token 3 is its arrival."""
    comm = Mailbox()
    comm.peer_seq = 1
    for name in ("barrier 1", "barrier 2"):
        with pytest.raises(watchdog.PeerTimeoutError):
            watchdog.arrival_barrier(comm, name, 0.05)
    comm.queue += [1, watchdog.RESYNC_MARKER]
    assert watchdog.resync_arrivals(comm) == {1: 1}
    assert comm.queue == [] and watchdog._BARRIERS[comm.py2f()] == {"seq": 2, "seen": {}}
    comm.queue.append(3)
    watchdog.arrival_barrier(comm, "barrier 3", 0.05)
