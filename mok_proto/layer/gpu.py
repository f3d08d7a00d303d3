"""The MoE layer on the GPU, stage by stage (the "sequential" schedule): forward and backward in
bf16 with fp32 accumulation and fp32 weight gradients, each of the four transfers push or pull
(RunConfig.precision "fp8": the routed experts' GEMMs block-scaled e4m3, layer/gpu_fp8.py).

Legend: N tokens/rank, H hidden, I expert FFN, Is shared FFN, E experts, El = E/R local experts,
K top-k, R ranks, C receive capacity (rows), W launch ranks driven by this process. A *slot*
s = t*K + j is token t's j-th choice; a *receive row* is a row of an expert owner's receive
buffer (placed by the MoK pull schedule, expert by expert).

Forward (one round, epoch e):
  routing all-gather -> device schedule -> shared expert (gate/up + SwiGLU, down)
  -> dispatch (pull | push) -> routed gate/up + SwiGLU, down -> combine (push | pull) into the
  token owner's slot buffer -> out = shared + sum_j w[t,j] * y_slots[t*K+j]   (fixed order)
Backward (epoch e + 1, the forward's schedule; a ring of several turns and a pushed FP8 dispatch
add epochs of their own, the same on every rank):
  dy_slots = w * dout -> shared expert backward -> reverse-combine (pull | push) of dy_slots
  -> down backward with the SwiGLU backward fused -> gate/up backward -> reverse-dispatch
  (push | pull) of the input-gradient rows into the owner's slots -> routed weight gradients
  -> dx = shared dx + sum_j dx_slots[t*K+j], d topk_weights = <dout, y_slots>
The fused forward (`set_forward_plan(plan)`, plan.fused_forward): after the schedule, one
persistent launch of cuda/fused.cuh runs the shared and routed GEMMs with the pull dispatch and
the push combine inside (a push dispatch / pull combine runs as above, before / after it), then
the combine flag and the weighted sum; its output and cache are bitwise the sequential ones.
The fused backward (`set_backward_plan(plan)`, plan.fused_backward): one launch runs the shared
expert's gradients, per minibatch down_bwd and gate_up_bwd, the deferred weight gradients (FP8
ones after the kernel, plan.routed_wgrads), with the pull reverse-combine and the push reverse-dispatch
inside, and (plan.token_grads, plan.scale: the defaults) the slot sum and d topk_weights once every
peer's reverse-dispatch is in (kFlagCombine), and first dy_slots = w * dout (published: kFlagRouting).
Every launch covers the launch ranks (all W virtual ranks, or this process's rank under
NVSHMEM); GEMMs launch once per rank. Nothing is read back to the host: the pair of passes can
be captured in one CUDA graph (`capture()`). Every wait is bounded; `check()` raises
SymmTimeoutError / CapacityError / KernelTimeoutError naming the operator and rank. A receive
buffer overflow raises CapacityError on every rank that routed a slot to the overflowing rank:
its schedule reports it, and every token owner's weighted sum finds its slots that got no row
there (recv_row = -1) and reports it in its own error record (under NVSHMEM each process has one)
naming that rank (a rank that routed none there raises nothing in the forward; its backward
then times out on the failed rank's reverse-combine). Direction
changes data movement only, never arithmetic, so all 16 policies give bitwise-equal results.

NOTE (buffer reuse across rounds): passes alternate, forward then backward (enforced on the
host: a backward needs the forward before it). A rank's receive rows, slot buffers and
published rows are overwritten only in its next step, whose schedule first waits for every
peer's routing flag of that forward; the backward's buffers (dy_slots, recv_dy, dx_rows,
dx_slots) are written by peers only after they finished this step's forward, and read again
only in the next step, behind that schedule wait. So no peer can still be reading or writing
them and no barrier is needed between steps. Two backwards in a row would break this (a push
reverse-combine could overwrite receive rows a peer's weight gradients still read): graphs of
the backward alone, replayed back to back, are safe only where the peers do not run (the
benchmarks' staged emulation) or with a barrier between replays (the tests).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mok_proto import abi
from mok_proto.config import DIRECTIONS, RunConfig
from mok_proto.kernels import comm as kc
from mok_proto.kernels import gemm
from mok_proto.kernels import token as kt
from mok_proto.layer import gpu_fp8, gpu_ring
from mok_proto.layer.gpu_base import (GpuRound, contiguous_ranks, to_experts, to_experts_before_fused, to_tokens,
                                      to_tokens_after_fused)
# (round_layout, layer_row_layout: also imported from here, as the layer's own)
from mok_proto.layer.layout import (BF16, F32, FP8_WEIGHTS, I32, U8, layer_layout, layer_row_layout,  # noqa: F401
                                    nbytes, round_layout, whole_ring)
from mok_proto.memory import default_macrobatch_rows, kinds_of, layer_memory
from mok_proto.plan import MOVER_KINDS, SEGMENT_ROWS, FusedKnobs, fused_plan, without_shared

TILE = abi.CONST["kBN"]  # H, I and Is must be multiples of it (the GEMM tiles)


def check_tiles(shape) -> None:
    """ValueError (one line) unless H, I and (with a shared expert) Is are multiples of the GEMM
    tile the GPU layer needs."""
    dims = [("hidden", shape.hidden), ("ffn", shape.ffn)] + [("shared_ffn", shape.shared_ffn_size)] * shape.num_shared
    for dim, value in dims:
        if value % TILE:
            raise ValueError(f"shape {shape.name}: {dim}={value}, but the GPU layer's GEMM tiles need a multiple of "
                             f"{TILE} (the 'tile' preset is the smallest; or use the CPU backend)")


def bf16(a):
    """float array (NumPy or CuPy) -> bf16 bits (uint16), round to nearest even."""
    return gemm.to_bf16(a)


def token_fields(shape, num_local: int, rank_base: int, table: dict, error_ptr: int) -> dict:
    """The TokenParams fields of the layer's token-side kernels (cuda/token.cuh) for launch ranks
    from `rank_base`: `table` maps buffer names to their peer tables' addresses (buffers of a
    shared expert absent without one: has_base 0). The weighted sum also checks recv_row (with
    topk_idx and El: which slots got no result because their expert owner overflowed) and
    reports into the error record at `error_ptr`."""
    return dict(num_tokens=shape.num_tokens, top_k=shape.top_k, hidden=shape.hidden, rank_base=rank_base,
                has_base=int(shape.num_shared == 1), num_local_experts=num_local, topk_idx=table["topk_idx"],
                topk_w=table["topk_w"], recv_row=table["recv_row"], base=table.get("base", 0),
                y_slots=table["y_slots"], out=table["out"], dout=table["dout"], dy_slots=table["dy_slots"],
                dx_slots=table["dx_slots"], dx_base=table.get("dx_base", 0), dx=table["dx"],
                d_topk_w=table["d_topk_w"], error=error_ptr)


def symmetric_bytes(run: RunConfig, capacity: int, macrobatch_rows: int | None = None) -> int:
    """Bytes of symmetric memory one rank's GpuMoELayer allocates (every buffer of layout.layer_layout,
    its ring of `macrobatch_rows` rows, by default every row: the capacity in whole segments; before
    the allocator's alignment): what NVSHMEM_SYMMETRIC_SIZE must hold."""
    ring = whole_ring(capacity) if macrobatch_rows is None else macrobatch_rows
    return sum(nbytes(shp, dt) for shp, dt in layer_layout(run, capacity, ring).values())


