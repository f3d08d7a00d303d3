"""The global problem of the R-process benchmark (scripts/bench_layer_mpi.py), the same on every
rank and in both modes (R processes, or R virtual ranks in one process): every rank's routing
(uniform, or under a routing spec with rank 0 the timed one: mok_proto.routing), the receive
capacity, the bytes one transfer moves, and each rank's weights and inputs generated on the GPU
from seeded generators."""

from __future__ import annotations

import time
import traceback

import numpy as np

from mok_proto.bench.digests import result_digests
from mok_proto.config import RunConfig, get_shape
from mok_proto.layer.gpu import layer_row_layout, receive_capacity, round_layout, symmetric_bytes
from mok_proto.routing import UNIFORM, RoutingSpec
from mok_proto.routing import topk as routed_topk

TIMEOUT_S = 60.0  # every device wait of the layer (the first pass compiles kernels)
MARGIN_BYTES = 4 << 30  # device memory left free beside an estimate (contexts, caches, temporaries)
WEIGHT_CHUNK_BYTES = 1 << 30  # float32 temporary while generating weights
SHARED_STREAM = 999  # the shared expert's generator: seed * 1000 + 999 (rank r's: seed * 1000 + r)


def make_routing(shape, num_ranks: int, seed: int, routing: RoutingSpec = UNIFORM):
    """Every rank's routing, built identically by every process from `seed`: topk_idx [R,N,K]
    int32 (K distinct experts: uniform, or drawn under `routing` with rank 0 timed) and
    topk_weights [R,N,K] float32 (rows sum to 1)."""
    rng = np.random.default_rng(seed)
    n, k, e = shape.num_tokens, shape.top_k, shape.num_experts
    if routing.is_uniform:
        topk = np.argsort(rng.random((num_ranks * n, e), dtype=np.float32), axis=1)[:, :k].astype(np.int32)
    else:
        topk = routed_topk(routing, num_ranks, n, e, k, rng).reshape(num_ranks * n, k)
    w = rng.random((num_ranks * n, k), dtype=np.float32) + np.float32(0.5)
    w /= w.sum(axis=1, keepdims=True)
    return topk.reshape(num_ranks, n, k), w.reshape(num_ranks, n, k)


def crossing_bytes(topk, num_experts: int, hidden: int) -> int:
    """Bytes of bf16 rows one transfer moves over a GPU's links in one direction, for the busiest
    rank: max over ranks of the rows it sends to, or receives from, other ranks (the reverse
    transfer moves the same rows back)."""
    num_ranks = topk.shape[0]
    owner = topk // (num_experts // num_ranks)  # [R, N, K]
    source = np.arange(num_ranks)[:, None, None]
    sent = (owner != source).sum(axis=(1, 2))
    received = [int(((owner == r) & (source != r)).sum()) for r in range(num_ranks)]
    return int(max(sent.max(), max(received))) * hidden * 2


