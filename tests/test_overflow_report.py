"""CPU checks of how a receive-buffer overflow reaches every rank of the GPU layer: the weighted
sum's error record (kErrCapacity, Op kOpWeightedSum, cuda/common.cuh report_unplaced_slots) as
CapacityError, the TokenParams fields the check reads and the layer fills, and the GPU check
programs' overflow case (tests/mpi_programs/gpu_program.py check_overflow, run on a GPU by
tests/test_gpu_layer.py and tests/test_fused_layer.py): rank 0 alone overflows and every rank's
expected message is what describe() makes of the record its kernels write."""

import importlib.util
from pathlib import Path

import pytest

from mok_proto import abi
from mok_proto.config import MoEShape
from mok_proto.errors import CapacityError
from mok_proto.kernels.errors import describe

GPU_PROGRAM = Path(__file__).resolve().parent / "mpi_programs" / "gpu_program.py"


def _record(**fields) -> dict:
    return {**dict.fromkeys(abi.ERROR_RECORD.names, 0), **fields}


def _weighted_sum_record(rank: int, owner: int, slots: int, unplaced: int) -> dict:
    """The fields report_unplaced_slots writes (block and thread: whichever block won)."""
    return _record(code=abi.ERROR_CODE["kErrCapacity"], op=abi.OP["kOpWeightedSum"], rank=rank, peer=owner,
                   expected=slots, seen=unplaced, block=3, thread=0, detail=-1)


def _schedule_record(rank: int, need: int, capacity: int) -> dict:
    """The fields schedule_offsets writes (cuda/comm.cuh)."""
    return _record(code=abi.ERROR_CODE["kErrCapacity"], op=abi.OP["kOpSchedule"], rank=rank, peer=need,
                   expected=capacity, seen=0, block=0, thread=0, detail=-1)


def test_weighted_sum_record_names_the_overflowing_rank_and_the_seeing_rank():
    error = describe(_weighted_sum_record(rank=2, owner=0, slots=144, unplaced=84))
    assert isinstance(error, CapacityError)
    assert str(error) == ("weighted sum: receive buffer overflow on rank 0 (seen by rank 2: 84 of its 144 slots "
                          "got no expert result)")
    assert "overflow on rank 0" in str(error)  # the phrase the GPU check programs look for


def test_the_weighted_sum_op_is_its_own():
    # an Op of its own: the schedule's capacity record reads as before, and the two never mix
    ops = [name for name, _ in abi.OP.members]
    assert ops.count("kOpWeightedSum") == 1 and abi.OP.text(abi.OP["kOpWeightedSum"]) == "weighted sum"
    schedule = describe(_schedule_record(rank=1, need=900, capacity=800))
    assert str(schedule) == "schedule: receive buffer overflow on rank 1: needs 900 rows, capacity is 800"
    assert abi.CONST["kStateWords"] == 1 + len(abi.OP)  # a last-block counter per Op, the new one too


def test_token_params_carry_what_the_check_reads_as_comm_params_does():
    comm = {name: ctype for ctype, name, _ in abi.COMM_PARAMS.fields}
    token = {name: ctype for ctype, name, _ in abi.TOKEN_PARAMS.fields}
    for name in ("num_local_experts", "topk_idx", "recv_row", "error"):
        assert token.get(name) == comm[name], (name, token.get(name), comm[name])


@pytest.mark.parametrize("num_shared", [0, 1])
def test_the_layer_fills_every_token_field(num_shared):
    from mok_proto.layer.gpu import token_fields
    from mok_proto.layer.layout import layer_row_layout, round_layout
    from mok_proto.config import RunConfig

    shape = MoEShape("tok", hidden=256, ffn=256, num_experts=8, top_k=2, num_tokens=16, num_shared=num_shared,
                     shared_ffn=256 if num_shared else None)
    run = RunConfig(shape, 4)
    names = {**round_layout(run, 512), **layer_row_layout(shape, 2, 512)}
    table = {name: 0x1000 * (i + 1) for i, name in enumerate(names)}  # stand-in peer-table addresses
    fields = token_fields(shape, 2, 1, table, error_ptr=0xE000)
    words = abi.TOKEN_PARAMS.pack(fields)  # raises on a missing or unknown field
    back = abi.TOKEN_PARAMS.unpack(words)
    assert back["recv_row"] == table["recv_row"] and back["topk_idx"] == table["topk_idx"]
    assert back["num_local_experts"] == 2 and back["error"] == 0xE000 and back["rank_base"] == 1
    assert back["has_base"] == num_shared and back["y_slots"] == table["y_slots"] and back["out"] == table["out"]


