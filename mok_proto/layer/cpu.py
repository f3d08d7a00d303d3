"""The distributed MoE layer on the CPU: NumPy arithmetic over a symmetric-memory heap.

Legend: N tokens/rank, H hidden, I expert FFN, K top-k, R ranks, El local experts, C logical
receive capacity (rows of the schedule's index space), M ring rows (macrobatch_rows).
One rank's view. Forward round:
  1. x into my symmetric token buffer; my routing into every rank's routing table; round-start
     flags (the routing all-gather doubles as "my x is published").  Shared expert meanwhile.
  2. Pull schedule from the all-gathered routing (pure function: every rank agrees).
  3. Per turn m = T-1 .. 0 (T = ceil(C / M)): dispatch receive rows [m M, (m+1) M) into the ring,
     the local experts on them, combine them out (transfer.Turn).
  4. Token owner: out = shared + sum_j w[t,j] * y_slots[t*K+j] (fixed order).
Backward mirrors it, turns m = 0 .. T-1: the ring still holds turn 0's activations; every later
turn first replays its dispatch and gate/up (the same rows and arithmetic, so the same bits), then
reverse-combine, expert backward, reverse-dispatch. Every expert GEMM runs on blocks of `align`
receive rows and the weight gradients add the blocks' products in row order, so every ring size
gives the same bits. The direction of each operator comes from RunConfig.policy; it changes data
movement only, never arithmetic, so results are bitwise equal across policies.
RunConfig.precision "fp8": the experts as mok_proto/reference_fp8.py computes them (bf16 storage,
block-scaled e4m3 GEMMs; `align` a multiple of 128). RunConfig.dispatch_dtype: what the dispatch
moves, bf16 rows (the expert owner quantizes them where they land) or e4m3 codes + fp32 scales (the
token owner quantizes its rows once). The same rule on the same bf16 rows: the same bits.
RunConfig.wgrad_precision "bf16": the routed weight gradients from the bf16 rows (reference_fp8);
then dWg, dWu depend on the dispatch dtype.
"""

from __future__ import annotations

import numpy as np

from mok_proto import fp8, reference, reference_fp8, validate
from mok_proto.config import RunConfig
from mok_proto.layer import transfer
from mok_proto.layer.transfer import Turn
from mok_proto.plan.kinds import SEGMENT_ROWS
from mok_proto.schedule import build_pull_schedule, max_receive_slots
from mok_proto.symm.base import CapacityError, SymmetricHeap


