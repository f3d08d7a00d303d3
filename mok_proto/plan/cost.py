"""The tile cost model of the fused plans' balanced assignment: the GEMM tiles of each task kind
and their estimated work, the receive rows a rank expects, and the capacity a plan is sized for."""

from __future__ import annotations

import functools
import math

from mok_proto.config import MoEShape
from mok_proto.plan.kinds import (BK, BM, BN, DOWN_BWD_AUX_STAGES, PAIR_ROWS, PASS_KINDS, PROBLEM_OF, SEGMENT_ROWS,
                                  TaskKind, cdiv)


def tile_grid(kind: TaskKind, shape: MoEShape) -> tuple[int, int, int]:
    """(output tile rows, output tile columns, reduction length) of one task's GEMM tile, as
    (rows, cols, k). Row-tile kinds have BM rows of the receive buffer (or of the N tokens);
    weight-gradient kinds tile the weight, k = the expert's rows (0 here: known at run time)."""
    h, i, i_s = shape.hidden, shape.ffn, shape.shared_ffn_size
    return {
        TaskKind.SHARED_GATE_UP: (BM, BN, h), TaskKind.GATE_UP: (BM, BN, h),
        TaskKind.SHARED_DOWN: (BM, BN, i_s), TaskKind.DOWN: (BM, BN, i),
        TaskKind.SHARED_DOWN_BWD: (BM, BN, h), TaskKind.DOWN_BWD: (BM, BN, h),
        TaskKind.SHARED_GATE_UP_BWD: (BM, BN, 2 * i_s), TaskKind.GATE_UP_BWD: (BM, BN, 2 * i),
        TaskKind.DOWN_WGRAD: (BM, BN, 0), TaskKind.GATE_UP_WGRAD: (BM, BN, 0),
        TaskKind.SHARED_DOWN_WGRAD: (BM, BN, 0), TaskKind.SHARED_GATE_UP_WGRAD: (BM, BN, 0),
    }[kind]


def num_col_tiles(kind: TaskKind, shape: MoEShape) -> int:
    """Output column tiles per row tile (row-tile kinds) of one task kind."""
    h, i, i_s = shape.hidden, shape.ffn, shape.shared_ffn_size
    return {
        TaskKind.SHARED_GATE_UP: cdiv(2 * i_s, BN), TaskKind.GATE_UP: cdiv(2 * i, BN),
        TaskKind.SHARED_DOWN: cdiv(h, BN), TaskKind.DOWN: cdiv(h, BN),
        TaskKind.SHARED_DOWN_BWD: cdiv(i_s, BN), TaskKind.DOWN_BWD: cdiv(i, BN),
        TaskKind.SHARED_GATE_UP_BWD: cdiv(h, BN), TaskKind.GATE_UP_BWD: cdiv(h, BN),
    }[kind]


def wgrad_grid(kind: TaskKind, shape: MoEShape) -> tuple[int, int]:
    """(row tiles, column tiles) of one expert's weight gradient: dWd [I, H], dWgu [H, 2I]."""
    h = shape.hidden
    ffn = shape.shared_ffn_size if kind in (TaskKind.SHARED_DOWN_WGRAD, TaskKind.SHARED_GATE_UP_WGRAD) else shape.ffn
    if kind in (TaskKind.DOWN_WGRAD, TaskKind.SHARED_DOWN_WGRAD):
        return cdiv(ffn, BM), cdiv(h, BN)
    return cdiv(h, BM), cdiv(2 * ffn, BN)


def expected_rows(shape: MoEShape, num_ranks: int, capacity_rows: int, segment_rows: int | None = None) -> int:
    """Receive rows a rank fills on average (the balanced assignment's estimate of where the
    real rows end; the tiles past them exit at once), at most capacity_rows. The real rows are a
    prefix of the receive buffer: expert segments back to back, each padded to a multiple of
    segment_rows (None: the GPU layer's SEGMENT_ROWS). Under even routing a rank receives N K rows (each rank's N tokens choose K
    experts among every rank's), an expert's count being Binomial(R N, K / E).
    The larger of two estimates of the padded rows:
      N K + half a segment per local expert: right when an expert's rows spread over several
        segments (EP=64);
      El x SEGMENT_ROWS x E[ceil(count / SEGMENT_ROWS)] (normal approximation): right when the
        counts sit within one or two segments, where every expert pads to the same whole segments
        (there, half a segment each would cost the last real tile pairs as free, and the balanced
        backward would pile them on a few clusters)."""
    el, segment_rows = shape.num_experts // num_ranks, segment_rows or SEGMENT_ROWS
    spread = shape.num_tokens * shape.top_k + el * segment_rows // 2
    return min(capacity_rows, max(spread, _binomial_padded_rows(shape, num_ranks, segment_rows)))


