"""What the GPU communication round (gpu_comm.py) and the GPU layer (gpu.py) share: a RunConfig
checked against the heap, the receive capacity, the symmetric buffers of routing, schedule and
flags (layout.round_layout), one error record, the launch ranks and their CommParams fields, check / close / capture.

Legend: N tokens/rank, K top-k, R ranks, El = E/R local experts, C receive capacity (rows),
W launch ranks (grid.y of every launch).
"""

from __future__ import annotations

from mok_proto.config import RunConfig
from mok_proto.kernels import comm as kc
from mok_proto.kernels.build import num_sms
from mok_proto.kernels.errors import ErrorRecord
from mok_proto.layer.layout import num_turns, round_layout, whole_ring
from mok_proto.link import comm_fields as link_fields
from mok_proto.schedule import max_receive_slots


class GpuRound:
    """Subclasses give `row_layout(rows)`: {name: (shape, dtype)} of their own buffers for a ring of
    `rows` receive rows."""

    RUNS_FP8 = False  # a subclass with FP8 passes (GpuMoELayer) says so

    def __init__(self, heap, run: RunConfig, capacity: int | None, align: int, name: str,
                 macrobatch_rows: int | None = None):
        if not isinstance(run, RunConfig):
            raise TypeError(f"run must be a RunConfig, got {type(run).__name__}")
        if heap.num_ranks != run.num_ranks:
            raise ValueError(f"num_ranks: config says R={run.num_ranks} but the heap has {heap.num_ranks} ranks")
        if run.precision != "bf16" and not self.RUNS_FP8:
            raise ValueError(f"precision {run.precision}: {type(self).__name__} has bf16 passes only (GpuMoELayer and "
                             "the CPU layer run fp8 routed experts)")
        self.heap, self.run, self.shape, self.policy = heap, run, run.shape, dict(run.policy)
        self.num_local, self.align = run.num_local_experts, align
        worst = max_receive_slots(run.shape.num_tokens, run.shape.top_k, run.num_ranks, run.num_local_experts, align)
        self.capacity = worst if capacity is None else int(capacity)
        if not 0 < self.capacity <= worst:
            raise ValueError(f"capacity must be in [1, {worst}] rows, got {self.capacity}")
        # The ring: the row buffers hold M rows, a pass runs T = ceil(C / M) turns (docs/design.md 3.1).
        whole = whole_ring(self.capacity, align)
        self.ring_rows = whole if macrobatch_rows is None else int(macrobatch_rows)
        if self.ring_rows < 1 or self.ring_rows % align or self.ring_rows > whole:
            raise ValueError(f"macrobatch_rows must be a multiple of {align} (the segment alignment) in [{align}, "
                             f"{whole}] (the capacity, rounded up), got {macrobatch_rows}")
        self.num_turns = num_turns(self.capacity, self.ring_rows)
        layout = {**round_layout(run, self.capacity, self.num_turns), **self.row_layout(self.ring_rows)}
        self.bufs = {key: heap.alloc(f"{name}.{key}", shp, dt) for key, (shp, dt) in layout.items()}
        self.error = ErrorRecord(run.timeout_s)  # every wait and GEMM pipeline of this process reports here
        self.failed = False

    def row_layout(self, capacity: int) -> dict:
        raise NotImplementedError

    def tables(self) -> dict:
        """{buffer name: device address of its peer table}."""
        return {key: buf.ptr_table.data.ptr for key, buf in self.bufs.items()}

    def comm_fields(self, ranks, row_bytes: int, turn: int = 0) -> dict:
        """The CommParams fields every round sets (the row buffers and slot_rows are the caller's),
        for turn `turn` of the ring (one turn: ring_rows 0, the rows are where the schedule put them)."""
        s, run, t = self.shape, self.run, self.tables()
        ring = dict(ring_rows=0, ring_lo=0, num_turns=1, turn_sched=0)
        if self.num_turns > 1:
            ring = dict(ring_rows=self.ring_rows, ring_lo=turn * self.ring_rows, num_turns=self.num_turns,
                        turn_sched=t["turn_sched"])
        return dict(num_ranks=run.num_ranks, rank_base=ranks[0], num_tokens=s.num_tokens, top_k=s.top_k,
                    num_experts=s.num_experts, num_local_experts=self.num_local, row_bytes=row_bytes, **ring,
                    hidden=s.hidden, capacity=self.capacity, align=self.align,
                    timeout_ns=int(run.timeout_s * 1e9), error=self.error.ptr, **link_fields(run.link),
                    **{key: t[key] for key in ("topk_idx", "topk_w", "routing", "recv_row", "sched", "sched_scratch",
                                               "flags", "state", "link_clock")})

    def launch_for(self, ranks, row_bytes: int, blocks_per_rank: int | None) -> kc.Launch:
        """Launch geometry over `ranks`: by default kc.Launch.default_blocks_per_rank of the larger
        of the slot and receive buffers."""
        s = self.shape
        if blocks_per_rank is None:
            rows = max(s.num_tokens * s.top_k, min(self.capacity, self.ring_rows))
            blocks_per_rank = kc.Launch.default_blocks_per_rank(rows, num_sms(), len(ranks))
        return kc.Launch(len(ranks), blocks_per_rank, kc.Launch.vec_for(row_bytes), link=self.run.link is not None)

    def check(self):
        """Synchronize and raise what the error record holds (the only host readback). After an
        error the object is spent: flags, counters and epochs may be mid-round; build a new one."""
        try:
            self.error.check()
        except Exception:
            self.failed = True
            raise

    def close(self):
        """Free the symmetric buffers (collective under NVSHMEM)."""
        for buf in self.bufs.values():
            self.heap.free(buf)
        self.bufs = {}

    @staticmethod
    def capture_graph(enqueue):
        """A CUDA graph of what `enqueue()` launches (replay with graph.launch(stream)). Kernels
        must be compiled and descriptors uploaded before (run once outside the capture)."""
        import cupy

        # NOTE: replays run on non-blocking streams, unordered with eager work on the null stream:
        # an eager pass still running when the first replay starts would share its epoch and rows.
        cupy.cuda.Device().synchronize()
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            try:
                enqueue()
            finally:  # an error raised while enqueuing must not leave the stream capturing
                graph = stream.end_capture()
        return graph


