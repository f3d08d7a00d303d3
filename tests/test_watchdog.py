"""The watchdog's verdicts, on a fake communicator (the real thing runs in tests/test_faults.py)."""

import time

import pytest

from mok_proto.symm import watchdog


class FakeRequest:
    def Test(self):
        return False

    def Cancel(self):
        pass

    def Wait(self):
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
