"""An overlap strategy as data: SM roles, per-CTA ordered task tables and ready counters.

Shape legend: N tokens/rank, H hidden, I expert FFN, Is shared-expert FFN, E experts, K top-k,
R ranks, El = E/R local experts, BM x BN = 128 x 256 GEMM tile.

A `Plan` is what a persistent kernel executes on every rank (the same plan on all ranks): CTA b
runs the tasks of its table in order (``seq``); a task first waits until each of its (up to two)
counters reaches its target, does its work, then adds one to each of its (up to two) signal
counters. Counters live in device memory; a *remote* counter is one whose value on a rank is
raised by the tasks of every rank (a push's receiver waits for all peers' signals; a pull's
puller waits for the peers' data), so its target counts R signals per signalling task.

The receive buffer holds ``capacity_rows`` rows, expert segments padded to SEGMENT_ROWS rows (the
schedule's ``align``, one row tile), so every row tile belongs to one expert, found on the device
from the schedule's offsets: the plan is independent of routing. Tasks past the real row count (known on
the device only) exit at once. Rows are processed in minibatches of ``minibatch_rows``; the
buffers of x/h/y (forward) or dy/dg,du/dx (backward) are a ring of ``ring_minibatches``
minibatches: minibatch m lives in ring slot m % ring, and its slot is refilled only after the
previous occupant was released. In the backward, weight gradients are computed per *macrobatch*
(one turn of the ring: ring_minibatches minibatches), after its data gradients. A weight-gradient
task carries its ``macrobatch``; each output tile (expert, row tile, col tile) is pinned to one
CTA in every macrobatch, so that CTA stores the tile's fp32 sum in macrobatch 0 and adds the
later macrobatches in table order: the same sums in the same order on every run (deterministic),
ordered by program order on one CTA, not by counters. `check()` proves the pinning and the order.
The shared expert's weight gradients run once, after its data gradients.

The tables are the megakernel's own structs (``TASK_DTYPE``/``COUNTER_DTYPE`` are struct
mok::plan::Task/Counter of cuda/abi.cuh, from the spec in mok_proto/abi.py; so are the kinds).

Strategies are plain functions that return a plan: `sequential` (stage by stage, every SM per
stage, a barrier counter between stages), `fixed_split` (``comm_blocks`` CTAs communicate,
the rest compute; MoK's restructured overlap, for the simulator) and `fused_forward` /
`fused_backward` (what the megakernels of cuda/fused.cuh execute). `Plan.check` proves on the
CPU that a plan is executable: see `check.prove`.

Modules: `kinds` (tile sizes, task and counter kinds, table dtypes), `cost` (the tile cost
model), `core` (`Plan`, the builder), `build` (the strategies), `check` (the CPU proof),
`knobs` (the fused plans' knobs), `layer` (a GPU layer's fused plans).
"""

from mok_proto.plan.build import fixed_split, fused_backward, fused_forward, sequential
from mok_proto.plan.check import KEY_FIELDS
from mok_proto.plan.core import Plan, with_tasks
from mok_proto.plan.cost import default_capacity, expected_rows, num_col_tiles, tile_cost, tile_grid, wgrad_grid
from mok_proto.plan.kinds import (BK, BM, BN, COMM_KINDS, COUNTER_DTYPE, DOWN_BWD_AUX_STAGES, EPILOGUE_ROWS,
                                  FUSED_STRATEGIES, MAX_SIGNALS, MAX_WAITS, MOVER_KINDS, PAIR_ROWS, PASS_KINDS, PASSES,
                                  PROBLEM_OF, ROUTED_KIND_OF, SEGMENT_ROWS, TASK_DTYPE, CounterKind, PassKinds,
                                  PlanError, TaskKind, inside_kernel)
from mok_proto.plan.knobs import ASSIGNMENTS, CLAIMS, RASTERS, TAIL_PAIRS_PER_CLUSTER, FusedKnobs, parse_claim
from mok_proto.plan.layer import fused_plan, without_shared

__all__ = ["ASSIGNMENTS", "BK", "BM", "BN", "CLAIMS", "COMM_KINDS", "COUNTER_DTYPE", "DOWN_BWD_AUX_STAGES",
           "EPILOGUE_ROWS", "FUSED_STRATEGIES", "KEY_FIELDS", "MAX_SIGNALS", "MAX_WAITS", "MOVER_KINDS", "PAIR_ROWS",
           "PASSES", "PASS_KINDS", "PROBLEM_OF", "RASTERS", "ROUTED_KIND_OF", "SEGMENT_ROWS", "TAIL_PAIRS_PER_CLUSTER",
           "TASK_DTYPE", "CounterKind", "default_capacity", "expected_rows", "fixed_split", "fused_backward",
           "fused_forward", "fused_plan", "FusedKnobs", "inside_kernel", "num_col_tiles", "parse_claim", "PassKinds",
           "Plan", "PlanError", "sequential", "TaskKind", "tile_cost", "tile_grid", "wgrad_grid", "with_tasks",
           "without_shared"]
