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


def small_layer(heap, name: str, seed: int, num_tokens: int, timeout_s: float = 20, routing: str = "random",
                capacity: int | None = None):
    """A GpuMoELayer of H = I = 256, E = 2 R, K = 2 (the error checks' layer) with every rank's
    weights, inputs and output gradient set."""
    from mok_proto.config import MoEShape, RunConfig
    from mok_proto.layer.gpu import GpuMoELayer
    from mok_proto.problem import make_problem

    num_ranks = heap.num_ranks
    shape = MoEShape(name, hidden=256, ffn=256, num_experts=2 * num_ranks, top_k=2, num_tokens=num_tokens)
    prob = make_problem(shape, num_ranks, seed=seed, routing=routing)
    layer = GpuMoELayer(heap, RunConfig(shape, num_ranks, timeout_s=timeout_s), capacity=capacity, name=name)
    for rank in layer.ranks:
        layer.set_weights(rank, prob.local_weights(rank))
        layer.set_inputs(rank, prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank])
        layer.set_dout(rank, prob.dout[rank])
    return layer


def check_overflow(heap, name: str = "overflow", configure=None, backward: bool = False, timeout_s: float = 20):
    """Every token's first choice on rank 0's expert, one receive row too few: rank 0's layer
    raises CapacityError naming the overflow (the other ranks finish their round cleanly).
    `configure(layer)` (optional) sets the layer up before the forward (e.g. a fused plan).
    backward: then a backward of that forward, which must raise, never hang nor run on the
    overflowed round: a layer that raised CapacityError refuses it (RuntimeError, nothing
    enqueued), and a rank whose forward finished (NVSHMEM: one process per rank, not rank 0)
    times out waiting for rank 0's reverse-combine (SymmTimeoutError naming peer 0).
    timeout_s: the layer's wait bound (the backward's timeout takes that long)."""
    from mok_proto.errors import CapacityError, SymmTimeoutError

    tokens = 8
    layer = small_layer(heap, name, seed=3, num_tokens=tokens, routing="one-expert",
                        capacity=tokens * heap.num_ranks - 1, timeout_s=timeout_s)
    if configure is not None:
        configure(layer)
    layer.enqueue_forward()
    overflowed = False
    try:
        layer.check()
    except CapacityError as e:
        assert "overflow on rank" in str(e), str(e)
        overflowed = True
    else:
        assert 0 not in layer.ranks, "rank 0 receives every first choice and must overflow"
    heap.barrier()
    if backward:
        if overflowed:
            try:
                layer.enqueue_backward()
            except RuntimeError as e:
                assert "reported an error before" in str(e), str(e)
            else:
                raise AssertionError("a backward after an overflowed forward was not refused")
        else:
            layer.enqueue_backward()
            try:
                layer.check()
            except SymmTimeoutError as e:
                assert e.peer == 0 and e.op.startswith("reverse-combine"), str(e)
            else:
                raise AssertionError(f"ranks {layer.ranks}: a backward whose peer 0 refused it (its forward "
                                     "overflowed) did not time out")
        heap.barrier()
    layer.close()
