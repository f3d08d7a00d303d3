"""The GPU layer's symmetric buffers as data, callable without a GPU: what a round allocates
(routing, schedule, flags), what the layer adds (rows, activations, weights, gradients), and the
role of each (what its size follows). GpuRound allocates from these; layer.gpu.symmetric_bytes
sizes the heap with them; mok_proto.memory states them.

Legend: N tokens/rank, H hidden, I expert FFN, Is shared FFN, K top-k, R ranks, El = E/R local
experts, C logical receive capacity (rows of the schedule's index space), M ring rows
(macrobatch_rows: the receive-row buffers).
"""

from __future__ import annotations

import numpy as np

from mok_proto import abi
from mok_proto.config import RunConfig
from mok_proto.kernels import comm as kc
from mok_proto.plan.kinds import SEGMENT_ROWS

BF16, F32, I32 = np.uint16, np.float32, np.int32

# What each buffer's size follows (mok_proto.memory groups the bytes by it):
#   index: the logical capacity C (4-byte indices per receive row);  ring: M receive rows;
#   token: N (and N K slots, R N K routing);  weights / gradients: El experts and the shared one;
#   control: flags and state, a fixed few words.
ROLES = ("index", "ring", "token", "weights", "gradients", "control")
RING_BUFFERS = ("recv", "g", "u", "h", "y", "recv_dy", "dg", "du", "dx_rows")  # 4 x [M, H] + 5 x [M, I], bf16
WEIGHTS = ("w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down")
BUFFER_ROLE = {
    "sched": "index", "turn_sched": "index", **{name: "ring" for name in RING_BUFFERS}, **{name: "weights" for name in WEIGHTS},
    **{"d" + name: "gradients" for name in WEIGHTS}, "flags": "control", "state": "control", "link_clock": "control",
}


def role_of(name: str) -> str:
    """The role (ROLES) of buffer `name` of round_layout or layer_row_layout."""
    return BUFFER_ROLE.get(name, "token")


def round_layout(run: RunConfig, capacity: int, num_turns: int = 1) -> dict:
    """{name: (shape, dtype)} of the buffers every round has: routing, the schedule and the
    round's flags, and with a ring of several turns each turn's segments (every buffer
    symmetric). A function of the configuration alone, so a run can size the symmetric heap
    before it exists (see layer.gpu.symmetric_bytes). Only the schedule (`sched`: offsets, counts
    and src_rank, src_slot per receive row) follows the capacity."""
    n, k, num_ranks, el = run.shape.num_tokens, run.shape.top_k, run.num_ranks, run.num_local_experts
    return {"topk_idx": ((n, k), I32), "topk_w": ((n, k), F32), "routing": ((num_ranks, n * k), I32),
            "recv_row": ((n * k,), I32), "sched": ((kc.schedule_words(el, capacity),), I32),
            "sched_scratch": ((kc.schedule_scratch_words(num_ranks, n, k, el),), I32),
            "flags": ((len(abi.FLAG_KIND), num_ranks), np.uint64), "state": ((abi.CONST["kStateWords"],), np.uint64),
            "link_clock": ((2,), np.uint64),
            **({"turn_sched": ((num_turns * 2 * el,), I32)} if num_turns > 1 else {})}


def whole_ring(capacity: int, align: int = SEGMENT_ROWS) -> int:
    """The ring that holds every row: the capacity in whole segments (one turn)."""
    return -(-capacity // align) * align


def num_turns(capacity: int, macrobatch_rows: int) -> int:
    """T = ceil(C / M): the turns a pass runs through the ring (docs/design.md 3.1)."""
    return -(-capacity // macrobatch_rows)


def layer_row_layout(shape, num_local: int, macrobatch_rows: int) -> dict:
    """{name: (shape, dtype)} of the layer's own buffers (rows, saved activations, weights and
    gradients) for `num_local` experts per rank; the receive-row buffers (RING_BUFFERS) hold
    `macrobatch_rows` rows: GpuMoELayer.row_layout, callable without a GPU."""
    n, h, k, i_ffn, i_shared = shape.num_tokens, shape.hidden, shape.top_k, shape.ffn, shape.shared_ffn_size
    el, m = num_local, macrobatch_rows
    layout = {  # name: (shape, dtype); every buffer symmetric (peers reach the row buffers)
        # forward
        "x": ((n, h), BF16), "recv": ((m, h), BF16), "g": ((m, i_ffn), BF16), "u": ((m, i_ffn), BF16),
        "h": ((m, i_ffn), BF16), "y": ((m, h), BF16), "y_slots": ((n * k, h), BF16),
        "base": ((n, h), BF16), "out": ((n, h), BF16),
        # backward
        "dout": ((n, h), BF16), "dy_slots": ((n * k, h), BF16), "recv_dy": ((m, h), BF16),
        "dg": ((m, i_ffn), BF16), "du": ((m, i_ffn), BF16), "dx_rows": ((m, h), BF16),
        "dx_slots": ((n * k, h), BF16), "dx_base": ((n, h), BF16), "dx": ((n, h), BF16),
        "d_topk_w": ((n, k), F32),
        # routed weights (bf16) and their gradients (fp32)
        "w_gate": ((el, h, i_ffn), BF16), "w_up": ((el, h, i_ffn), BF16), "w_down": ((el, i_ffn, h), BF16),
        "dw_gate": ((el, h, i_ffn), F32), "dw_up": ((el, h, i_ffn), F32), "dw_down": ((el, i_ffn, h), F32),
    }
    if shape.num_shared == 1:
        layout.update({
            "sg": ((n, i_shared), BF16), "su": ((n, i_shared), BF16), "sh": ((n, i_shared), BF16),
            "sdg": ((n, i_shared), BF16), "sdu": ((n, i_shared), BF16),
            "shared_gate": ((1, h, i_shared), BF16), "shared_up": ((1, h, i_shared), BF16),
            "shared_down": ((1, i_shared, h), BF16),
            "dshared_gate": ((1, h, i_shared), F32), "dshared_up": ((1, h, i_shared), F32),
            "dshared_down": ((1, i_shared, h), F32),
        })
    return layout


def layer_layout(run: RunConfig, capacity: int, macrobatch_rows: int) -> dict:
    """Every symmetric buffer of one rank's GpuMoELayer, in allocation order: round_layout (the
    schedule sized for `capacity` rows) then layer_row_layout (a ring of `macrobatch_rows`)."""
    return {**round_layout(run, capacity, num_turns(capacity, macrobatch_rows)),
            **layer_row_layout(run.shape, run.num_local_experts, macrobatch_rows)}


def nbytes(shape, dtype) -> int:
    """Bytes of one buffer of `shape` and `dtype`."""
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