def _gpu_program():
    spec = importlib.util.spec_from_file_location("gpu_program", GPU_PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_overflow_case_overflows_rank_0_alone(num_ranks):
    gpu_program = _gpu_program()
    case = gpu_program.overflow_case(num_ranks)
    need, capacity = case["need"], case["capacity"]
    assert need[0] > capacity and all(n <= capacity for n in need[1:])
    assert all(0 < u < case["slots"] for u in case["unplaced"][1:])  # every other rank has slots on rank 0
    # the messages the check program expects are describe()'s of the records the kernels write
    first = describe(_schedule_record(0, need[0], capacity))
    assert str(first) == gpu_program.overflow_message(case, 0)
    for rank in range(1, num_ranks):
        seen = describe(_weighted_sum_record(rank, 0, case["slots"], case["unplaced"][rank]))
        assert str(seen) == gpu_program.overflow_message(case, rank)


# ---- GPU: the kernels' check on virtual ranks ---------------------------------------------------
# A token owner's view of a peer's overflow is recv_row = -1 for its slots routed there (what that
# peer's schedule writes). With virtual ranks every rank shares one error record, so these tests
# write the -1s into one rank's recv_row after a sound forward and launch the weighted sum alone
# on a clear record: the record must be the one that rank's own record would hold under NVSHMEM.

def _unplace(recv_row, topk_idx, num_local: int, owners) -> int:
    """recv_row[s] = -1 where slot s's expert owner is in `owners`; how many slots that is."""
    import cupy

    hit = cupy.isin(cupy.asarray(topk_idx).reshape(-1) // num_local, cupy.asarray(list(owners)))
    recv_row.reshape(-1)[hit] = -1
    return int(hit.sum())


@pytest.mark.gpu
def test_layer_weighted_sum_reports_slots_without_a_row_and_still_sums():
    import cupy

    from mok_proto.kernels import token as kt
    from mok_proto.symm.virtual import VirtualWorld

    heap = VirtualWorld(4)
    layer = _gpu_program().small_layer(heap, "wsum", seed=7, num_tokens=40)
    layer.enqueue_forward()
    layer.check()
    out = {r: layer.bufs["out"].instance(r).copy() for r in layer.ranks}
    # a sound round: the weighted sum alone reports nothing
    kt.weighted_sum(layer.params_tok, layer.launch)
    layer.check()
    # rank 2 sees ranks 3 and 1 overflowed: the lowest, 1, is named; every such slot counted
    idx = layer.bufs["topk_idx"].instance(2)
    count = _unplace(layer.bufs["recv_row"].instance(2), idx, layer.num_local, (3, 1))
    assert 0 < count < idx.size
    kt.weighted_sum(layer.params_tok, layer.launch)
    fields = layer.error.read()
    assert (fields["code"], fields["op"]) == (abi.ERROR_CODE["kErrCapacity"], abi.OP["kOpWeightedSum"])
    assert (fields["rank"], fields["peer"], fields["expected"], fields["seen"]) == (2, 1, idx.size, count)
    with pytest.raises(CapacityError, match=rf"overflow on rank 1 \(seen by rank 2: {count} of its {idx.size} "):
        layer.check()
    for r in layer.ranks:  # the sum still ran, over the same slot rows: the same bits
        assert cupy.array_equal(layer.bufs["out"].instance(r), out[r]), r
    # the first report wins: a later launch does not overwrite it
    _unplace(layer.bufs["recv_row"].instance(0), layer.bufs["topk_idx"].instance(0), layer.num_local, (2,))
    kt.weighted_sum(layer.params_tok, layer.launch)
    assert layer.error.read()["rank"] == 2
    layer.close()


@pytest.mark.gpu
def test_round_weighted_sum_reports_slots_without_a_row():
    from mok_proto.config import RunConfig
    from mok_proto.kernels import comm as kc
    from mok_proto.layer.gpu_comm import GpuCommRound
    from mok_proto.problem import make_problem
    from mok_proto.symm.virtual import VirtualWorld

    import numpy as np

    heap = VirtualWorld(2)
    shape = MoEShape("wsum-round", hidden=64, ffn=8, num_experts=8, top_k=2, num_tokens=24)
    prob = make_problem(shape, 2, seed=4)
    rnd = GpuCommRound(heap, RunConfig(shape, 2, timeout_s=20), name="wsum-round")
    for r in rnd.ranks:
        rnd.set_inputs(r, prob.x[r], prob.topk_idx[r], prob.topk_weights[r], np.ones(8, np.float32))
    rnd.enqueue()
    rnd.check()
    count = _unplace(rnd.bufs["recv_row"].instance(0), prob.topk_idx[0], 4, (1,))
    assert count > 0
    kc.weighted_sum(rnd.params, rnd.launch)
    with pytest.raises(CapacityError) as raised:
        rnd.check()
    assert str(raised.value) == (f"weighted sum: receive buffer overflow on rank 1 (seen by rank 0: {count} of its 48 "
                                 "slots got no expert result)")
    rnd.close()
