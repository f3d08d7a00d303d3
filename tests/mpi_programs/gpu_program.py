"""What the GPU check programs share: their common options and the heap they run on (virtual
ranks in this process, or NVSHMEM with one rank per process under mpirun)."""

import argparse


def parser(cases, with_policies: bool = False) -> argparse.ArgumentParser:
    """--backend, --ranks, --cases (of `cases`), --replays (and --policies, for `policies`); a
    program adds its own options."""
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=("virtual", "nvshmem"), required=True)
    p.add_argument("--ranks", type=int, default=4, help="virtual ranks (virtual backend)")
    p.add_argument("--cases", default=",".join(cases))
    p.add_argument("--replays", type=int, default=20)
    if with_policies:
        p.add_argument("--policies", choices=("all", "mok"), default="all")
    return p


def policies(args, forward_only: bool = False, backward_only: bool = False) -> list:
    """The direction policies `--policies` asks for: all 16, or MoK's; forward_only: only the four
    (dispatch, combine) pairs, the backward's directions as MoK's (they change no forward bit);
    backward_only: the four (reverse-combine, reverse-dispatch) pairs, the forward's as MoK's."""
    import itertools

    from mok_proto.config import DIRECTIONS, MOK_POLICY, OPERATORS

    if args.policies == "mok":
        return [dict(MOK_POLICY)]
    every = [dict(zip(OPERATORS, combo)) for combo in itertools.product(DIRECTIONS, repeat=4)]
    if forward_only:
        every = [p for p in every if all(p[op] == MOK_POLICY[op] for op in ("rev_combine", "rev_dispatch"))]
    if backward_only:
        every = [p for p in every if all(p[op] == MOK_POLICY[op] for op in ("dispatch", "combine"))]
    return every


def open_heap(args):
    """(heap, MPI communicator or None): VirtualWorld(--ranks), or NvshmemHeap over COMM_WORLD."""
    if args.backend == "virtual":
        from mok_proto.symm.virtual import VirtualWorld
        return VirtualWorld(args.ranks), None
    from mpi4py import MPI

    from mok_proto.symm.nvshmem import NvshmemHeap
    return NvshmemHeap(), MPI.COMM_WORLD


def all_ranks(comm, per_rank: dict) -> dict:
    """{rank: value} of this process -> of every process (MPI under NVSHMEM)."""
    if comm is None:
        return per_rank
    merged = {}
    for part in comm.allgather(per_rank):
        merged.update(part)
    return merged


def small_problem(num_ranks: int, name: str, seed: int, num_tokens: int, routing: str = "random"):
    """(shape, problem) of small_layer: H = I = 256, E = 2 R, K = 2, every rank's inputs."""
    from mok_proto.config import MoEShape
    from mok_proto.problem import make_problem

    shape = MoEShape(name, hidden=256, ffn=256, num_experts=2 * num_ranks, top_k=2, num_tokens=num_tokens)
    return shape, make_problem(shape, num_ranks, seed=seed, routing=routing)


def small_layer(heap, name: str, seed: int, num_tokens: int, timeout_s: float = 20, routing: str = "random",
                capacity: int | None = None):
    """A GpuMoELayer of small_problem (the error checks' layer) with every rank's weights, inputs
    and output gradient set."""
    from mok_proto.config import RunConfig
    from mok_proto.layer.gpu import GpuMoELayer

    num_ranks = heap.num_ranks
    shape, prob = small_problem(num_ranks, name, seed, num_tokens, routing)
    layer = GpuMoELayer(heap, RunConfig(shape, num_ranks, timeout_s=timeout_s), capacity=capacity, name=name)
    for rank in layer.ranks:
        layer.set_weights(rank, prob.local_weights(rank))
        layer.set_inputs(rank, prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank])
        layer.set_dout(rank, prob.dout[rank])
    return layer


OVERFLOW_SEED = 3