def to_experts(p, launch: kc.Launch, direction: str, push_op: str, pull_op: str, after_schedule: bool):
    """Token-side rows into the expert owners' receive rows (dispatch; reverse-combine), then every
    rank may read its receive rows. Right after the schedule (dispatch) a pull needs no publish
    (the routing flags the schedule waited for also published the token rows) and a push first
    waits until every owner placed its rows; later in a step (reverse-combine) a pull first
    publishes and waits, a push just goes."""
    if direction == "pull":
        _publish_for_pull(p, launch, pull_op, after_schedule)
        kc.move_rows("dispatch_pull", p, launch)
    else:
        if after_schedule:
            kc.wait_peers(p, launch, "kFlagMap", push_op)
        kc.move_rows("dispatch_push", p, launch)
        kc.wait_peers(p, launch, "kFlagDispatch", push_op)


def to_tokens(p, launch: kc.Launch, direction: str, push_op: str, pull_op: str):
    """Result rows (receive-row order) into the token owners' slot buffers (combine;
    reverse-dispatch), then every rank may read its slots."""
    if direction == "push":
        kc.move_rows("combine_push", p, launch)
        kc.wait_peers(p, launch, "kFlagCombine", push_op)
    else:
        kc.raise_flag(p, launch, "kFlagReady")  # my result rows are written
        kc.wait_peers(p, launch, "kFlagReady", pull_op)
        kc.move_rows("combine_pull", p, launch)


def _publish_for_pull(p, launch, pull_op: str, after_schedule: bool):
    """Before the expert owners pull token-side rows: publish mine and wait for every peer's
    (right after the schedule nothing: the routing flags it waited for published them)."""
    if not after_schedule:
        kc.raise_flag(p, launch, "kFlagRouting")  # my source rows are written
        kc.wait_peers(p, launch, "kFlagRouting", pull_op)


def to_experts_before_fused(p, launch, pulled_inside: bool, push_op: str, pull_op: str, after_schedule: bool):
    """The token-side rows' transfer before a fused kernel: pulled inside it (what to_experts does
    before its pull: publish and wait, unless right after the schedule), or pushed now as in
    to_experts."""
    if pulled_inside:
        _publish_for_pull(p, launch, pull_op, after_schedule)
    else:
        to_experts(p, launch, "push", push_op, pull_op, after_schedule)


def to_tokens_after_fused(p, launch, pushed_inside: bool, push_op: str, pull_op: str):
    """The result rows' transfer after a fused kernel: pushed inside it (its stores are complete
    when it ends: raise the flag, wait for every peer's), or pulled now as in to_tokens."""
    if pushed_inside:
        kc.raise_flag(p, launch, "kFlagCombine")
        kc.wait_peers(p, launch, "kFlagCombine", push_op)
    else:
        to_tokens(p, launch, "pull", push_op, pull_op)


def contiguous_ranks(heap, ranks) -> list:
    """`ranks` (None: every rank the heap drives) as a list, checked to be a contiguous run of the
    heap's launch ranks (a launch covers rank_base + blockIdx.y)."""
    ranks = list(heap.launch_ranks) if ranks is None else list(ranks)
    if not ranks or ranks != list(range(ranks[0], ranks[0] + len(ranks))) or not set(ranks) <= set(heap.launch_ranks):
        raise ValueError(f"ranks must be a contiguous subset of {list(heap.launch_ranks)}, got {ranks}")
    return ranks
