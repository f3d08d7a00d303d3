"""The GPU layer's symmetric buffers as data, callable without a GPU: what a round allocates
(routing, schedule, flags), what the layer adds (rows, activations, weights, gradients), and the
role of each (what its size follows). GpuRound allocates from these; layer.gpu.symmetric_bytes
sizes the heap with them; mok_proto.memory states them.

Legend: N tokens/rank, H hidden, I expert FFN, Is shared FFN, K top-k, R ranks, El = E/R local
experts, C logical receive capacity (rows of the schedule's index space), M ring rows
(macrobatch_rows: the receive-row buffers), B = 128 (an FP8 scale block).
"""

from __future__ import annotations

import numpy as np

from mok_proto import abi
from mok_proto.config import RunConfig
from mok_proto.kernels import comm as kc
from mok_proto.plan.kinds import SEGMENT_ROWS

BF16, F32, I32, U8 = np.uint16, np.float32, np.int32, np.uint8
FP8_BLOCK = abi.CONST["kQuantBlock"]  # B

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


# precision fp8 (layer/gpu_fp8.py): e4m3 codes "<name>" (uint8) with their fp32 scales "<name>_s".
# The ring's codes of h, dy, dg, du serve two quantizations each (1 x B for a data GEMM, then the
# transposed B x 1 one for a weight gradient; dyq also x^T): fp8_row_layout says which.
FP8_RING_BUFFERS = tuple(f"{q}{s}" for q in ("xq", "hq", "dyq", "dgq", "duq") for s in ("", "_s"))
FP8_WEIGHTS = tuple(f"wq_{w}{t}{s}" for w in ("gate", "up", "down") for t in ("", "_t") for s in ("", "_s"))
FP8_BUFFER_ROLE = {**{name: "ring" for name in FP8_RING_BUFFERS}, **{name: "weights" for name in FP8_WEIGHTS}}


def role_of(name: str) -> str:
    """The role (ROLES) of buffer `name` of round_layout or layer_row_layout."""
    return BUFFER_ROLE.get(name) or FP8_BUFFER_ROLE.get(name, "token")


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


def layer_row_layout(shape, num_local: int, macrobatch_rows: int, precision: str = "bf16",
                     dispatch_dtype: str = "bf16", wgrad_precision: str | None = None) -> dict:
    """{name: (shape, dtype)} of the layer's own buffers (rows, saved activations, weights and
    gradients) for `num_local` experts per rank; the receive-row buffers (RING_BUFFERS) hold
    `macrobatch_rows` rows: GpuMoELayer.row_layout, callable without a GPU. precision "fp8" adds
    fp8_row_layout; with dispatch_dtype "fp8" x lands quantized, so the bf16 receive rows `recv`
    go, unless bf16 weight gradients (wgrad_precision) read x from them (dequantized there)."""
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
    if precision == "fp8":
        if dispatch_dtype == "fp8" and (wgrad_precision or precision) == "fp8":
            del layout["recv"]
        layout.update(fp8_row_layout(shape, num_local, macrobatch_rows, dispatch_dtype))
    return layout


def fp8_row_layout(shape, num_local: int, macrobatch_rows: int, dispatch_dtype: str = "bf16") -> dict:
    """The buffers the FP8 routed experts add (layer/gpu_fp8.py; docs/design.md 5.7): each a pair,
    e4m3 codes `name` [rows, cols] (uint8) and their scales `name`_s [rows, cols / B] (fp32); a
    transposed use views the same bytes as codes [cols, rows], scales [cols, rows / B]."""
    n, h, i_ffn, el, m, b = shape.num_tokens, shape.hidden, shape.ffn, num_local, macrobatch_rows, FP8_BLOCK
    layout = {}

    def pair(name, rows, cols):
        layout[name], layout[name + "_s"] = ((rows, cols), U8), ((rows, -(-cols // b)), F32)

    pair("xq", m, h)  # x 1 x B: quantized where it lands, or landed so (fp8 dispatch); the backward's x^T reads it
    pair("hq", m, i_ffn)  # h 1 x B (gate/up's epilogue, for down); backward: h^T [I, M]
    pair("dyq", m, h)  # dy 1 x B (down_bwd); then dy^T [H, M] (down_wgrad), then x^T [H, M] (gate_up_wgrad)
    pair("dgq", m, i_ffn)  # dg 1 x B (gate_up_bwd); then dg^T [I, M] (gate_up_wgrad)
    pair("duq", m, i_ffn)  # du, as dg
    if dispatch_dtype == "fp8":
        pair("xq_tok", n, h)  # the token owner's x rows 1 x B: what the dispatch moves
    for w, (r, c) in (("gate", (h, i_ffn)), ("up", (h, i_ffn)), ("down", (i_ffn, h))):
        # B x B blocks, both orientations: W for the data gradients, W^T for the forward (K-major)
        layout[f"wq_{w}"], layout[f"wq_{w}_s"] = ((el, r, c), U8), ((el, -(-r // b), -(-c // b)), F32)
        layout[f"wq_{w}_t"], layout[f"wq_{w}_t_s"] = ((el, c, r), U8), ((el, -(-c // b), -(-r // b)), F32)
    return layout


def layer_layout(run: RunConfig, capacity: int, macrobatch_rows: int) -> dict:
    """Every symmetric buffer of one rank's GpuMoELayer, in allocation order: round_layout (the
    schedule sized for `capacity` rows) then layer_row_layout (a ring of `macrobatch_rows`)."""
    return {**round_layout(run, capacity, num_turns(capacity, macrobatch_rows)),
            **layer_row_layout(run.shape, run.num_local_experts, macrobatch_rows, run.precision, run.dispatch_dtype,
                               run.wgrad_precision)}


def nbytes(shape, dtype) -> int:
    """Bytes of one buffer of `shape` and `dtype`."""
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
