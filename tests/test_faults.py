"""A stuck or dead rank ends the job by itself, and the output names it (real ranks, real signals).

Each case starts the demo under mpiexec in its own session (tests/mpi_programs/stop_rank.py: one
rank stops itself with SIGSTOP, or dies with SIGKILL, at one step of the run), waits for the job to
end, and cleans up only its own processes: SIGKILL to the stopped rank if it is still there, then
to the launcher's process group.
"""

import os
import signal
import subprocess
import time

import pytest

from conftest import ROOT, mpiexec_cmd, rank_env, run_ranks

pytestmark = pytest.mark.mpi

TIMEOUT_S = 2.0  # the demo's --timeout: how long a rank waits for a silent peer
SLACK_S = 8.0  # start-up of 4 Python processes on a small CI machine, the heartbeat period, the abort
STUCK = 2  # the rank that stops


def run_stopped(at: str, sig: str = "STOP", stuck: int = STUCK, num_ranks: int = 4):
    """Run the demo with rank `stuck` getting SIG`sig` at step `at`; (returncode, output, seconds
    from the signal to the end of the job, pid of the stuck rank)."""
    cmd = mpiexec_cmd(num_ranks, "tests/mpi_programs/stop_rank.py", "--rank", str(stuck), "--at", at,
                      "--signal", sig, "--", "--shape", "tiny", "--timeout", str(TIMEOUT_S))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=rank_env(), cwd=ROOT,
                            start_new_session=True)
    lines, pid, signalled = [], None, None
    deadline = time.monotonic() + 60  # start-up + the run + TIMEOUT_S + SLACK_S, generously
    try:
        for line in proc.stdout:  # ends when every process of the job closed its output
            lines.append(line)
            if line.startswith("stop_rank:"):
                pid, signalled = int(line.split("(pid ")[1].split(")")[0]), time.monotonic()
            if time.monotonic() > deadline:
                break
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        ended = time.monotonic()
        if pid is not None and sig == "STOP":
            _kill(pid)  # a stopped rank left behind (the job should already have ended it)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert signalled is not None, "".join(lines)
    return proc.returncode, "".join(lines), ended - signalled, pid


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.parametrize("at", ["setup", "forward", "backward", "cleanup"])
def test_stopped_rank_ends_the_job_and_is_named(at):
    rc, out, seconds, _ = run_stopped(at)
    assert rc == 4, out  # EXIT_PEER, through MPI_Abort
    assert seconds < TIMEOUT_S + SLACK_S, f"job took {seconds:.1f} s after the stop\n{out}"
    assert f"peer {STUCK} silent for" in out and "stopped or dead" in out, out
    assert "PASS" not in out


@pytest.mark.parametrize("at", ["startup", "finish"])
def test_stopped_rank_outside_mpi_calls_is_named(at):
    """Before MPI_Init completes and inside MPI_Finalize no Python thread runs: the helper process
    (watchdog.LastResort) names the stopped rank from /proc and ends the job."""
    rc, out, seconds, pid = run_stopped(at)
    assert rc != 0, out
    assert seconds < TIMEOUT_S + SLACK_S, f"job took {seconds:.1f} s after the stop\n{out}"
    op = {"startup": "MPI startup", "finish": "MPI finalize"}[at]
    assert f"mok_proto: {op}:" in out and f"stopped ranks on this host: {STUCK} (pid {pid})" in out, out


def test_killed_rank_ends_the_job():
    """A killed process takes the job down through the launcher at once (mpiexec exits with the
    signal's number; its banner names a pid of the job, not necessarily the killed one's)."""
    rc, out, seconds, _ = run_stopped("forward", sig="KILL", stuck=1)
    assert rc == signal.SIGKILL, out
    assert seconds < SLACK_S, f"job took {seconds:.1f} s after the kill\n{out}"
    assert "BAD TERMINATION" in out and "PASS" not in out, out


def test_stop_rank_program_runs_clean_when_nobody_stops():
    """Control: the same program with the stop aimed at a rank that does not exist passes."""
    proc = run_ranks(2, "tests/mpi_programs/stop_rank.py", "--rank", "7", "--at", "forward", "--",
                     "--shape", "tiny", "--timeout", str(TIMEOUT_S))
    assert "PASS" in proc.stdout and "stop_rank:" not in proc.stderr
