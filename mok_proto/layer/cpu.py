"""The distributed MoE layer on the CPU: NumPy arithmetic over a symmetric-memory heap.

Legend: N tokens/rank, H hidden, K top-k, R ranks, El local experts, C receive capacity.
One rank's view. Forward round:
  1. x into my symmetric token buffer; my routing into every rank's routing table; round-start
     flags (the routing all-gather doubles as "my x is published").  Shared expert meanwhile.
  2. Pull schedule from the all-gathered routing (pure function: every rank agrees).
  3. dispatch (to_experts), local experts on the receive rows, combine (to_tokens).
  4. Token owner: out = shared + sum_j w[t,j] * y_slots[t*K+j] (fixed order).
Backward mirrors it: dy_slots = w * dout published + round-start flags, reverse-combine
(to_experts), expert backward, reverse-dispatch (to_tokens), dx = shared dx + sum_j dx_slots.
The direction of each operator comes from RunConfig.policy; it changes data movement only,
never arithmetic, so results are bitwise equal across policies.
"""

from __future__ import annotations

import numpy as np

from mok_proto import reference, validate
from mok_proto.config import RunConfig
from mok_proto.layer import transfer
from mok_proto.schedule import build_pull_schedule, max_receive_slots
from mok_proto.symm.base import CapacityError, SymmetricHeap


