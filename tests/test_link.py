"""The emulated link's model and host side (mok_proto/link.py), on the CPU: its arithmetic, its
CommParams fields, and that only the MOK_LINK build of the kernels holds link code."""

import pytest
from kernel_ptx import GROUP, compile_module

from mok_proto import abi
from mok_proto.config import RunConfig, get_shape
from mok_proto.link import LOAD_BATCH_BYTES, NO_LINK_FIELDS, LinkClock, LinkModel, comm_fields


def test_rate_in_device_units():
    assert LinkModel(368).fs_per_byte == 2717  # 1e6 fs / 368 bytes per ns, rounded
    assert LinkModel(900).fs_per_byte == 1111
    assert LinkModel(1).fs_per_byte == 1_000_000
    # a reservation lasts bytes / rate, rounded to the nearest ns, as link_reserve computes it
    assert LinkModel(368).transfer_ns(368_000) == 1000 - 0  # 368000 * 2717 fs = 999.856 ns -> 1000
    assert LinkModel(100).transfer_ns(14336) == 143  # 143.36 ns
    assert LinkModel(100).transfer_ns(14386) == 144  # 143.86 ns
    assert LinkModel(368).transfer_ns(0) == 0
    assert LinkModel(368, latency_us=1.25).latency_ns == 1250


@pytest.mark.parametrize("gbps,latency", [(0, 1.0), (-5, 1.0), (float("inf"), 1.0), (float("nan"), 1.0),
                                          (368, -1.0), (368, float("nan")), (2e6, 1.0), (0.01, 1.0)])
def test_bad_settings_are_refused(gbps, latency):
    with pytest.raises(ValueError, match="link"):
        LinkModel(gbps, latency)


def test_the_slowest_link_cannot_overflow_the_device_arithmetic():
    from mok_proto.link import FS_PER_NS, MAX_FS_PER_BYTE

    slowest = LinkModel(1e6 / MAX_FS_PER_BYTE)  # 0.0298 GB/s
    assert slowest.fs_per_byte == MAX_FS_PER_BYTE and MAX_FS_PER_BYTE * 2**38 + FS_PER_NS // 2 <= 2**63 - 1
    with pytest.raises(ValueError, match="too slow"):
        LinkModel(1e6 / MAX_FS_PER_BYTE * 0.99)


def test_one_budget_shared_by_every_mover():
    link = LinkModel(368, latency_us=2.0)
    clock = LinkClock(link)
    row = 14336
    # 100 warps reserve one row each at the same time: the link moves them one after another
    ends = [clock.reserve(row, now=1000) for _ in range(100)]
    assert ends == [1000 + link.transfer_ns(row) * (i + 1) for i in range(100)]
    # a lone mover after the link went idle starts at once: idle time is not banked
    later = ends[-1] + 50_000
    assert clock.reserve(row, now=later) == later + link.transfer_ns(row)
    # a reservation while busy queues behind the clock, whatever its own `now`
    assert clock.reserve(row, now=later) == later + 2 * link.transfer_ns(row)


def test_pull_pays_a_round_trip_per_batch():
    link = LinkModel(368, latency_us=2.0)
    row = 4 * LOAD_BATCH_BYTES + 1  # 5 batches of one warp's loads
    # an idle link: the warp's 3 rows take 15 round trips, far more than their bytes
    clock = LinkClock(link)
    assert clock.warp_rows(3, row, now=0, pull=True, batch_bytes=LOAD_BATCH_BYTES) == 15 * 2000
    # a push of the same rows pays only the bytes (its round trip comes with the signal)
    clock = LinkClock(link)
    assert clock.warp_rows(3, row, now=0, pull=False, batch_bytes=LOAD_BATCH_BYTES) == link.transfer_ns(3 * row)
    # a queue longer than the round trips: the bytes decide, for a pull too
    clock = LinkClock(link)
    clock.reserve(10**8, now=0)
    assert clock.warp_rows(3, row, now=0, pull=True, batch_bytes=LOAD_BATCH_BYTES) == \
        link.transfer_ns(10**8) + link.transfer_ns(3 * row)
    # nothing pays: done at once, the clock untouched
    busy = clock.busy_until
    assert clock.warp_rows(0, row, now=7, pull=True, batch_bytes=LOAD_BATCH_BYTES) == 7
    assert clock.busy_until == busy


def test_which_rows_pay():
    plain, every = LinkModel(368), LinkModel(368, every_row=True)
    assert plain.pays(0, 1) and not plain.pays(0, 0) and not plain.pays(0, -1)
    assert every.pays(0, 1) and every.pays(0, 0) and not every.pays(0, -1)


def test_comm_params_fields():
    fields = LinkModel(368, latency_us=1.5, every_row=True).comm_fields()
    assert fields == {"link_fs_per_byte": 2717, "link_latency_ns": 1500, "link_every_row": 1}
    assert comm_fields(None) == NO_LINK_FIELDS and set(NO_LINK_FIELDS) == set(fields)
    assert set(fields) | {"link_clock"} <= set(abi.COMM_PARAMS.names)
    # the link fields come after every field the plain kernels read: their offsets do not move
    names = abi.COMM_PARAMS.names
    assert names.index("link_fs_per_byte") > names.index("error")
    packed = abi.COMM_PARAMS.pack({**{n: 0 for n in names}, **fields}).view(abi.COMM_PARAMS.dtype)[0]
    assert packed["link_fs_per_byte"] == 2717 and packed["link_latency_ns"] == 1500


def test_run_config_takes_a_link():
    run = RunConfig(get_shape("tiny"), 2, link=LinkModel(368))
    assert run.link.gbps == 368 and RunConfig(get_shape("tiny"), 2).link is None
    with pytest.raises(TypeError, match="LinkModel"):
        RunConfig(get_shape("tiny"), 2, link=368)


def _ptx(header: str, defines=()):
    # the plain build as test_kernels_build compiles it (to SASS), the variant as PTX
    compiled = compile_module(" ".join((header, *(f"-D{d}" for d in defines))), "compute_90a" if defines else "sm_90a")
    assert compiled.ok and ".entry" in compiled.ptx, compiled.log[-4000:]
    return compiled.ptx


@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("header,movers", [("comm.cuh", 8), ("fused.cuh", 8)])  # fused: 4 kernels x 2 kinds of movers
def test_only_the_link_build_holds_link_code(header, movers):
    from mok_proto.kernels import comm, fused

    for module in (comm, fused):
        assert module.LINK_MODULE is module.MODULE.variant("MOK_LINK") and module.LINK_MODULE.defines == ("MOK_LINK",)
    # the link clock's reservation is the only 64-bit atomic max of these kernels: every row movement
    # of comm.cuh (4 kernels x 2 access widths), the fused kernels' movers (4 kernels x 2 kinds of mover)
    plain, linked = _ptx(header), _ptx(header, ("MOK_LINK",))
    assert "atom.max.u64" not in plain
    assert linked.count("atom.max.u64") == movers