def fill_layer(layer, rank: int, topk, topk_w, seed: int) -> None:
    """Rank `rank`'s weights, inputs and output gradient, generated on the GPU: its routed experts
    (chunks of experts, normal * fan_in^-0.5), x and dout (standard normal) from
    cupy.random.default_rng(seed * 1000 + rank), the shared expert (the same on every rank) from
    seed * 1000 + SHARED_STREAM. Deterministic, so both modes build the same problem."""
    import cupy

    s = layer.shape
    h, i, i_shared = s.hidden, s.ffn, s.shared_ffn_size
    rng = cupy.random.default_rng(seed * 1000 + rank)
    for key, dims in (("w_gate", (h, i)), ("w_up", (h, i)), ("w_down", (i, h))):
        per = max(1, WEIGHT_CHUNK_BYTES // (4 * dims[0] * dims[1]))
        for first in range(0, layer.num_local, per):
            num = min(per, layer.num_local - first)
            layer.set_weight_part(rank, key, rng.standard_normal((num,) + dims, dtype=np.float32) * dims[0] ** -0.5,
                                  first)
    x = rng.standard_normal((s.num_tokens, h), dtype=np.float32)
    dout = rng.standard_normal((s.num_tokens, h), dtype=np.float32)
    layer.set_inputs(rank, x, topk[rank], topk_w[rank])
    layer.set_dout(rank, dout)
    if layer.has_shared:
        shared = cupy.random.default_rng(seed * 1000 + SHARED_STREAM)
        for key, dims in (("shared_gate", (h, i_shared)), ("shared_up", (h, i_shared)), ("shared_down", (i_shared, h))):
            layer.set_weight_part(rank, key, shared.standard_normal(dims, dtype=np.float32) * dims[0] ** -0.5)


class Problem:
    """One shape's global problem: routing of every rank, receive capacity, bytes per transfer."""

    def __init__(self, name: str, tokens: int | None, num_ranks: int, seed: int, routing: RoutingSpec = UNIFORM):
        paper = get_shape(name)
        self.name, self.shape = name, paper if tokens is None else paper.with_tokens(tokens)
        self.num_ranks, self.seed, self.routing = num_ranks, seed, routing
        if self.shape.num_experts % num_ranks:
            raise ValueError(f"{name}: E={self.shape.num_experts} experts are not divisible by R={num_ranks} ranks")
        self.topk, self.topk_w = make_routing(self.shape, num_ranks, seed, routing)
        self.capacity = receive_capacity(self.topk, self.shape.num_experts)
        self.run = RunConfig(self.shape, num_ranks, timeout_s=TIMEOUT_S)
        self.layer_bytes = symmetric_bytes(self.run, self.capacity)
        self.crossing_bytes = crossing_bytes(self.topk, self.shape.num_experts, self.shape.hidden) \
            if num_ranks > 1 else 0

    def array_names(self) -> list:
        """The symmetric arrays of this shape's GpuMoELayer (name=self.name), in alloc order."""
        layout = {**round_layout(self.run, self.capacity),
                  **layer_row_layout(self.shape, self.run.num_local_experts, self.capacity)}
        return [f"{self.name}.{key}" for key in layout]

    def config(self) -> dict:
        s = self.shape
        return {"shape": self.name, "ranks": self.num_ranks, "tokens_per_rank": s.num_tokens, "hidden": s.hidden,
                "ffn": s.ffn, "experts": s.num_experts, "local_experts": s.num_experts // self.num_ranks,
                "top_k": s.top_k, "shared_ffn": s.shared_ffn_size if s.num_shared else 0, "seed": self.seed,
                "routing": str(self.routing), "capacity": self.capacity, "layer_bytes": self.layer_bytes,
                "crossing_bytes": self.crossing_bytes}


def new_layer(ranks, prob, seed: int):
    """Our layer for this shape on the heap, with this rank's weights and inputs."""
    from mok_proto.layer.gpu import GpuMoELayer

    layer = GpuMoELayer(ranks.heap, prob.run, capacity=prob.capacity, name=prob.name)
    fill_layer(layer, ranks.rank, prob.topk, prob.topk_w, seed)
    return layer


def single_shape(name: str, args, num_ranks: int) -> dict:
    """One shape on R virtual ranks: {"config", "per_rank": digests} or {"config", "skipped" | "error"}."""
    import cupy

    from mok_proto.layer.gpu import GpuMoELayer
    from mok_proto.symm.virtual import VirtualWorld

    start = time.time()
    try:
        prob = Problem(name, args.tokens, num_ranks, args.seed, args.routing)
    except ValueError as e:
        return {"config": {"shape": name}, "skipped": str(e)}
    entry = {"config": prob.config()}
    cupy.get_default_memory_pool().free_all_blocks()
    free = cupy.cuda.runtime.memGetInfo()[0]
    need = num_ranks * prob.layer_bytes + MARGIN_BYTES
    if need > free:
        entry["skipped"] = (f"{num_ranks} virtual ranks need {need / 1e9:.1f} GB with the margin, the GPU has "
                            f"{free / 1e9:.1f} GB free")
        return entry
    world = layer = None
    try:
        world = VirtualWorld(num_ranks)
        layer = GpuMoELayer(world, prob.run, capacity=prob.capacity, name=name)
        for rank in range(num_ranks):
            fill_layer(layer, rank, prob.topk, prob.topk_w, args.seed)
        layer.enqueue_forward()
        layer.enqueue_backward()
        layer.check()
        entry["per_rank"] = {str(rank): result_digests(layer, rank) for rank in range(num_ranks)}
        print(f"# {name}: {time.time() - start:.1f} s, capacity {prob.capacity} rows, digests of {num_ranks} ranks",
              flush=True)
    except Exception as e:  # noqa: BLE001 - recorded, the next shape still runs
        traceback.print_exc()
        entry["error"] = f"{type(e).__name__}: {e}"
    finally:
        try:
            if layer is not None:
                layer.close()
            if world is not None:
                world.close()
        except Exception as e:  # noqa: BLE001 - after a device error freeing can fail too
            entry.setdefault("error", f"freeing failed: {type(e).__name__}: {e}")
        layer = world = None
        cupy.get_default_memory_pool().free_all_blocks()
    return entry