def receive_capacity(topk_idx_all, num_experts: int) -> int:
    """Receive rows the layer needs for this routing ([R, N, K], every rank's): the largest rank's
    sum over its experts of their rows padded to the schedule's align (SEGMENT_ROWS), as the device
    schedule places them. Pass it as `capacity` when the routing is known up front: with many
    local experts the padding is most of it (El x up to SEGMENT_ROWS - 1 rows)."""
    from mok_proto.schedule import build_all_schedules

    return max(1, max(s.num_slots for s in build_all_schedules(topk_idx_all, num_experts, align=SEGMENT_ROWS)))


def default_ring_rows(heap, run: RunConfig, capacity: int | None) -> int | None:
    """The ring a layer gets by default: on virtual ranks (every rank's buffers on this GPU) the
    largest that fits 0.9 of the GPU's free memory split over the ranks (memory.default_macrobatch_rows:
    every row when the worst case fits); under NVSHMEM, whose symmetric heap is sized up front
    (symmetric_bytes), a ring that holds every row (None)."""
    if getattr(heap, "backend", None) != "virtual":
        return None
    import cupy

    free = cupy.cuda.runtime.memGetInfo()[0] + cupy.get_default_memory_pool().free_bytes()
    return default_macrobatch_rows(run.shape, run.num_ranks, free_bytes=free // heap.num_ranks, capacity=capacity,
                                   **kinds_of(run))


def _directions(plan, policy: dict) -> tuple[bool, bool]:
    """(incoming, outgoing) transfer of a fused plan's pass runs inside its kernel; ValueError if
    the layer's policy for that pass's two operators is no longer the plan's."""
    from mok_proto.plan import PASS_KINDS, inside_kernel

    ops = (PASS_KINDS[plan.pass_].in_op, PASS_KINDS[plan.pass_].out_op)
    if any(policy[op] != plan.policy[op] for op in ops):
        setter = "set_forward_plan" if plan.pass_ == "fwd" else "set_backward_plan"
        raise ValueError(f"the {plan.pass_} plan was built for {ops} = {[plan.policy[op] for op in ops]}, the layer's "
                         f"policy is now {[policy[op] for op in ops]}: set a plan for this policy ({setter})")
    return inside_kernel(plan.pass_, policy)


