"""Routing specs of the benchmarks and the simulator (`--routing uniform | zipf:ALPHA | hot:FRACTION`)
and the routing they draw for a real layout: R ranks of N tokens, E experts, rank r owning experts
r El .. (r+1) El - 1, one rank timed (the one the emulations run).

* uniform: every token's K distinct experts uniformly at random.
* zipf:ALPHA: expert popularity proportional to 1 / (j + 1)^ALPHA for popularity rank j, the ranks
  a random permutation of the experts except that the hottest expert is always one of the timed
  rank's (the timed rank's best-ranked expert swaps ranks with it); each token's K distinct experts
  drawn without replacement in proportion to popularity (Plackett-Luce, by Gumbel top-K), its first
  choice the most preferred.
* hot:FRACTION: round(FRACTION R N) of the R N tokens (a random set, every rank's tokens alike) make
  their first choice among the timed rank's experts (uniformly), every other token's first choice is
  uniform over the other ranks' experts; every later choice is uniform over the experts the token
  has not chosen yet. Uniform routing is about hot:1/R.

Legend: N tokens/rank, E experts, K top-k, R ranks, El = E/R experts per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FORMS = "uniform, zipf:ALPHA (ALPHA > 0) or hot:FRACTION (0 < FRACTION <= 1)"
_ROWS_PER_CHUNK = 8192  # tokens per chunk of zipf's Gumbel keys ([chunk, E] float64 at a time)


@dataclass(frozen=True)
class RoutingSpec:
    """One routing: kind "uniform", "zipf" (value: ALPHA) or "hot" (value: FRACTION). `str(spec)` is
    the canonical text rows record as `routing`; `RoutingSpec.parse(str(spec)) == spec`."""

    kind: str = "uniform"
    value: float | None = None

    def __post_init__(self):
        ok = {"uniform": self.value is None,
              "zipf": self.value is not None and math.isfinite(self.value) and self.value > 0,
              "hot": self.value is not None and 0 < self.value <= 1}
        if not ok.get(self.kind, False):
            raise ValueError(f"routing must be {FORMS}, got {self.kind}:{self.value}")

    @classmethod
    def parse(cls, text: str) -> RoutingSpec:
        """`uniform`, `zipf:ALPHA` or `hot:FRACTION` -> the spec; anything else: ValueError, one line."""
        kind, sep, value = str(text).strip().partition(":")
        try:
            if kind == "uniform" and not sep:
                return cls()
            if kind in ("zipf", "hot") and sep:
                return cls(kind, float(value))
        except ValueError:
            pass
        raise ValueError(f"routing must be {FORMS}, got {text!r}")

    def __str__(self) -> str:
        if self.value is None:
            return self.kind
        short = format(self.value, "g")
        return f"{self.kind}:{short if float(short) == self.value else repr(self.value)}"

    @property
    def is_uniform(self) -> bool:
        return self.kind == "uniform"


UNIFORM = RoutingSpec()


def uniform_topk(rng: np.random.Generator, num_rows: int, num_experts: int, top_k: int) -> np.ndarray:
    """[num_rows, K] distinct experts per row, uniformly at random (rows with a repeat redrawn whole)."""
    idx = rng.integers(0, num_experts, (num_rows, top_k))
    bad = np.arange(num_rows)  # the rows to check: at first all, then those just redrawn
    while True:
        s = np.sort(idx[bad], axis=1)
        bad = bad[(s[:, 1:] == s[:, :-1]).any(axis=1)]
        if not len(bad):
            return idx
        idx[bad] = rng.integers(0, num_experts, (len(bad), top_k))


def topk(spec: RoutingSpec, num_ranks: int, num_tokens: int, num_experts: int, top_k: int,
         rng: np.random.Generator, timed_rank: int = 0) -> np.ndarray:
    """[R, N, K] int32: every rank's tokens' K distinct experts under `spec` (module doc), drawn from
    `rng` (the same generator state, the same routing)."""
    if num_experts % num_ranks or not 0 <= timed_rank < num_ranks or top_k > num_experts:
        raise ValueError(f"routing: R={num_ranks} ranks must divide E={num_experts} experts, the timed rank "
                         f"{timed_rank} be one of them and K={top_k} <= E")
    rows, el = num_ranks * num_tokens, num_experts // num_ranks
    if spec.kind == "uniform":
        idx = uniform_topk(rng, rows, num_experts, top_k)
    elif spec.kind == "zipf":
        logw = np.log(zipf_popularity(spec.value, num_experts, el, timed_rank, rng))
        idx = np.empty((rows, top_k), np.int64)
        for lo in range(0, rows, _ROWS_PER_CHUNK):  # Gumbel top-K: sampling without replacement
            keys = logw + rng.gumbel(size=(min(_ROWS_PER_CHUNK, rows - lo), num_experts))
            part = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
            order = np.argsort(-np.take_along_axis(keys, part, axis=1), axis=1, kind="stable")
            idx[lo:lo + len(part)] = np.take_along_axis(part, order, axis=1)
    else:
        if num_ranks < 2:
            raise ValueError(f"routing {spec}: a hot rank needs other ranks, got R={num_ranks}")
        idx = np.empty((rows, top_k), np.int64)
        hot = np.zeros(rows, bool)
        hot[rng.permutation(rows)[:round(spec.value * rows)]] = True
        first = rng.integers(0, num_experts - el, rows)  # the other ranks' experts, skipping the timed rank's
        first += np.where(first >= timed_rank * el, el, 0)
        first[hot] = timed_rank * el + rng.integers(0, el, int(hot.sum()))
        idx[:, 0] = first
        _fill_distinct(rng, idx, 1, num_experts)
    return idx.reshape(num_ranks, num_tokens, top_k).astype(np.int32)


def _fill_distinct(rng: np.random.Generator, idx: np.ndarray, first_col: int, num_experts: int) -> None:
    """Columns first_col.. of idx [rows, K]: each uniform over the experts not in the row's earlier
    columns (an entry that repeats one is redrawn)."""
    for c in range(first_col, idx.shape[1]):
        idx[:, c] = rng.integers(0, num_experts, len(idx))
        bad = np.flatnonzero((idx[:, :c] == idx[:, c:c + 1]).any(axis=1))
        while len(bad):
            idx[bad, c] = rng.integers(0, num_experts, len(bad))
            bad = bad[(idx[bad, :c] == idx[bad, c:c + 1]).any(axis=1)]


def zipf_popularity(alpha: float, num_experts: int, num_local: int, timed_rank: int,
                    rng: np.random.Generator) -> np.ndarray:
    """[E] zipf:alpha's popularity of each expert (sums to 1): 1 / (j + 1)^alpha at popularity rank
    j, the ranks a permutation drawn from rng with the hottest (j = 0) moved to the timed rank."""
    rank_of = np.empty(num_experts, np.int64)
    rank_of[rng.permutation(num_experts)] = np.arange(num_experts)
    timed = np.arange(timed_rank * num_local, (timed_rank + 1) * num_local)
    best, hottest = timed[np.argmin(rank_of[timed])], int(np.argmin(rank_of))
    rank_of[[best, hottest]] = rank_of[[hottest, best]]
    weights = (rank_of + 1.0) ** -alpha
    return weights / weights.sum()


def expected_rows(spec: RoutingSpec, shape, num_ranks: int = 64) -> float:
    """Receive rows (unpadded) the timed rank expects under `spec` at a real layout of `num_ranks`
    ranks of `shape` (its E experts, N tokens per rank, K): uniform N K; hot:F exactly R N (F (1 +
    (K-1)(El-1)/(E-1)) + (1-F)(K-1) El/(E-1)); zipf:A R N times the hottest expert's chance to be
    among a token's K plus (El - 1) times the mean of the others' (the timed rank's other experts
    sit at random popularity ranks): `zipf_chances`."""
    n, k, e = shape.num_tokens, shape.top_k, shape.num_experts
    el = e // num_ranks
    if spec.kind == "uniform":
        return float(n * k)
    if spec.kind == "hot":
        f = spec.value
        return num_ranks * n * (f * (1 + (k - 1) * (el - 1) / (e - 1)) + (1 - f) * (k - 1) * el / (e - 1))
    chance = zipf_chances(spec.value, e, k)
    return float(num_ranks * n * (chance[0] + (el - 1) * chance[1:].mean()))


def zipf_chances(alpha: float, num_experts: int, top_k: int) -> np.ndarray:
    """[E] the chance that the expert of popularity rank j is among a token's K under zipf:alpha:
    1 - exp(-p_j t), p the popularity, t such that the chances sum to K (a Poisson approximation
    of drawing without replacement: a few % from a large draw at the hottest ranks)."""
    p = np.arange(1, num_experts + 1, dtype=np.float64) ** -alpha
    p /= p.sum()
    lo, hi = 0.0, 1.0
    while (-np.expm1(-p * hi)).sum() < top_k:
        hi *= 2
    for _ in range(100):  # bisection on t: the sum grows with it
        mid = (lo + hi) / 2
        if (-np.expm1(-p * mid)).sum() < top_k:
            lo = mid
        else:
            hi = mid
    return -np.expm1(-p * hi)