class CpuMoELayer:
    """One rank of the layer. `weights`: this rank's El experts (w_gate/w_up [El,H,I], w_down
    [El,I,H]) plus the replicated shared expert (optional). capacity: the logical receive rows
    (default the worst case: no routing overflows it); macrobatch_rows: the ring's rows (default
    all of them: one turn); align: the rows expert segments are padded to, of which the ring is a
    multiple (default SEGMENT_ROWS, as on the GPU; tests use fewer to get many turns from small shapes)."""

    def __init__(self, heap: SymmetricHeap, run: RunConfig, weights: dict, capacity: int | None = None,
                 macrobatch_rows: int | None = None, align: int | None = None):
        shape = run.shape
        if heap.num_ranks != run.num_ranks:
            raise ValueError(f"num_ranks: config says R={run.num_ranks} but the heap has {heap.num_ranks} ranks")
        self.heap, self.run, self.rank = heap, run, heap.rank
        self.dtype = np.dtype(run.dtype)
        num_local = run.num_local_experts
        self.has_shared = validate.check_weights(weights, hidden=shape.hidden, num_experts=num_local)
        if validate.as_array(weights["w_gate"], "weights['w_gate']").shape[2] != shape.ffn:
            raise validate.InputError(f"weights['w_gate'] must be [El={num_local},H={shape.hidden},I={shape.ffn}], "
                                      f"got shape {weights['w_gate'].shape}")
        self.weights = {key: np.asarray(v, self.dtype) for key, v in weights.items()}
        n, h, k = shape.num_tokens, shape.hidden, shape.top_k
        self.align = validate.check_int(SEGMENT_ROWS if align is None else align, "align", minimum=1)
        self.fp8 = run.precision == "fp8"
        if self.fp8:
            self._quantize_weights()
        worst = max_receive_slots(n, k, run.num_ranks, num_local, self.align)
        self.capacity = worst if capacity is None else capacity
        if not 0 < self.capacity <= worst:
            raise ValueError(f"capacity must be in [1, {worst}] rows, got {self.capacity}")
        whole = -(-self.capacity // self.align) * self.align
        self.macrobatch_rows = whole if macrobatch_rows is None else macrobatch_rows
        validate.check_int(self.macrobatch_rows, "macrobatch_rows", minimum=1)
        if self.macrobatch_rows % self.align or self.macrobatch_rows > whole:
            raise ValueError(f"macrobatch_rows must be a multiple of {self.align} (the segment alignment) and at "
                             f"most {whole} (the capacity, rounded up), got {self.macrobatch_rows}")
        self.num_turns = -(-self.capacity // self.macrobatch_rows)  # T, the same on every rank
        ring = self.macrobatch_rows
        # Symmetric buffers, named by role (forward use / backward use); the expert side's are the ring.
        self.routing = heap.alloc("routing", (run.num_ranks, n, k), np.int32)  # [R, N, K]
        row_shape, row_dtype = self._dispatch_rows()
        self.tokens = heap.alloc("tokens", (n, *row_shape), row_dtype)  # x (fp8 dispatch: its codes + scales)
        self.token_slots_out = heap.alloc("token_slots_out", (n * k, h), self.dtype)  # dy slots
        self.token_slots_in = heap.alloc("token_slots_in", (n * k, h), self.dtype)  # y slots / dx slots
        self.expert_in = heap.alloc("expert_in", (ring, *row_shape), row_dtype)  # x rows
        self.expert_dy = heap.alloc("expert_dy", (ring, h), self.dtype)  # dy rows
        self.expert_out = heap.alloc("expert_out", (ring, h), self.dtype)  # y rows / dx rows
        # The ring's activations only this rank reads: g, u, h of its receive rows.
        self.activations = {key: np.zeros((ring, shape.ffn), self.dtype) for key in ("g", "u", "h")}
        self.signals = heap.signals("flags", transfer.NUM_FLAG_KINDS)
        self.epoch = 0  # the last flag value raised; grows by one per use (rounds, turns, transfers)
        self.replayed_rows = 0  # receive rows the last backward replayed (their forward did not fit the ring)
        self.policy = dict(run.policy)  # may be changed between rounds (same on every rank)

    # -----------------------------------------------------------------------------------------
    def forward(self, x, topk_idx, topk_weights):
        """x [N,H], topk_idx/topk_weights [N,K] -> out [N,H]; keeps what backward needs."""
        run, shape, rank = self.run, self.run.shape, self.rank
        # Checked before any cast (an id of 2**32 must not wrap into range).
        x, topk_idx, topk_weights = validate.check_layer_inputs(
            x, topk_idx, topk_weights, shape.num_experts, shape.num_tokens, shape.hidden, shape.top_k)
        x = self._bf16(np.ascontiguousarray(x, self.dtype))
        topk_idx = np.ascontiguousarray(topk_idx, np.int32)
        topk_weights = np.ascontiguousarray(topk_weights, self.dtype)
        timeout = run.timeout_s

        # 1. Publish x, all-gather routing; the shared expert overlaps the wait.
        self.tokens.local[...] = self._token_rows(x)
        self.tokens.publish()
        for peer in range(run.num_ranks):
            self.routing.put_rows(peer, [rank], topk_idx[None])
        shared = transfer.round_start(self.signals, rank, run.num_ranks, self._stamp(), timeout, "routing all-gather",
                                      before_wait=lambda: self._shared_forward(x))
        topk_idx_all = self.routing.local.copy()  # [R, N, K]

        # 2. Schedule; capacity is checked on every rank's need, so all ranks fail together.
        self._check_capacity(topk_idx_all)
        sched = build_pull_schedule(topk_idx_all, shape.num_experts, rank, align=self.align)

        # 3. Per turn, last first (the ring keeps turn 0 for the backward): dispatch -> experts -> combine
        pulled = None
        for m in reversed(range(self.num_turns)):
            lo, hi, free = self._begin_turn(m, pulled, "dispatch")
            transfer.to_experts(self.policy["dispatch"], sched, self.tokens, self.expert_in, self.signals,
                                Turn(lo, hi, self._stamp(), free), timeout, "dispatch", token_rows=True)
            self._experts_forward(sched, lo, hi, with_y=True)
            pulled = self._to_tokens("combine", sched, Turn(lo, hi, self._stamp(), free))

        # 4. Weighted sum on the token owner, fixed order.
        base, shared_saved = shared
        y_slots = self.token_slots_in.local.copy()
        out = self._bf16(reference.weighted_sum(base, y_slots, topk_weights))
        self._cache = dict(sched=sched, shared_saved=shared_saved, y_slots=y_slots, topk_weights=topk_weights)
        return out

    def backward(self, dout):
        """dout [N,H] -> grads: x [N,H], topk_weights [N,K], w_gate/w_up/w_down of my El experts,
        and shared_* as this rank's partial sum (data-parallel all-reduce happens outside)."""
        if getattr(self, "_cache", None) is None:
            raise RuntimeError("backward() needs a forward() first")
        run, shape, rank, cache = self.run, self.run.shape, self.rank, self._cache
        dout = self._bf16(np.ascontiguousarray(
            validate.check_array(dout, "dout", (shape.num_tokens, shape.hidden), "NH", kind="f"), self.dtype))
        sched = cache["sched"]
        timeout = run.timeout_s

        # 1. Publish dy slots (w * dout); round-start flags; shared backward overlaps the wait.
        self.token_slots_out.local[...] = self._bf16(reference.scale_to_slots(dout, cache["topk_weights"]))
        self.token_slots_out.publish()
        shared = transfer.round_start(self.signals, rank, run.num_ranks, self._stamp(), timeout, "backward start",
                                      before_wait=lambda: self._shared_backward(dout, cache["shared_saved"]))

        # 2. Per turn, first first: [replay: dispatch, gate/up] -> reverse-combine -> expert backward
        #    -> reverse-dispatch; weight gradients added in receive-row order.
        grads = {key: np.zeros_like(self.weights[key]) for key in ("w_gate", "w_up", "w_down")}
        pulled, self.replayed_rows = None, 0
        for m in range(self.num_turns):
            lo, hi, free = self._begin_turn(m, pulled, "rev_combine")
            if m > 0:  # the forward's later turns overwrote this one's activations: replay it
                transfer.to_experts(self.policy["dispatch"], sched, self.tokens, self.expert_in, self.signals,
                                    Turn(lo, hi, self._stamp(), free), timeout, "dispatch replay", token_rows=True)
                self._experts_forward(sched, lo, hi, with_y=False)
                self.replayed_rows += int(np.count_nonzero(sched.src_rank[lo:hi] >= 0))
            transfer.to_experts(self.policy["rev_combine"], sched, self.token_slots_out, self.expert_dy, self.signals,
                                Turn(lo, hi, self._stamp(), free), timeout, "rev_combine", token_rows=False)
            self._experts_backward(sched, lo, hi, grads)
            pulled = self._to_tokens("rev_dispatch", sched, Turn(lo, hi, self._stamp(), free))

        # 3. Token owner: dx and d(topk_weights), fixed order.
        base, shared_grads = shared
        grads.update(shared_grads)
        grads["x"] = self._bf16(reference.slot_sum(base, self.token_slots_in.local, shape.top_k))
        grads["topk_weights"] = reference.topk_weight_grad(dout, cache["y_slots"], shape.top_k)
        self._cache = None
        return grads

    # -----------------------------------------------------------------------------------------
    def _stamp(self) -> int:
        """The next flag value; every rank draws the same sequence (same turns, same transfers)."""
        self.epoch += 1
        return self.epoch

    def _begin_turn(self, m, pulled, op):
        """(lo, hi, free) of turn m: its receive rows and, with more than one turn, the RING_FREE
        value this rank raised once its ring's previous turn was done with (pulled: that turn's
        to_tokens stamp if peers pulled from the ring)."""
        lo = m * self.macrobatch_rows
        if self.num_turns == 1:
            return lo, lo + self.macrobatch_rows, None
        free = self._stamp()
        transfer.free_ring(self.signals, self.rank, self.run.num_ranks, free, pulled, self.run.timeout_s, op)
        return lo, lo + self.macrobatch_rows, free

    def _to_tokens(self, op, sched, turn):
        """The turn's rows out to their token owners; the stamp peers' PULLED flags will carry
        (None when nobody pulls from the ring)."""
        transfer.to_tokens(self.policy[op], sched, self.expert_out, self.token_slots_in, self.signals, turn,
                           self.run.timeout_s, op)
        return turn.stamp if turn.free is not None and self.policy[op] == "pull" else None

    def _blocks(self, sched, lo, hi):
        """(local expert, ring rows) of the real receive rows in [lo, hi), expert by expert, in
        blocks of `align` rows (segments start on a multiple of it, so a block never spans turns)."""
        for local, (start, count) in enumerate(zip(sched.expert_offsets[:-1], sched.tokens_per_expert)):
            a, b = max(int(start), lo), min(int(start + count), hi)
            for first in range(a, b, self.align):
                yield local, slice(first - lo, min(first + self.align, b) - lo)

    def _experts_forward(self, sched, lo, hi, with_y):
        """g, u, h (and y: the forward, not its replay) of the ring's rows of turn [lo, hi)."""
        act = self.activations
        for local, rows in self._blocks(sched, lo, hi):
            if self.fp8:
                y, (g, u, h) = reference_fp8.expert_forward(self._received_fp8(rows), reference_fp8.expert_weights(self.wq, local))
            else:
                g, u, h = reference.expert_hidden(self.expert_in.local[rows], *self._expert(local)[:2])
            act["g"][rows], act["u"][rows], act["h"][rows] = g, u, h
            if with_y:
                self.expert_out.local[rows] = y if self.fp8 else h @ self.weights["w_down"][local]

    def _experts_backward(self, sched, lo, hi, grads):
        """dx rows of turn [lo, hi) into the ring; each block's weight-gradient products added to
        `grads` in row order."""
        act = self.activations
        for local, rows in self._blocks(sched, lo, hi):
            if self.fp8:
                self._expert_backward_fp8(local, rows, grads)
                continue
            saved = (self.expert_in.local[rows], act["g"][rows], act["u"][rows], act["h"][rows])
            dx, dw_gate, dw_up, dw_down = reference.expert_backward(self.expert_dy.local[rows], saved,
                                                                    *self._expert(local))
            self.expert_out.local[rows] = dx
            grads["w_gate"][local] += dw_gate
            grads["w_up"][local] += dw_up
            grads["w_down"][local] += dw_down

    def _expert(self, local):
        return self.weights["w_gate"][local], self.weights["w_up"][local], self.weights["w_down"][local]

    def _shared_forward(self, x):
        if not self.has_shared:
            return np.zeros_like(x), None
        w = self.weights
        if self.fp8:
            return reference_fp8.shared_forward(x, w, self.shared_wq)
        return reference.expert_forward(x, w["shared_gate"], w["shared_up"], w["shared_down"])

    def _shared_backward(self, dout, saved):
        if saved is None:
            return np.zeros_like(dout), {}
        w = self.weights
        if self.fp8:
            return reference_fp8.shared_backward(dout, saved, w, self.shared_wq)
        dx, dg, du, dd = reference.expert_backward(dout, saved, w["shared_gate"], w["shared_up"], w["shared_down"])
        return dx, {"shared_gate": dg, "shared_up": du, "shared_down": dd}

    # -----------------------------------------------------------------------------------------
    # precision fp8 (reference_fp8: what is stored where, and quantized when)
    # -----------------------------------------------------------------------------------------
    def _quantize_weights(self):
        """Checks; the weights rounded to bf16, the routed (and an fp8 shared expert's) quantized once."""
        shape, run = self.run.shape, self.run
        shared_fp8 = self.has_shared and run.shared_precision == "fp8"
        reference_fp8.check_fp8_shape(shape.hidden, shape.ffn, shape.shared_ffn_size if shared_fp8 else None)
        if self.align % fp8.BLOCK:
            raise validate.InputError(f"precision fp8 needs align a multiple of {fp8.BLOCK} (an expert's weight-gradient "
                                      f"scale blocks start at its first row and must not span two turns), got {self.align}")
        self.weights = {key: reference_fp8.round_bf16(v) for key, v in self.weights.items()}
        self.wq = reference_fp8.quantize_weights(self.weights, validate.WEIGHT_KEYS)
        self.shared_wq = reference_fp8.quantize_weights(self.weights, validate.SHARED_KEYS) if shared_fp8 else None

    def _dispatch_rows(self):
        """(row shape, dtype) of the rows dispatch moves: x in the layer's dtype; with precision fp8
        its bf16 bits, or (dispatch_dtype fp8) its e4m3 codes and fp32 scales in one byte row."""
        h = self.run.shape.hidden
        if not self.fp8:
            return (h,), self.dtype
        if self.run.dispatch_dtype == "fp8":
            return (transfer.fp8_row_bytes(h),), np.dtype(np.uint8)
        return (h,), np.dtype(np.uint16)

    def _bf16(self, a):
        """With precision fp8 the GPU layer's bf16 storage (a rounded to bf16), else a itself."""
        return reference_fp8.round_bf16(a) if self.fp8 else a

    def _token_rows(self, x):
        """What this rank publishes for the dispatch: x, its bf16 bits, or its quantized rows."""
        if not self.fp8:
            return x
        if self.run.dispatch_dtype == "fp8":
            return transfer.pack_fp8_rows(*fp8.quantize_rows(x))
        return reference.to_bf16(x)

    def _received_fp8(self, rows):
        """(codes, scales) of the ring's x rows `rows`: as dispatched, or quantized here from bf16."""
        got = self.expert_in.local[rows]
        if self.run.dispatch_dtype == "fp8":
            return transfer.unpack_fp8_rows(got, self.run.shape.hidden)
        return fp8.quantize_rows(reference.from_bf16(got))

    def _expert_backward_fp8(self, local, rows, grads):
        """expert_backward of one block of rows: dx rows into the ring, its weight-gradient k-blocks
        added to `grads` (the blocks of an expert come in row order)."""
        act, dy = self.activations, self.expert_dy.local[rows]
        dx, dg, du = reference_fp8.expert_backward(dy, act["g"][rows], act["u"][rows], reference_fp8.expert_weights(self.wq, local))
        self.expert_out.local[rows] = dx
        local_grads = {key: grads[key][local] for key in validate.WEIGHT_KEYS}
        if self.run.fp8_wgrad:
            reference_fp8.add_weight_grads(local_grads, self._received_fp8(rows), act["h"][rows], dy, dg, du)
            return
        fp8_rows = self.run.dispatch_dtype == "fp8"
        xw = reference_fp8.wgrad_rows(None if fp8_rows else reference.from_bf16(self.expert_in.local[rows]),
                                      self._received_fp8(rows) if fp8_rows else None, self.run.dispatch_dtype)
        reference_fp8.add_weight_grads_bf16(local_grads, xw, act["h"][rows], dy, dg, du)

    def _check_capacity(self, topk_idx_all):
        run, align = self.run, self.align
        counts = np.bincount(topk_idx_all.reshape(-1), minlength=run.shape.num_experts)
        need = (-(-counts // align) * align).reshape(run.num_ranks, run.num_local_experts).sum(axis=1)  # [R]
        worst = int(need.argmax())
        if need[worst] > self.capacity:
            raise CapacityError(f"receive buffer overflow: rank {worst} needs {int(need[worst])} rows, the logical "
                                f"capacity is {self.capacity}; leave capacity at its default (the worst case)")

    def close(self):
        self.heap.close()