class CpuMoELayer:
    """One rank of the layer. `weights`: this rank's El experts (w_gate/w_up [El,H,I], w_down
    [El,I,H]) plus the replicated shared expert (optional)."""

    def __init__(self, heap: SymmetricHeap, run: RunConfig, weights: dict, capacity: int | None = None):
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
        worst = max_receive_slots(n, k, run.num_ranks, num_local)
        self.capacity = worst if capacity is None else capacity
        if not 0 < self.capacity <= worst:
            raise ValueError(f"capacity must be in [1, {worst}] rows, got {self.capacity}")
        # Symmetric buffers, named by role (forward use / backward use).
        self.routing = heap.alloc("routing", (run.num_ranks, n, k), np.int32)  # [R, N, K]
        self.tokens = heap.alloc("tokens", (n, h), self.dtype)  # x
        self.token_slots_out = heap.alloc("token_slots_out", (n * k, h), self.dtype)  # dy slots
        self.token_slots_in = heap.alloc("token_slots_in", (n * k, h), self.dtype)  # y slots / dx slots
        self.expert_in = heap.alloc("expert_in", (self.capacity, h), self.dtype)  # x rows / dy rows
        self.expert_out = heap.alloc("expert_out", (self.capacity, h), self.dtype)  # y rows / dx rows
        self.signals = heap.signals("flags", transfer.NUM_FLAG_KINDS)
        self.epoch = 0  # grows by one per round (forward or backward); flags are never reset
        self.policy = dict(run.policy)  # may be changed between rounds (same on every rank)

    # -----------------------------------------------------------------------------------------
    def forward(self, x, topk_idx, topk_weights):
        """x [N,H], topk_idx/topk_weights [N,K] -> out [N,H]; keeps what backward needs."""
        run, shape, rank = self.run, self.run.shape, self.rank
        # Checked before any cast (an id of 2**32 must not wrap into range).
        x, topk_idx, topk_weights = validate.check_layer_inputs(
            x, topk_idx, topk_weights, shape.num_experts, shape.num_tokens, shape.hidden, shape.top_k)
        x = np.ascontiguousarray(x, self.dtype)
        topk_idx = np.ascontiguousarray(topk_idx, np.int32)
        topk_weights = np.ascontiguousarray(topk_weights, self.dtype)
        self.epoch += 1
        epoch, timeout = self.epoch, run.timeout_s

        # 1. Publish x, all-gather routing; the shared expert overlaps the wait.
        self.tokens.local[...] = x
        self.tokens.publish()
        for peer in range(run.num_ranks):
            self.routing.put_rows(peer, [rank], topk_idx[None])
        shared = transfer.round_start(self.signals, rank, run.num_ranks, epoch, timeout, "routing all-gather",
                                      before_wait=lambda: self._shared_forward(x))
        topk_idx_all = self.routing.local.copy()  # [R, N, K]

        # 2. Schedule; capacity is checked on every rank's need, so all ranks fail together.
        self._check_capacity(topk_idx_all)
        sched = build_pull_schedule(topk_idx_all, shape.num_experts, rank)

        # 3. dispatch -> experts -> combine
        transfer.to_experts(self.policy["dispatch"], sched, self.tokens, self.expert_in, self.signals,
                            epoch, timeout, "dispatch", token_rows=True)
        saved = []
        for lo, hi in self._expert_rows(sched):
            y, s = reference.expert_forward(self.expert_in.local[lo:hi], *self._expert(len(saved)))
            self.expert_out.local[lo:hi] = y
            saved.append(tuple(a.copy() for a in s))
        transfer.to_tokens(self.policy["combine"], sched, self.expert_out, self.token_slots_in, self.signals,
                           epoch, timeout, "combine")

        # 4. Weighted sum on the token owner, fixed order.
        base, shared_saved = shared
        y_slots = self.token_slots_in.local.copy()
        out = reference.weighted_sum(base, y_slots, topk_weights)
        self._cache = dict(sched=sched, saved=saved, shared_saved=shared_saved, y_slots=y_slots,
                           topk_weights=topk_weights)
        return out

    def backward(self, dout):
        """dout [N,H] -> grads: x [N,H], topk_weights [N,K], w_gate/w_up/w_down of my El experts,
        and shared_* as this rank's partial sum (data-parallel all-reduce happens outside)."""
        if getattr(self, "_cache", None) is None:
            raise RuntimeError("backward() needs a forward() first")
        run, shape, rank, cache = self.run, self.run.shape, self.rank, self._cache
        dout = np.ascontiguousarray(
            validate.check_array(dout, "dout", (shape.num_tokens, shape.hidden), "NH", kind="f"), self.dtype)
        sched = cache["sched"]
        self.epoch += 1
        epoch, timeout = self.epoch, run.timeout_s

        # 1. Publish dy slots (w * dout); round-start flags; shared backward overlaps the wait.
        self.token_slots_out.local[...] = reference.scale_to_slots(dout, cache["topk_weights"])
        self.token_slots_out.publish()
        shared = transfer.round_start(self.signals, rank, run.num_ranks, epoch, timeout, "backward start",
                                      before_wait=lambda: self._shared_backward(dout, cache["shared_saved"]))

        # 2. reverse-combine -> expert backward -> reverse-dispatch
        transfer.to_experts(self.policy["rev_combine"], sched, self.token_slots_out, self.expert_in, self.signals,
                            epoch, timeout, "rev_combine", token_rows=False)
        grads = {key: np.zeros_like(self.weights[key]) for key in ("w_gate", "w_up", "w_down")}
        for local, (lo, hi) in enumerate(self._expert_rows(sched)):
            dx, grads["w_gate"][local], grads["w_up"][local], grads["w_down"][local] = reference.expert_backward(
                self.expert_in.local[lo:hi], cache["saved"][local], *self._expert(local))
            self.expert_out.local[lo:hi] = dx
        transfer.to_tokens(self.policy["rev_dispatch"], sched, self.expert_out, self.token_slots_in, self.signals,
                           epoch, timeout, "rev_dispatch")

        # 3. Token owner: dx and d(topk_weights), fixed order.
        base, shared_grads = shared
        grads.update(shared_grads)
        grads["x"] = reference.slot_sum(base, self.token_slots_in.local, shape.top_k)
        grads["topk_weights"] = reference.topk_weight_grad(dout, cache["y_slots"], shape.top_k)
        self._cache = None
        return grads

    # -----------------------------------------------------------------------------------------
    def _expert(self, local):
        return self.weights["w_gate"][local], self.weights["w_up"][local], self.weights["w_down"][local]

    @staticmethod
    def _expert_rows(sched):
        for lo, n in zip(sched.expert_offsets[:-1], sched.tokens_per_expert):
            yield int(lo), int(lo + n)

    def _shared_forward(self, x):
        if not self.has_shared:
            return np.zeros_like(x), None
        w = self.weights
        return reference.expert_forward(x, w["shared_gate"], w["shared_up"], w["shared_down"])

    def _shared_backward(self, dout, saved):
        if saved is None:
            return np.zeros_like(dout), {}
        w = self.weights
        dx, dg, du, dd = reference.expert_backward(dout, saved, w["shared_gate"], w["shared_up"], w["shared_down"])
        return dx, {"shared_gate": dg, "shared_up": du, "shared_down": dd}

    def _check_capacity(self, topk_idx_all):
        num_local = self.run.num_local_experts
        need = np.bincount(topk_idx_all.reshape(-1) // num_local, minlength=self.run.num_ranks)  # [R]
        worst = int(need.argmax())
        if need[worst] > self.capacity:
            raise CapacityError(f"receive buffer overflow: rank {worst} needs {int(need[worst])} rows, "
                                f"capacity is {self.capacity}; raise capacity or rebalance routing")

    def close(self):
        self.heap.close()