def overflow_case(num_ranks: int, name: str = "overflow") -> dict:
    """The overflow check's setup (no GPU needed): small_problem with every token's first choice
    on expert 0 (rank 0) and N R > SEGMENT_ROWS tokens, so expert 0 alone needs two segments (the
    layer pads each expert to SEGMENT_ROWS), and the capacity of the largest other rank: rank 0
    overflows, no other rank does. {"tokens", "capacity", "need": receive rows per rank as the
    schedule places them, "unplaced": per rank, its slots routed to rank 0 (they get no row)}."""
    import numpy as np

    from mok_proto.plan import SEGMENT_ROWS
    from mok_proto.schedule import build_pull_schedule

    tokens = SEGMENT_ROWS // num_ranks + 8
    shape, prob = small_problem(num_ranks, name, OVERFLOW_SEED, tokens, routing="one-expert")
    need = [build_pull_schedule(prob.topk_idx, shape.num_experts, r, align=SEGMENT_ROWS).num_slots
            for r in range(num_ranks)]
    capacity = max(need[1:]) if num_ranks > 1 else need[0] - 1
    assert need[0] > capacity >= max(need[1:], default=0), (need, capacity)
    num_local = shape.num_experts // num_ranks
    unplaced = [int(np.count_nonzero(prob.topk_idx[r] // num_local == 0)) for r in range(num_ranks)]
    return {"tokens": tokens, "slots": tokens * shape.top_k, "capacity": capacity, "need": need,
            "unplaced": unplaced}


def overflow_message(case: dict, rank: int) -> str:
    """What CapacityError says on `rank` after overflow_case's forward: rank 0's schedule reports its
    overflow; a rank whose own buffer fits (NVSHMEM: its own error record) sees rank 0's overflow
    in its weighted sum, from its slots routed there (recv_row = -1)."""
    if rank == 0:
        return f"schedule: receive buffer overflow on rank 0: needs {case['need'][0]} rows, capacity is " \
               f"{case['capacity']}"
    return f"weighted sum: receive buffer overflow on rank 0 (seen by rank {rank}: {case['unplaced'][rank]} of " \
           f"its {case['slots']} slots got no expert result)"


def check_overflow(heap, name: str = "overflow", configure=None, backward: bool = False, timeout_s: float = 20):
    """overflow_case: rank 0's receive buffer overflows, no other rank's does. Every rank's forward
    raises CapacityError naming rank 0 (overflow_message): virtual ranks share one error record,
    which holds rank 0's schedule report; under NVSHMEM each other rank's own record holds its
    weighted sum's report of its slots that got no row on rank 0 (never a silently wrong output).
    `configure(layer)` (optional) sets the layer up before the forward (e.g. a fused plan).
    backward: then a backward of that forward, which every rank must refuse (the layer raised, so
    it is failed: RuntimeError, nothing enqueued; none may hang or run on the overflowed round).
    timeout_s: the layer's wait bound."""
    from mok_proto.errors import CapacityError

    case = overflow_case(heap.num_ranks, name)
    layer = small_layer(heap, name, seed=OVERFLOW_SEED, num_tokens=case["tokens"], routing="one-expert",
                        capacity=case["capacity"], timeout_s=timeout_s)
    if configure is not None:
        configure(layer)
    layer.enqueue_forward()
    try:
        layer.check()
    except CapacityError as e:
        # virtual ranks: one record, and rank 0's schedule reported first (earlier launch)
        want = overflow_message(case, 0 if 0 in layer.ranks else layer.ranks[0])
        assert "overflow on rank 0" in str(e) and want in str(e), (want, str(e))
    else:
        raise AssertionError(f"ranks {layer.ranks}: the forward raised nothing although rank 0's receive buffer "
                             "overflowed (their slots routed there got no result)")
    heap.barrier()
    if backward:
        try:
            layer.enqueue_backward()
        except RuntimeError as e:
            assert "reported an error before" in str(e), str(e)
        else:
            raise AssertionError(f"ranks {layer.ranks}: a backward after an overflowed forward was not refused")
        heap.barrier()
    layer.close()