@functools.lru_cache(maxsize=1024)  # a pure function of its arguments, asked for every tile of a plan
def _binomial_padded_rows(shape: MoEShape, num_ranks: int, segment_rows: int) -> int:
    """El x SEGMENT_ROWS x E[ceil(X / SEGMENT_ROWS)] for an expert's rows X ~ Binomial(R N, K / E):
    E[ceil(X / S)] = sum over j >= 0 of P(X > j S), each term by the normal approximation (with
    continuity correction); at least one segment per expert."""
    el = shape.num_experts // num_ranks
    n, p = num_ranks * shape.num_tokens, shape.top_k / shape.num_experts
    mean, sd = n * p, math.sqrt(max(n * p * (1.0 - p), 1e-12))
    segments, j = 0.0, 0
    while j * segment_rows <= mean + 12 * sd:
        segments += 0.5 * math.erfc((j * segment_rows + 0.5 - mean) / (sd * math.sqrt(2.0)))
        j += 1
    return int(round(el * segment_rows * max(1.0, segments)))


def past_expected(kind: TaskKind, shape: MoEShape, num_ranks: int, capacity_rows: int, row_pair: int,
                  segment_rows: int | None = None) -> bool:
    """Whether the routed row tile pair `row_pair` lies at or past expected_rows: under even routing
    its rows are probably past the real ones (it exits at once); under skewed routing it is real."""
    routed_rows = kind in (TaskKind.GATE_UP, TaskKind.DOWN, TaskKind.DOWN_BWD, TaskKind.GATE_UP_BWD)
    return routed_rows and row_pair * PAIR_ROWS >= expected_rows(shape, num_ranks, capacity_rows, segment_rows)


def tile_cost(kind: TaskKind, shape: MoEShape, num_ranks: int, capacity_rows: int, row_pair: int | None = None,
              segment_rows: int | None = None) -> int:
    """Estimated time of one GEMM tile of `kind` in a plan of R = num_ranks ranks and
    capacity_rows receive rows (the balanced assignment's cost model), in units of one
    BM x 1 x BK step of MMA work: the tile's pipeline stages x its columns (every tile has BM
    rows). Its stages: the k-blocks of K as the kernels run it (tile_grid: gate/up H, down I,
    down_bwd H, gate_up_bwd 2I), and for down_bwd the DOWN_BWD_AUX_STAGES that bring its g, u
    through the same ring (counted as k-blocks). The real rows are known only on the device (a
    prefix of the receive buffer; the tiles past them exit at once), so the estimate is
    expected_rows: a routed weight-gradient tile reduces over expected_rows / El rows (the shared
    expert's over its N tokens), and a routed row tile costs a full tile unless row_pair says it
    lies past expected_rows. The problems' different
    tile rates (their epilogues) are left out: what matters is the ratio of gate/up to down to
    weight-gradient tiles (a few % off at most).
    row_pair (routed row problems): the tile pair's index in the receive rows; a pair at or past
    expected_rows costs 1 (a tile past the real rows only signals). Without it, a full tile."""
    _, cols, k = tile_grid(kind, shape)
    if row_pair is not None and past_expected(kind, shape, num_ranks, capacity_rows, row_pair, segment_rows):
        return 1
    if kind in PASS_KINDS["bwd"].wgrad:
        k = cdiv(expected_rows(shape, num_ranks, capacity_rows, segment_rows), shape.num_experts // num_ranks)
    elif kind in PASS_KINDS["bwd"].shared_wgrad:
        k = shape.num_tokens
    aux = DOWN_BWD_AUX_STAGES if PROBLEM_OF[kind] == "down_bwd" else 0
    return (cdiv(k, BK) + aux) * cols



def default_capacity(shape: MoEShape, num_ranks: int, minibatch_rows: int = BM, slack: float = 1.25,
                     segment_rows: int | None = None) -> int:
    """Receive rows a plan is sized for: `slack` x the mean N*K rows plus half a segment of
    padding per local expert, and at least a segment per local expert (each expert's rows are
    padded to SEGMENT_ROWS), rounded up to whole minibatches (the true worst case, all R*N*K
    rows, would make the grid huge)."""
    el, segment_rows = shape.num_experts // num_ranks, segment_rows or SEGMENT_ROWS
    rows = max(int(slack * shape.num_tokens * shape.top_k) + el * segment_rows // 2, el * segment_rows)
    return cdiv(rows, minibatch_rows) * minibatch_rows
