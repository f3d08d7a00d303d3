"""Deterministic inputs: every rank builds every rank's inputs from one seed.

So each rank can check its own slice against the single-process reference over all ranks.
Legend: R ranks, N tokens/rank, H hidden, I expert FFN, Is shared FFN, E experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mok_proto import reference
from mok_proto.config import MoEShape


@dataclass
class Problem:
    x: np.ndarray  # [R, N, H]
    topk_idx: np.ndarray  # [R, N, K] int32
    topk_weights: np.ndarray  # [R, N, K] float32
    dout: np.ndarray  # [R, N, H]
    weights: dict  # global: w_gate/w_up [E,H,I], w_down [E,I,H], shared_* [H,Is] / [Is,H]

    @property
    def num_ranks(self) -> int:
        return self.x.shape[0]

    def flat(self, name):
        """[R, N, ...] -> [R*N, ...]: all ranks' tokens as one batch for the reference."""
        a = getattr(self, name)
        return a.reshape(-1, *a.shape[2:])

    def reference_results(self, bf16: bool = False) -> dict:
        """The float64 reference over all ranks' tokens: {"out", "x", "topk_weights", "w_*",
        "shared_*"} (token arrays [R*N, ...], weight gradients global). bf16: on the bf16-rounded
        x, weights and dout (what the GPU layer computes with; topk_weights stay float32)."""
        def exact(a):
            if not bf16:
                return np.asarray(a, np.float64)
            return reference.round_bf16(a).astype(np.float64)

        out, cache = reference.forward(exact(self.flat("x")), self.flat("topk_idx"),
                                       self.flat("topk_weights").astype(np.float64),
                                       {key: exact(v) for key, v in self.weights.items()}, dtype="float64")
        grads = reference.backward(exact(self.flat("dout")), cache)
        return {"out": out, **grads}

    def local_weights(self, rank: int) -> dict:
        """The experts rank `rank` owns (E/R consecutive ones) plus the replicated shared expert."""
        num_local = self.weights["w_gate"].shape[0] // self.num_ranks
        lo = rank * num_local
        local = {key: self.weights[key][lo:lo + num_local] for key in ("w_gate", "w_up", "w_down")}
        local.update({key: v for key, v in self.weights.items() if key.startswith("shared_")})
        return local


def make_problem(shape: MoEShape, num_ranks: int, seed: int = 0, routing: str = "random",
                 dtype="float32") -> Problem:
    """Inputs for one layer on R ranks. routing: 'random' (softmax router), 'one-expert'
    (every token's first choice is expert 0), or 'skewed' (router biased to few experts)."""
    rng = np.random.default_rng(seed)
    n, h, i, e, k = shape.num_tokens, shape.hidden, shape.ffn, shape.num_experts, shape.top_k
    dt = np.dtype(dtype)

    def normal(*size, scale=1.0):
        a = rng.standard_normal(size)
        a *= scale
        return a.astype(dt)

    weights = {
        "w_gate": normal(e, h, i, scale=h ** -0.5),
        "w_up": normal(e, h, i, scale=h ** -0.5),
        "w_down": normal(e, i, h, scale=i ** -0.5),
    }
    if shape.num_shared:
        s = shape.shared_ffn_size
        weights.update(shared_gate=normal(h, s, scale=h ** -0.5), shared_up=normal(h, s, scale=h ** -0.5),
                       shared_down=normal(s, h, scale=s ** -0.5))
    x = normal(num_ranks, n, h)
    w_router = normal(h, e, scale=h ** -0.5)
    if routing == "skewed":
        w_router[:, : max(1, e // 8)] += 0.5
    elif routing not in ("random", "one-expert"):
        raise ValueError(f"routing must be random, skewed or one-expert, got {routing!r}")
    idx, wts = reference.route(x.reshape(-1, h), w_router, k)
    if routing == "one-expert":
        # Every token sends its first choice to expert 0; the other choices stay distinct.
        others = np.stack([rng.permutation(np.arange(1, e))[: k - 1] for _ in range(idx.shape[0])]) \
            if k > 1 else np.zeros((idx.shape[0], 0), np.int32)
        idx = np.concatenate([np.zeros((idx.shape[0], 1), np.int32), others.astype(np.int32)], axis=1)
    return Problem(x=x, topk_idx=idx.reshape(num_ranks, n, k), topk_weights=wts.reshape(num_ranks, n, k),
                   dout=normal(num_ranks, n, h), weights=weights)


@dataclass
class RoutedTokens:
    """Inputs of a communication round (no expert weights): what bench_comm and the NCCL baseline
    move, built identically on every rank from one seed."""

    x: np.ndarray  # [R, N, H] float32
    topk_idx: np.ndarray  # [R, N, K] int32, K distinct experts per token
    topk_weights: np.ndarray  # [R, N, K] float32, rows sum to 1
    scale: np.ndarray  # [E] float32: the stand-in expert e computes scale[e] * x

    def remote_rows(self) -> int:
        """(token, choice) rows whose expert lives on another rank: the rows that cross links."""
        num_ranks = self.topk_idx.shape[0]
        owner = self.topk_idx // (self.scale.shape[0] // num_ranks)  # [R, N, K]
        return int((owner != np.arange(num_ranks)[:, None, None]).sum())


def make_routed_tokens(shape: MoEShape, num_ranks: int, seed: int = 0) -> RoutedTokens:
    rng = np.random.default_rng(seed)
    n, k, e = shape.num_tokens, shape.top_k, shape.num_experts
    idx = np.stack([np.argsort(rng.random((n, e), dtype=np.float32), axis=1)[:, :k] for _ in range(num_ranks)])
    w = rng.random((num_ranks, n, k), dtype=np.float32) + np.float32(0.5)
    return RoutedTokens(x=rng.standard_normal((num_ranks, n, shape.hidden), dtype=np.float32),
                        topk_idx=idx.astype(np.int32), topk_weights=(w / w.sum(axis=2, keepdims=True)).astype(np.float32),
                        scale=rng.uniform(0.5, 2.0, e).astype(np.float32))


def rows_per_expert(total: int, num_experts: int, routing: str) -> np.ndarray:
    """[num_experts] rows per expert of the GEMM benchmark: uniform (equal) or skewed (rows
    proportional to 1/(e+1)); the remainder goes to expert 0."""
    if routing == "uniform":
        w = np.ones(num_experts)
    else:
        w = 1.0 / np.arange(1, num_experts + 1)
    counts = np.floor(total * w / w.sum()).astype(np.int64)
    counts[0] += total - counts.sum()
    return counts
