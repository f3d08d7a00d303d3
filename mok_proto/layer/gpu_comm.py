"""One communication round of the MoE layer on the GPU, with a stand-in expert.

    routing all-gather -> device schedule -> dispatch (pull|push) -> expert stand-in
    (y = scale[e] * x) -> combine (push|pull) -> weighted sum

All enqueued on one stream with no host readback, so a round can be captured in a CUDA graph and
replayed; every launch covers the heap's launch ranks (all W virtual ranks, or this process's
rank under NVSHMEM). Buffers have a fixed capacity chosen up front; an overflow, or a peer that
never signals, lands in an error record that `check()` turns into an exception (an overflow on
one rank on every rank: the token owners' weighted sum finds their slots that got no row there).

Legend: N tokens/rank, H hidden, K top-k, R ranks, E experts, El local experts, C capacity.
"""

from __future__ import annotations

import numpy as np

from mok_proto.config import DIRECTIONS, RunConfig
from mok_proto.kernels import comm as kc
from mok_proto.layer.gpu_base import GpuRound, contiguous_ranks, to_experts, to_tokens
from mok_proto.validate import check_array, check_layer_inputs


class GpuCommRound(GpuRound):
    def __init__(self, heap, run: RunConfig, capacity=None, align=1, blocks_per_rank=None, name="round",
                 ranks=None):
        """heap: a GPU heap (virtual or NVSHMEM) of run.num_ranks ranks. The round uses the
        run's shape, timeout and the directions of "dispatch" and "combine" in `self.policy`
        (a copy of run.policy; may be changed between rounds, the same on every rank). ranks: the
        launch ranks (default: all the heap drives; a contiguous subset leaves the others out,
        which tests use to inject a missing peer)."""
        if isinstance(run, RunConfig) and run.dtype != "float32":
            raise ValueError(f"run.dtype: the GPU round moves float32 rows, got {run.dtype!r}")
        super().__init__(heap, run, capacity, align, name)
        self.ranks = contiguous_ranks(heap, ranks)
        row_bytes = 4 * self.shape.hidden
        tables = self.tables()
        self.params = kc.pack_params({**self.comm_fields(self.ranks, row_bytes), "slot_rows": 0,
                                      **{key: tables[key] for key in ("x", "recv", "y", "slots", "base", "out",
                                                                      "scale")}})
        self.launch = self.launch_for(self.ranks, row_bytes, blocks_per_rank)

    def row_layout(self, capacity):
        s, f32 = self.shape, np.float32
        n, h, k = s.num_tokens, s.hidden, s.top_k
        return {"x": ((n, h), f32), "recv": ((capacity, h), f32), "y": ((capacity, h), f32),
                "slots": ((n * k, h), f32), "base": ((n, h), f32), "out": ((n, h), f32),
                "scale": ((s.num_experts,), f32)}

    # -----------------------------------------------------------------------------------------
    def set_inputs(self, rank, x, topk_idx, topk_weights, scale, base=None):
        """Copy one rank's inputs into its buffers (host -> device; outside any captured graph)."""
        import cupy

        b, s = self.bufs, self.shape
        x, topk_idx, topk_weights = check_layer_inputs(x, topk_idx, topk_weights, s.num_experts, s.num_tokens,
                                                       s.hidden, s.top_k)
        scale = check_array(scale, "scale", (s.num_experts,), "E", kind="f")
        for name, a in (("x", x), ("topk_idx", topk_idx), ("topk_w", topk_weights), ("scale", scale)):
            b[name].instance(rank)[...] = cupy.asarray(a, dtype=b[name].dtype)
        b["base"].instance(rank)[...] = 0 if base is None else cupy.asarray(base, dtype=np.float32)

    def enqueue(self, mark=None):
        """Enqueue one round on the current stream. `mark(stage)` (optional) is called before each
        stage and once with None at the end (benchmarks record CUDA events there)."""
        if self.failed:
            raise RuntimeError("this round reported an error before; build a new GpuCommRound")
        p, launch, mark = self.params, self.launch, mark or (lambda stage: None)
        dispatch, combine = self.policy["dispatch"], self.policy["combine"]
        for op, direction in (("dispatch", dispatch), ("combine", combine)):
            if direction not in DIRECTIONS:
                raise ValueError(f"policy: {op} must be push or pull, got {direction!r}")
        mark("begin")
        kc.begin_round(p, launch)
        kc.allgather_routing(p, launch)
        mark("schedule")
        kc.build_schedule(p, launch, self.heap.num_ranks, self.num_local, self.shape.num_tokens, self.shape.top_k)
        mark("dispatch")  # a push stage includes its receiver's wait, as a pull does
        to_experts(p, launch, dispatch, "kOpDispatchPush", "kOpDispatchPull", after_schedule=True)
        mark("expert")
        kc.expert_scale(p, launch)
        mark("combine")
        to_tokens(p, launch, combine, "kOpCombinePush", "kOpCombinePull")
        mark("weighted_sum")
        kc.weighted_sum(p, launch)
        mark(None)

    def capture(self):
        """A CUDA graph of one round (replay with graph.launch(stream))."""
        self.launch.module.function("mok::begin_round")  # compile and load outside the capture
        return self.capture_graph(self.enqueue)

    def poison(self):
        """NaN into every row buffer of the ranks this process drives (call between rounds, after a
        barrier): a consumer that reads before its producer's rows landed then reads NaN instead of
        the previous round's identical rows, so a missing wait cannot pass a bitwise check."""
        for rank in self.ranks:
            for key in ("recv", "y", "slots", "out"):
                self.bufs[key].instance(rank)[...] = np.nan

    def output(self, rank):
        return self.bufs["out"].instance(rank)

    def schedule_arrays(self, rank):
        """(expert_offsets, tokens_per_expert, src_rank, src_slot) as the device built them."""
        sched = self.bufs["sched"].instance(rank).get()
        el, cap = self.num_local, self.capacity
        offsets = sched[: el + 1]
        num_slots = int(offsets[-1])
        src_rank = sched[2 * el + 1: 2 * el + 1 + cap][:num_slots]
        src_slot = sched[2 * el + 1 + cap:][:num_slots]
        return offsets, sched[el + 1: 2 * el + 1], src_rank, src_slot

