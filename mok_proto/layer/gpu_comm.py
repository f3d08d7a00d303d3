"""One communication round of the MoE layer on the GPU, with a stand-in expert.

    routing all-gather -> device schedule -> dispatch (pull|push) -> expert stand-in
    (y = scale[e] * x) -> combine (push|pull) -> weighted sum

All enqueued on one stream with no host readback, so a round can be captured in a CUDA graph and
replayed; every launch covers the heap's launch ranks (all W virtual ranks, or this process's
rank under NVSHMEM). Buffers have a fixed capacity chosen up front; an overflow, or a peer that
never signals, lands in an error record that `check()` turns into an exception.

Legend: N tokens/rank, H hidden, K top-k, R ranks, E experts, El local experts, C capacity.
"""

from __future__ import annotations

import numpy as np

from mok_proto import abi
from mok_proto.config import DIRECTIONS, RunConfig
from mok_proto.kernels import comm as kc
from mok_proto.kernels.build import num_sms
from mok_proto.kernels.errors import ErrorRecord
from mok_proto.schedule import max_receive_slots


class GpuCommRound:
    def __init__(self, heap, run: RunConfig, capacity=None, align=1, blocks_per_rank=None, name="round",
                 ranks=None):
        """heap: a GPU heap (virtual or NVSHMEM) of run.num_ranks ranks. The round uses the
        run's shape, timeout and the directions of "dispatch" and "combine" in `self.policy`
        (a copy of run.policy; may be changed between rounds, the same on every rank). ranks: the
        launch ranks (default: all the heap drives; a contiguous subset leaves the others out,
        which tests use to inject a missing peer)."""
        if not isinstance(run, RunConfig):
            raise TypeError(f"run must be a RunConfig, got {type(run).__name__}")
        num_ranks = heap.num_ranks
        if run.num_ranks != num_ranks:
            raise ValueError(f"run.num_ranks={run.num_ranks} differs from the heap's {num_ranks} ranks")
        if run.dtype != "float32":
            raise ValueError(f"run.dtype: the GPU round moves float32 rows, got {run.dtype!r}")
        shape, timeout_s = run.shape, run.timeout_s
        self.heap, self.shape, self.policy = heap, shape, dict(run.policy)
        n, h, k, e = shape.num_tokens, shape.hidden, shape.top_k, shape.num_experts
        self.num_local = e // num_ranks
        worst = max_receive_slots(n, k, num_ranks, self.num_local, align)
        self.capacity = worst if capacity is None else int(capacity)
        if not 0 < self.capacity <= worst:
            raise ValueError(f"capacity must be in [1, {worst}] rows, got {self.capacity}")
        f32, i32 = np.float32, np.int32
        el, cap = self.num_local, self.capacity
        layout = {
            "topk_idx": ((n, k), i32), "topk_w": ((n, k), f32), "routing": ((num_ranks, n * k), i32),
            "x": ((n, h), f32), "recv": ((cap, h), f32), "y": ((cap, h), f32), "slots": ((n * k, h), f32),
            "base": ((n, h), f32), "out": ((n, h), f32), "recv_row": ((n * k,), i32),
            "sched": ((kc.schedule_words(el, cap),), i32),
            "sched_scratch": ((kc.schedule_scratch_words(num_ranks, n, k, el),), i32),
            "flags": ((len(abi.FLAG_KIND), num_ranks), np.uint64),
            "state": ((abi.CONST["kStateWords"],), np.uint64), "scale": ((e,), f32),
        }
        self.bufs = {key: heap.alloc(f"{name}.{key}", shp, dt) for key, (shp, dt) in layout.items()}
        self.error = ErrorRecord(timeout_s)  # this process's
        ranks = list(heap.launch_ranks) if ranks is None else list(ranks)
        if not ranks or ranks != list(range(ranks[0], ranks[0] + len(ranks))) \
                or not set(ranks) <= set(heap.launch_ranks):
            raise ValueError(f"ranks must be a contiguous subset of {list(heap.launch_ranks)}, got {ranks}")
        self.ranks = ranks
        fields = {name: buf.ptr_table.data.ptr for name, buf in self.bufs.items()}
        fields.update(num_ranks=num_ranks, rank_base=ranks[0], num_tokens=n, top_k=k, num_experts=e,
                      num_local_experts=el, row_bytes=4 * h, slot_rows=0, hidden=h, capacity=cap, align=align,
                      timeout_ns=int(timeout_s * 1e9), error=self.error.ptr)
        self.params = kc.pack_params(fields)
        if blocks_per_rank is None:
            blocks_per_rank = max(1, min(4 * num_sms() // len(ranks), -(-max(n * k, cap) // 8)))
        self.launch = kc.Launch(len(ranks), blocks_per_rank, kc.Launch.vec_for(4 * h))
        self.failed = False

    # -----------------------------------------------------------------------------------------
    def set_inputs(self, rank, x, topk_idx, topk_weights, scale, base=None):
        """Copy one rank's inputs into its buffers (host -> device; outside any captured graph)."""
        import cupy

        b, s = self.bufs, self.shape
        checks = {"x": (x, (s.num_tokens, s.hidden)), "topk_idx": (topk_idx, (s.num_tokens, s.top_k)),
                  "topk_w": (topk_weights, (s.num_tokens, s.top_k)), "scale": (scale, (s.num_experts,))}
        for name, (a, want) in checks.items():
            if tuple(np.shape(a)) != want:
                raise ValueError(f"{name} must have shape {want}, got {np.shape(a)}")
        idx = np.asarray(topk_idx)
        if not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"topk_idx must be integers, got {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= s.num_experts):
            raise ValueError(f"topk_idx values must be in [0, {s.num_experts})")
        for name, (a, _) in checks.items():
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
        if dispatch == "pull":
            kc.dispatch_pull(p, launch)
        else:
            kc.wait_peers(p, launch, "kFlagMap", "kOpDispatchPush")
            kc.dispatch_push(p, launch)
            kc.wait_peers(p, launch, "kFlagDispatch", "kOpDispatchPush")
        mark("expert")
        kc.expert_scale(p, launch, signal_ready=combine == "pull")
        mark("combine")
        if combine == "push":
            kc.combine_push(p, launch)
            kc.wait_peers(p, launch, "kFlagCombine", "kOpCombinePush")
        else:
            kc.wait_peers(p, launch, "kFlagReady", "kOpCombinePull")
            kc.combine_pull(p, launch)
        mark("weighted_sum")
        kc.weighted_sum(p, launch)
        mark(None)

    def capture(self):
        """A CUDA graph of one round (replay with graph.launch(stream))."""
        import cupy

        kc.MODULE.function("mok::begin_round")  # compile and load outside the capture
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            self.enqueue()
            graph = stream.end_capture()
        return graph

    def check(self):
        """Synchronize and raise what the error record holds (the only host readback). After an
        error the round is spent: flags, counters and epochs may be mid-round; build a new one."""
        try:
            self.error.check()
        except Exception:
            self.failed = True
            raise

    def close(self):
        """Free the round's symmetric buffers (collective under NVSHMEM)."""
        for buf in self.bufs.values():
            self.heap.free(buf)
        self.bufs = {}

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