class GpuMoELayer(GpuRound):
    """The layer for the launch ranks of one GPU heap (virtual: W ranks in this process; NVSHMEM:
    this process's rank). Set weights and inputs per rank, enqueue, read results per rank.
    RunConfig.precision "fp8": the routed experts in FP8 (layer/gpu_fp8.py), sequential and fused."""

    RUNS_FP8 = True

    def __init__(self, heap, run: RunConfig, capacity: int | None = None, ranks=None, name: str = "layer",
                 blocks_per_rank: int | None = None, macrobatch_rows: int | None = None):
        shape = run.shape if isinstance(run, RunConfig) else None
        if shape is not None:
            check_tiles(shape)
            if run.precision == "fp8":
                gpu_fp8.check_run(run)
        self.has_shared = shape is not None and shape.num_shared == 1
        if macrobatch_rows is None and shape is not None:
            macrobatch_rows = default_ring_rows(heap, run, capacity)
        # Expert segments padded to SEGMENT_ROWS: every row tile is one expert's, and both schedules
        # keep the same receive layout (bitwise-equal caches).
        super().__init__(heap, run, capacity, SEGMENT_ROWS, name, macrobatch_rows)
        import cupy

        self.fp8 = gpu_fp8.Fp8Experts(self) if run.precision == "fp8" else None  # None: bf16 routed experts
        self._whole = (cupy.zeros(1, I32), cupy.full(1, self.shape.num_tokens, I32))  # shared expert: one group
        self._blocks_per_rank = blocks_per_rank
        self.fused = None  # kernels.fused.FusedPass of the plan set by set_forward_plan (None: sequential)
        self.fused_bwd = None  # ... of set_backward_plan
        self.trace = False  # record the fused passes' timelines (see forward_timeline)
        self._captured = {}  # id -> the FusedPass objects captured graphs launch (kept alive: see capture)
        self._cache_valid = True
        self.launch_only(contiguous_ranks(heap, ranks))

    def memory(self):
        """This layer's memory per rank (mok_proto.memory.LayerMemory: bytes by buffer, symmetric and
        private, totals, formula()): its logical capacity and its ring."""
        return layer_memory(self.shape, self.run.num_ranks, capacity=self.capacity, macrobatch_rows=self.ring_rows,
                            **kinds_of(self.run))

    def row_layout(self, rows):
        """The layer's own buffers: rows, saved activations, weights and gradients (`rows` receive
        rows: its ring holds all of them)."""
        return layer_row_layout(self.shape, self.num_local, rows, **kinds_of(self.run))

    def launch_only(self, ranks):
        """Drive only `ranks` (a contiguous subset of the heap's launch ranks) from now on: the
        others' buffers stay as they are (benchmarks time one rank against staged peers; tests
        leave a peer out)."""
        self.ranks = contiguous_ranks(self.heap, ranks)
        h = self.shape.hidden
        table = self.tables()
        # The forward moves token rows x -> receive rows, results y -> slots; the backward moves
        # slot rows dy_slots -> receive rows, input-gradient rows dx_rows -> slots. One CommParams
        # per turn of the ring (a pass of one turn: one).
        # (fp8 dispatch has no bf16 receive rows: gpu_fp8 moves codes and scales with its own params)
        fwd = {"slot_rows": 0, "x": table["x"], "recv": table.get("recv", 0), "y": table["y"],
               "slots": table["y_slots"]}
        bwd = {"slot_rows": 1, "x": table["dy_slots"], "recv": table["recv_dy"], "y": table["dx_rows"],
               "slots": table["dx_slots"]}
        turns = [{**self.comm_fields(self.ranks, 2 * h, t), "base": 0, "out": 0, "scale": 0}
                 for t in range(self.num_turns)]
        self.turn_params = {"fwd": [kc.pack_params({**c, **fwd}) for c in turns],
                            "bwd": [kc.pack_params({**c, **bwd}) for c in turns]}
        self.params_fwd, self.params_bwd = self.turn_params["fwd"][0], self.turn_params["bwd"][0]
        ranks = self.ranks
        self.params_tok = kt.pack_params(token_fields(self.shape, self.num_local, ranks[0], table, self.error.ptr))
        self.launch = self.launch_for(ranks, 2 * h, self._blocks_per_rank)
        if self.fp8 is not None:
            self.fp8.launch_only(ranks, self._blocks_per_rank)
        if getattr(self, "fused", None) is not None:  # its grid and GEMMs are per launch rank
            self.set_forward_plan(self.fused.plan)
        if getattr(self, "fused_bwd", None) is not None:
            self.set_backward_plan(self.fused_bwd.plan)

    # -----------------------------------------------------------------------------------------
    # Host-side setup (outside any captured graph)
    # -----------------------------------------------------------------------------------------
    def set_forward_plan(self, forward_plan=None):
        """Run the forward as one fused launch of `forward_plan` (plan.fused_forward, for this
        layer's shape, R and policy), or stage by stage (None: the sequential schedule). Build the
        plan with `self.fused_forward_plan(...)` for this layer's capacity and grid."""
        self.fused, self._fused_words = self._fused_pass(forward_plan, "fwd")

    def set_backward_plan(self, backward_plan=None):
        """The backward as one fused launch of `backward_plan` (build it: fused_backward_plan), or None."""
        self.fused_bwd, self._fused_bwd_words = self._fused_pass(backward_plan, "bwd")

    def _fused_pass(self, plan, pass_):
        """(kernels.fused.FusedPass, per turn of the ring the GEMM params of every launch rank) for a
        plan of `pass_`, or (None, None). The GEMMs' pipeline waits get fused.gemm_timeout_ns (longer
        than the kernel's counter and peer waits, which name what was missing)."""
        from mok_proto.kernels.fused import FusedPass, gemm_timeout_ns, with_gemm_timeout

        if plan is None:
            return None, None
        if self.fp8 is not None:
            gpu_fp8.check_fused(plan, self.run)
        if self.num_turns > 1 and pass_ == "bwd" and (plan.scale or plan.token_grads):
            raise ValueError(f"this layer's ring takes {self.num_turns} turns: the fused backward runs once a turn, so "
                             "its scale and token gradients must run outside it (FusedKnobs(scale=False, "
                             "token_grads=False); fused_backward_plan() does so by default)")
        if plan.pass_ != pass_:
            raise ValueError(f"a {pass_} plan is needed, got a {plan.pass_} plan ({plan.strategy})")
        if plan.shape != self.shape or plan.num_ranks != self.run.num_ranks:
            raise ValueError(f"plan is for {plan.shape.name} R={plan.num_ranks}, this layer runs "
                             f"{self.shape.name} R={self.run.num_ranks}")
        if plan.capacity_rows < self._plan_rows():
            raise ValueError(f"plan covers {plan.capacity_rows} receive rows, the layer's pass runs {self._plan_rows()} "
                             "at a time")
        fp8 = self.fp8 is not None
        inside = fp8 and gpu_fp8.wgrads_inside(self.run)
        fused = FusedPass(plan, len(self.ranks), link=self.run.link is not None, fp8=fp8, wgrads_inside=inside)
        timeout = gemm_timeout_ns(int(self.run.timeout_s * 1e9))
        if fp8:  # per turn; the FP8 tiles' pipeline waits as long as the BF16 tiles'
            fused.fp8_words = [(with_gemm_timeout(gemms, timeout, abi.FP8_GEMM_PARAMS), quants)
                               for gemms, quants in (self.fp8.fused_words(self.ranks, t, pass_)
                                                     for t in range(self.num_turns))]
        if self.num_turns > 1 and self.has_shared:  # turns after the first: the same plan without the shared expert
            fused.rest = FusedPass(without_shared(plan), len(self.ranks), link=self.run.link is not None, fp8=fp8,
                                   wgrads_inside=inside)
            if fp8:
                fused.rest.fp8_words = fused.fp8_words
        slots = [name for name, _ in abi.GEMM_SLOT.members]
        per_turn = []  # the buffers never move: packed (and their tensor maps made) once
        for t in range(self.num_turns):
            words = []
            for r in self.ranks:
                for slot in slots:
                    if fp8 and not slot.startswith("kSlotShared"):  # routed: FP8 tiles (fp8_words), BF16 wgrads or none
                        words.append(self.fp8.bf16_words(pass_, slot, r, t, inside))
                        continue
                    call = self._gemm(pass_, slot, r, t)
                    extra = {"accumulate": True} if t > 0 and slot in gpu_ring.ROUTED_WGRAD else {}
                    words.append(np.zeros(abi.GEMM_PARAMS.nbytes // 8, np.uint64) if call is None
                                 else call[0](*call[1], error=self.error, pack_only=True, **extra))
            per_turn.append(with_gemm_timeout(np.concatenate(words), timeout))
        return fused, per_turn

    def _plan_rows(self) -> int:
        """Receive rows a fused plan must cover: all of them, or with a ring of several turns one turn's."""
        return self.ring_rows if self.num_turns > 1 else self.capacity

    def fused_forward_plan(self, knobs: FusedKnobs | None = None, num_sms: int | None = None):
        """A fused_forward plan for this layer (its shape, R, policy, capacity) and this GPU (num_sms:
        CTAs per launch rank, by default as many as are resident with every launch rank's), with
        `knobs` (plan.FusedKnobs; None: the defaults)."""
        from mok_proto.kernels.fused import default_num_sms

        return fused_plan("fwd", self.run, self._plan_rows(), self.policy, knobs or FusedKnobs(),
                          num_sms or default_num_sms(len(self.ranks), "fwd_fp8" if self.fp8 is not None else "fwd"))

    def fused_backward_plan(self, knobs: FusedKnobs | None = None, num_sms: int | None = None):
        """A fused_backward plan for this layer and this GPU, as fused_forward_plan."""
        from mok_proto.kernels.fused import default_num_sms

        knobs = knobs or FusedKnobs()
        if self.fp8 is not None and not gpu_fp8.wgrads_inside(self.run):  # weight gradients after the kernel
            # (check_fused); inside, nothing would hide the token gradients (the slot sums ran alone after the last tile)
            knobs = dataclasses.replace(knobs, **{name: False for name in ("routed_wgrads", "token_grads")
                                                  if getattr(knobs, name) is None})
        if self.num_turns > 1:  # once a turn: the token-side work runs outside the kernel
            knobs = dataclasses.replace(knobs, scale=False if knobs.scale is None else knobs.scale,
                                        token_grads=False if knobs.token_grads is None else knobs.token_grads)
        return fused_plan("bwd", self.run, self._plan_rows(), self.policy, knobs,
                          num_sms or default_num_sms(len(self.ranks), "bwd_fp8" if self.fp8 is not None else "bwd"))

    def _gemm(self, pass_: str, slot: str, r: int, turn: int = 0):
        """(wrapper, args) of one GEMM of rank r: the GemmSlot `slot` of pass `pass_` (None: there
        is none, e.g. a shared slot without a shared expert), on the ring's rows of turn `turn`.
        The sequential passes launch them, the fused passes pack them: one list of operands for both."""
        b, (offsets, counts), whole = self._b, self._rows(r, turn), self._whole
        shared = slot.startswith("kSlotShared")
        if shared and not self.has_shared:
            return None
        def rows_fwd():
            return {
                "kSlotSharedFirst": lambda: (gemm.gate_up, (b("x", r), b("shared_gate", r), b("shared_up", r), *whole,
                                                            b("sh", r), b("sg", r), b("su", r))),
                "kSlotSharedSecond": lambda: (gemm.down, (b("sh", r), b("shared_down", r), *whole, b("base", r))),
                "kSlotFirst": lambda: (gemm.gate_up, (b("recv", r), b("w_gate", r), b("w_up", r), offsets, counts,
                                                      b("h", r), b("g", r), b("u", r))),
                "kSlotSecond": lambda: (gemm.down, (b("h", r), b("w_down", r), offsets, counts, b("y", r))),
            }

        def rows_bwd():
            return {
                "kSlotSharedFirst": lambda: (gemm.down_bwd, (b("dout", r), b("shared_down", r), b("sg", r),
                                                             b("su", r), *whole, b("sdg", r), b("sdu", r))),
                "kSlotSharedSecond": lambda: (gemm.gate_up_bwd, (b("sdg", r), b("sdu", r), b("shared_gate", r),
                                                                 b("shared_up", r), *whole, b("dx_base", r))),
                "kSlotFirst": lambda: (gemm.down_bwd, (b("recv_dy", r), b("w_down", r), b("g", r), b("u", r),
                                                       offsets, counts, b("dg", r), b("du", r))),
                "kSlotSecond": lambda: (gemm.gate_up_bwd, (b("dg", r), b("du", r), b("w_gate", r), b("w_up", r),
                                                           offsets, counts, b("dx_rows", r))),
                "kSlotSharedDownWgrad": lambda: (gemm.down_wgrad, (b("sh", r), b("dout", r), *whole,
                                                                   b("dshared_down", r))),
                "kSlotSharedGateUpWgrad": lambda: (gemm.gate_up_wgrad, (b("x", r), b("sdg", r), b("sdu", r), *whole,
                                                                        b("dshared_gate", r), b("dshared_up", r))),
                "kSlotDownWgrad": lambda: (gemm.down_wgrad, (b("h", r), b("recv_dy", r), offsets, counts,
                                                             b("dw_down", r))),
                "kSlotGateUpWgrad": lambda: (gemm.gate_up_wgrad, (b("recv", r), b("dg", r), b("du", r), offsets,
                                                                  counts, b("dw_gate", r), b("dw_up", r))),
            }

        # built lazily (only the slot asked for): a layer without a shared expert has no shared buffers
        calls = {"fwd": rows_fwd, "bwd": rows_bwd}[pass_]()
        make = calls.get(slot)
        return None if make is None else make()

    def _launch_gemms(self, pass_: str, slots, turn: int = 0, accumulate: bool = False):
        """Launch GEMM slots of a pass, rank by rank (the sequential schedule; absent slots skipped),
        on turn `turn`'s rows; accumulate: weight gradients add to what earlier turns stored."""
        for r in self.ranks:
            for slot in slots:
                if self.fp8 is not None and not slot.startswith("kSlotShared"):  # FP8 routed experts
                    self.fp8.launch(pass_, slot, r, turn, accumulate and slot in gpu_ring.ROUTED_WGRAD)
                    continue
                call = self._gemm(pass_, slot, r, turn)
                if call is not None:
                    extra = {"accumulate": True} if accumulate and slot in gpu_ring.ROUTED_WGRAD else {}
                    call[0](*call[1], error=self.error, **extra)

    def set_weights(self, rank: int, weights: dict):
        """This rank's El routed experts (w_gate/w_up [El,H,I], w_down [El,I,H]) and, with a shared
        expert, shared_gate/shared_up [H,Is], shared_down [Is,H]: float arrays, rounded to bf16."""
        s = self.shape
        want = {"w_gate": (self.num_local, s.hidden, s.ffn), "w_up": (self.num_local, s.hidden, s.ffn),
                "w_down": (self.num_local, s.ffn, s.hidden)}
        if self.has_shared:
            want.update(shared_gate=(s.hidden, s.shared_ffn_size), shared_up=(s.hidden, s.shared_ffn_size),
                        shared_down=(s.shared_ffn_size, s.hidden))
        for key, shp in want.items():
            if key not in weights:
                raise ValueError(f"weights: missing {key!r}")
            if tuple(weights[key].shape) != shp:
                raise ValueError(f"weights[{key!r}] must have shape {shp}, got {tuple(weights[key].shape)}")
            self.set_weight_part(rank, key, weights[key])

    def set_weight_part(self, rank: int, key: str, values, first_expert: int = 0):
        """One weight of `rank` (a key of set_weights, same shape), or only routed experts
        first_expert .. first_expert + len(values) - 1 of w_gate/w_up/w_down: float arrays, rounded
        to bf16. A large layer can be filled in chunks of experts, without a float copy of it all."""
        import cupy

        if key not in ("w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down") or key not in self.bufs:
            raise ValueError(f"set_weight_part: {key!r} is not a weight of this layer")
        buf = self.bufs[key].instance(rank)
        if key.startswith("w_"):
            num = len(values)
            if values.ndim != 3 or tuple(values.shape[1:]) != buf.shape[1:] or not 0 <= first_expert <= len(buf) - num:
                raise ValueError(f"set_weight_part: {key} takes [n, {buf.shape[1]}, {buf.shape[2]}] for experts "
                                 f"first_expert .. first_expert + n - 1 of {len(buf)}, got {tuple(values.shape)} "
                                 f"at first_expert={first_expert}")
            part = buf[first_expert:first_expert + num]
        else:
            if tuple(values.shape) != buf.shape[1:]:
                raise ValueError(f"set_weight_part: {key} must have shape {buf.shape[1:]}, got {tuple(values.shape)}")
            part = buf[0]
        part[...] = bf16(cupy.asarray(values, dtype=F32))
        if self.fp8 is not None and key.startswith("w_"):  # quantized once, both orientations
            self.fp8.quantize_weights(rank, key, first_expert, num)

    def set_inputs(self, rank: int, x, topk_idx, topk_weights):
        """One rank's x [N,H] (rounded to bf16), topk_idx [N,K], topk_weights [N,K] (fp32)."""
        import cupy

        from mok_proto.validate import check_layer_inputs

        s = self.shape
        x, topk_idx, topk_weights = check_layer_inputs(x, topk_idx, topk_weights, s.num_experts, s.num_tokens,
                                                       s.hidden, s.top_k)
        b = self.bufs
        b["x"].instance(rank)[...] = bf16(cupy.asarray(x, dtype=F32))
        b["topk_idx"].instance(rank)[...] = cupy.asarray(topk_idx, dtype=I32)
        b["topk_w"].instance(rank)[...] = cupy.asarray(topk_weights, dtype=F32)

    def set_dout(self, rank: int, dout):
        """One rank's output gradient [N,H] (rounded to bf16)."""
        import cupy

        s = self.shape
        if tuple(dout.shape) != (s.num_tokens, s.hidden):
            raise ValueError(f"dout must have shape {(s.num_tokens, s.hidden)}, got {tuple(dout.shape)}")
        self.bufs["dout"].instance(rank)[...] = bf16(cupy.asarray(dout, dtype=F32))

    # -----------------------------------------------------------------------------------------
    # The two passes (enqueued on the current stream, no host readback)
    # -----------------------------------------------------------------------------------------
    def _policy(self):
        for op, direction in self.policy.items():
            if direction not in DIRECTIONS:
                raise ValueError(f"policy: {op} must be push or pull, got {direction!r}")
        if self.failed:
            raise RuntimeError("this layer reported an error before; build a new GpuMoELayer")
        return self.policy

    def _rows(self, rank, turn: int = 0):
        """(offsets, counts) of this rank's El expert segments, as the device schedule wrote them;
        with a ring of several turns, those of turn `turn` in the ring (kernels.comm.turn_segments)."""
        el = self.num_local
        if self.num_turns > 1:
            segments = self.bufs["turn_sched"].instance(rank)[turn * 2 * el:(turn + 1) * 2 * el]
            return segments[:el], segments[el:]
        sched = self.bufs["sched"].instance(rank)
        return sched[:el], sched[el + 1: 2 * el + 1]

    def _b(self, key, rank):
        return self.bufs[key].instance(rank)

    def enqueue_forward(self, mark=None):
        """Enqueue the forward. `mark(stage)` (optional) is called before each stage and once with
        None at the end (benchmarks record CUDA events there)."""
        policy, p, launch = self._policy(), self.params_fwd, self.launch
        self._forward_pending = True
        mark = mark or (lambda stage: None)
        mark("schedule")
        kc.begin_round(p, launch)
        if self.fp8 is not None:
            self.fp8.quantize_tokens()  # fp8 dispatch: the rows it moves (published by the routing flag)
        kc.allgather_routing(p, launch)
        kc.build_schedule(p, launch, self.run.num_ranks, self.num_local, self.shape.num_tokens, self.shape.top_k)
        if self.num_turns > 1:
            gpu_ring.forward_turns(self, policy, mark, self.fused and _directions(self.fused.plan, policy))
            return
        if self.fused is not None:
            self._enqueue_fused_forward(policy, mark)
            return
        self._cache_valid = True
        mark("shared")
        self._launch_gemms("fwd", ("kSlotSharedFirst", "kSlotSharedSecond"))
        mark("dispatch")
        if self.fp8 is not None and self.fp8.dispatch_fp8:
            self.fp8.dispatch(policy["dispatch"], 0, wait_map=True)
        else:
            to_experts(p, launch, policy["dispatch"], "kOpDispatchPush", "kOpDispatchPull", after_schedule=True)
        mark("experts")
        self._launch_gemms("fwd", ("kSlotFirst", "kSlotSecond"))
        mark("combine")
        to_tokens(p, launch, policy["combine"], "kOpCombinePush", "kOpCombinePull")
        mark("weighted_sum")
        kt.weighted_sum(self.params_tok, launch)
        mark(None)

    def _enqueue_fused_forward(self, policy, mark):
        """After the schedule: [dispatch push], the fused kernel, [combine: flag and wait | pull],
        the weighted sum (the plan says which transfers run inside the kernel)."""
        fused, p, launch = self.fused, self.params_fwd, self.launch
        plan = fused.plan
        comm_in, comm_out = _directions(plan, policy)
        if not comm_in:
            mark("dispatch")
        if self.fp8 is not None and self.fp8.dispatch_fp8 and not comm_in:  # the codes and scales pushed now
            self.fp8.dispatch("push", 0, wait_map=True)
        else:
            to_experts_before_fused(p, launch, comm_in, "kOpDispatchPush", "kOpDispatchPull", after_schedule=True)
        fp8 = {} if self.fp8 is None else self.fp8.fused_args(fused, 0, comm_in)
        mark("fused")
        fused.launch(p, self._fused_words[0], self.error, int(self.run.timeout_s * 1e9), trace=self.trace, **fp8)
        self._cache_valid = plan.ring_minibatches >= plan.num_minibatches
        mark("combine")
        to_tokens_after_fused(p, launch, comm_out, "kOpCombinePush", "kOpCombinePull")
        mark("weighted_sum")
        kt.weighted_sum(self.params_tok, launch)
        mark(None)

    def _enqueue_fused_backward(self, policy, mark):
        """After the round's start: dy_slots = w * dout and [reverse-combine: publish and wait | push]
        unless the plan runs them inside (plan.scale); the kernel; [reverse-dispatch: flag, wait | pull]
        unless inside (token_grads); the routed weight gradients unless inside (FP8); slot sum, d topk_weights."""
        fused, p, launch = self.fused_bwd, self.params_bwd, self.launch
        comm_in, comm_out = _directions(fused.plan, policy)
        if not fused.plan.scale:
            kt.scale_to_slots(self.params_tok, launch)
            mark("rev_combine")
            to_experts_before_fused(p, launch, comm_in, "kOpRevCombinePush", "kOpRevCombinePull",
                                    after_schedule=False)
        fp8 = {} if self.fp8 is None else self.fp8.fused_args(fused, 0, comm_in, "bwd")
        mark("fused")
        fused.launch(p, self._fused_bwd_words[0], self.error, int(self.run.timeout_s * 1e9), trace=self.trace,
                     token_params=self.params_tok, **fp8)
        if not fused.plan.token_grads:
            mark("rev_dispatch")
            to_tokens_after_fused(p, launch, comm_out, "kOpRevDispatchPush", "kOpRevDispatchPull")
        if not fused.plan.routed_wgrads:  # (FP8 ones, with their operands' transposed quantizations)
            mark("wgrad")
            self._launch_gemms("bwd", gpu_ring.ROUTED_WGRAD)
        if not fused.plan.token_grads:
            mark("token_grads")
            kt.slot_sum(self.params_tok, launch)
            kt.topk_weight_grad(self.params_tok, launch)
        mark(None)

    def forward_timeline(self, rank: int, pass_: str = "fwd"):
        """The last fused forward's (pass_="bwd": backward's) timeline on `rank` (run it with
        `layer.trace = True`): one mok_proto.trace record per task, times in ns from the first
        task's start (host readback)."""
        from mok_proto import trace as tr

        fused = self.fused if pass_ == "fwd" else self.fused_bwd
        if fused is None:
            raise RuntimeError(f"forward_timeline: no fused {pass_} plan set (set_forward_plan / set_backward_plan)")
        got = fused.timeline(self.ranks.index(rank))
        tasks = fused.plan.tasks
        if not (got["task"] == np.arange(len(tasks))).all():
            raise RuntimeError("forward_timeline: no complete trace (set layer.trace = True before the pass)")
        rows = tr.empty(len(tasks))
        rows["rank"], rows["block"] = rank, got["block"]  # a claimed pair's CTA is known only from its record
        rows["claimed"] = tasks["block"] == fused.plan.pool_block
        comm = np.isin(tasks["kind"], [int(k) for k in MOVER_KINDS])
        rows["role"] = np.where(comm, tr.ROLES.index("comm"), tr.ROLES.index("compute"))
        for key in ("kind", "minibatch", "row_tile", "col_tile"):
            rows[key] = tasks[key]
        rows["expert"] = -1
        # a communication task's bar starts when its wait is met (it moves rows from then on);
        # a GEMM task's when its consumers start on it (its loads may start earlier)
        start = np.where(comm, got["ready_ns"], got["start_ns"])
        t0 = start.min()
        rows["start_ns"], rows["end_ns"] = start - t0, got["end_ns"] - t0
        return rows

    def enqueue_backward(self, mark=None, replay_first: bool = False):
        """Enqueue the backward of the last forward (its schedule and saved rows); `mark` as in
        enqueue_forward. replay_first (a ring of several turns): replay turn 0's forward too, so
        that the backward does not rely on the ring holding it (capture(forward=False) sets it)."""
        policy, p, launch = self._policy(), self.params_bwd, self.launch
        if not getattr(self, "_forward_pending", False):
            raise RuntimeError("enqueue_backward needs an enqueue_forward before it (passes alternate: see the NOTE "
                               "in mok_proto/layer/gpu.py)")
        self._forward_pending = False
        if not self._cache_valid:
            raise RuntimeError("enqueue_backward: the last forward ran a fused plan whose ring is smaller than its "
                               "minibatches, so it kept no activations for a backward (use a full ring)")
        mark = mark or (lambda stage: None)
        mark("scale")
        kc.begin_round(p, launch)
        if self.num_turns > 1:
            gpu_ring.backward_turns(self, policy, mark, self.fused_bwd and _directions(self.fused_bwd.plan, policy),
                                    replay_first)
            return
        if self.fused_bwd is not None:
            self._enqueue_fused_backward(policy, mark)
            return
        kt.scale_to_slots(self.params_tok, launch)
        mark("shared")
        self._launch_gemms("bwd", ("kSlotSharedFirst", "kSlotSharedSecond", "kSlotSharedDownWgrad",
                                   "kSlotSharedGateUpWgrad"))
        mark("rev_combine")
        to_experts(p, launch, policy["rev_combine"], "kOpRevCombinePush", "kOpRevCombinePull", after_schedule=False)
        mark("experts")
        self._launch_gemms("bwd", ("kSlotFirst", "kSlotSecond"))
        mark("rev_dispatch")
        to_tokens(p, launch, policy["rev_dispatch"], "kOpRevDispatchPush", "kOpRevDispatchPull")
        mark("wgrad")
        self._launch_gemms("bwd", ("kSlotDownWgrad", "kSlotGateUpWgrad"))
        mark("token_grads")
        kt.slot_sum(self.params_tok, launch)
        kt.topk_weight_grad(self.params_tok, launch)
        mark(None)

    def capture(self, forward: bool = True, backward: bool = True):
        """A CUDA graph of the forward and/or the backward; replay with graph.launch(stream). Run
        one forward/backward first: the first launches compile kernels and upload descriptors.
        The graph replays the fused plans set when it was captured; the layer keeps their device
        tables alive after another plan is set (a replay would otherwise read freed memory).
        A backward without the forward replays every turn of a ring (turn 0 too): its replays
        need not follow a forward."""
        def enqueue():
            if forward:
                self.enqueue_forward()
            if backward:
                self.enqueue_backward(replay_first=not forward and self.num_turns > 1)

        graph = self.capture_graph(enqueue)
        for fused in (self.fused if forward else None, self.fused_bwd if backward else None):
            if fused is not None:
                self._captured[id(fused)] = fused
        return graph

    # -----------------------------------------------------------------------------------------
    # Results
    # -----------------------------------------------------------------------------------------

    def output(self, rank: int):
        """out [N,H] as float32 (from bf16)."""
        return gemm.from_bf16(self._b("out", rank))

    def result_views(self, rank: int) -> dict:
        """`rank`'s results where the layer keeps them, no copy (for checksums of large layers): out
        [N,H] and the gradients under grads()' names, bf16 ones (out, x) as their uint16 bits,
        the shared expert's as [1, ...]. The next pass overwrites them."""
        b = self._b
        views = {"out": b("out", rank), "x": b("dx", rank), "topk_weights": b("d_topk_w", rank),
                 "w_gate": b("dw_gate", rank), "w_up": b("dw_up", rank), "w_down": b("dw_down", rank)}
        if self.has_shared:
            views.update(shared_gate=b("dshared_gate", rank), shared_up=b("dshared_up", rank),
                         shared_down=b("dshared_down", rank))
        return views

    def grads(self, rank: int) -> dict:
        """x [N,H] and topk_weights [N,K] (float32), w_gate/w_up/w_down of this rank's experts and
        the shared expert's gradient (this rank's partial sum), fp32, as CuPy arrays."""
        views = self.result_views(rank)
        del views["out"]
        return {key: gemm.from_bf16(v) if key == "x" else v[0].copy() if key.startswith("shared_") else v.copy()
                for key, v in views.items()}

    def poison(self):
        """NaN (bf16 0x7FC0, fp32 NaN, the e4m3 NaN code 0xFF) into every row buffer and result of
        the ranks this process drives, so a read before its producer wrote cannot pass a bitwise check."""
        inputs = {"topk_w", "x", "dout", "w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down",
                  *FP8_WEIGHTS}
        nan = {np.dtype(BF16): 0x7FC0, np.dtype(F32): np.nan, np.dtype(U8): 0xFF}
        for rank in self.ranks:
            for key, buf in self.bufs.items():
                a = buf.instance(rank)
                if key in ("recv_row", "sched"):  # -1: "no row"; a read before the schedule wrote it moves nothing
                    a[...] = -1
                elif key in inputs or a.dtype not in nan:  # inputs, routing, scratch, flags, state
                    continue
                else:
                    a[...] = nan[a.dtype]
