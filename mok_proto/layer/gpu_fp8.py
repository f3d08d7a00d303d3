"""The GPU layer's FP8 routed experts (RunConfig(precision="fp8")): the sequential passes of
docs/design.md 5.7 on the GPU, stage for stage the BF16 layer's (layer/gpu.py, gpu_ring.py), with
the routed GEMMs of kernels/gemm_fp8.py and the quantizers of kernels/fp8.py where 5.7 puts them.

Legend: H hidden, I expert FFN, El local experts, M ring rows, B = 128 (a scale block). "q(a)": a
quantized 1 x B along its rows; "q^T(a)": B x 1 over each expert's rows (quantize_rows(transpose=
True) from the expert's first row, its last block zero-padded), stored transposed. Buffers: the
pairs of layout.fp8_row_layout (codes `name`, scales `name`_s).

    set_weights    wq_w, wq_w_t = quantize_blocks(bf16 W): W for the data gradients, W^T for the forward
    forward        [fp8 dispatch: xq_tok = q(x) by the token owner, before the routing flag publishes it]
                   dispatch: bf16 rows into recv, then xq = q(recv) | xq_tok's codes and scales into xq
                   gate_up(xq, Wg^T, Wu^T) -> g, u, h (bf16), hq = q(h) (its epilogue); down(hq, Wd^T) -> y
    backward       dyq = q(dy); down_bwd(dyq, Wd, g, u) -> dg, du; dgq, duq = q(dg), q(du) (fused: its epilogue);
                   gate_up_bwd(dgq, duq, Wg, Wu) -> dx rows
                   hq := q^T(h), dyq := q^T(dy); down_wgrad -> dWd
                   dyq := q^T(deq(xq)), dgq := q^T(dg), duq := q^T(du); gate_up_wgrad -> dWg, dWu
The backward's codes reuse the ring's: each 1 x B quantization is dead when its transposed
successor is written (a later launch of the same stream), so FP8 adds 2H + 3I codes a ring row,
not 3H + 6I. Every quantizer reads only the rows of the turn's expert segments (the schedule's
offsets and counts, on the device). x^T comes from the dequantized xq, never from bf16 x, so both
dispatch dtypes give the same bits. The shared expert stays BF16 (gpu.py's GEMMs).
RunConfig.wgrad_precision "bf16": the weight gradients are the BF16 layer's GEMMs on h, recv_dy,
dg, du and the bf16 x rows in recv (with fp8 dispatch deq(xq) rounded to bf16, written there);
no transposed quantization (reference_fp8).

FP8 dispatch moves two rows a slot with the dispatch's own kernels: xq_tok's codes (H bytes) into
xq, its scales (H/32 bytes) into xq_s. Pulled: two pulls. Pushed: each push raises kFlagDispatch
at the round's epoch, so the codes' push is waited for, the epoch advanced (begin_round, on every
rank alike), then the scales pushed and waited for: a wait can only be met by the push it waits for.
"""

from __future__ import annotations

import numpy as np

from mok_proto import abi
from mok_proto.kernels import comm as kc
from mok_proto.kernels import fp8 as kq
from mok_proto.kernels import gemm
from mok_proto.kernels import gemm_fp8 as kg
from mok_proto.layer.gpu_ring import ROUTED_WGRAD

B = abi.CONST["kQuantBlock"]


def wgrads_inside(run) -> bool:
    """Whether fused_backward_fp8 may run this FP8 layer's routed weight gradients: BF16 ones (their
    tiles are the BF16 kernel's). FP8 ones run after it, with their operands' transposed quantizations."""
    return not run.fp8_wgrad


def check_fused(plan, run) -> None:
    """ValueError (one line) for a fused plan the FP8 layer does not run (wgrads_inside)."""
    if plan.pass_ == "bwd" and plan.routed_wgrads and not wgrads_inside(run):
        raise ValueError("precision fp8: the fused backward runs FP8 routed weight gradients after the kernel (bf16 "
                         "ones, RunConfig(wgrad_precision='bf16'), may run inside): build its plan with "
                         "FusedKnobs(routed_wgrads=False) (fused_backward_plan() does so by default)")


def check_run(run) -> None:
    """ValueError (one line) for an FP8 configuration the GPU layer does not run."""
    if run.shared_precision != "bf16":
        raise ValueError("shared_precision fp8: the GPU layer's shared expert is bf16 (an fp8 shared expert runs on "
                         "the CPU layer: RunConfig(..., shared_precision='fp8') there)")


class Fp8Experts:
    """The FP8 part of one GpuMoELayer: its weights' codes, the dispatch of codes and scales
    (dispatch_dtype fp8), and per GemmSlot of its routed experts the quantizers and the FP8 GEMM."""

    def __init__(self, layer):
        self.layer = layer
        self.dispatch_fp8 = layer.run.dispatch_dtype == "fp8"
        self.turn_params = None  # fp8 dispatch: per turn {"codes": CommParams, "scales": CommParams}
        self.launches = None  # ... and their kc.Launch

    # -----------------------------------------------------------------------------------------
    # Host-side setup
    # -----------------------------------------------------------------------------------------
    def quantize_weights(self, rank: int, key: str, first: int, num: int):
        """Experts first .. first + num - 1 of routed weight `key` (w_gate, w_up, w_down: bf16 as the
        layer holds them) into their codes, both orientations (one quantize_blocks launch)."""
        b, part = self.layer._b, slice(first, first + num)
        name = "wq_" + key[2:]
        kq.quantize_blocks(b(key, rank)[part], transposed=True, codes=b(name, rank)[part],
                           scales=b(name + "_s", rank)[part], codes_t=b(name + "_t", rank)[part],
                           scales_t=b(name + "_t_s", rank)[part])

    def launch_only(self, ranks, blocks_per_rank):
        """The fp8 dispatch's CommParams per turn (the forward's, with xq_tok -> xq and xq_tok_s ->
        xq_s as its rows) for the launch ranks `ranks`."""
        if not self.dispatch_fp8:
            return
        layer, h = self.layer, self.layer.shape.hidden
        table = layer.tables()
        parts = {"codes": ("xq_tok", "xq", h), "scales": ("xq_tok_s", "xq_s", 4 * h // B)}
        self.turn_params = [{part: kc.pack_params({**layer.comm_fields(ranks, row_bytes, t), "slot_rows": 0,
                                                   "x": table[src], "recv": table[dst], "y": 0, "slots": 0,
                                                   "base": 0, "out": 0, "scale": 0})
                             for part, (src, dst, row_bytes) in parts.items()} for t in range(layer.num_turns)]
        self.launches = {part: layer.launch_for(ranks, row_bytes, blocks_per_rank)
                         for part, (_, _, row_bytes) in parts.items()}

    # -----------------------------------------------------------------------------------------
    # The passes' parts (enqueued on the current stream)
    # -----------------------------------------------------------------------------------------
    def quantize_tokens(self):
        """fp8 dispatch: every launch rank's x rows into xq_tok (before the routing all-gather,
        whose flag publishes them to pullers)."""
        if not self.dispatch_fp8:
            return
        b = self.layer._b
        for r in self.layer.ranks:
            kq.quantize_rows(b("x", r), codes=b("xq_tok", r), scales=b("xq_tok_s", r))

    def dispatch(self, direction: str, turn: int, wait_map: bool):
        """fp8 dispatch of turn `turn`: xq_tok's codes, then its scales, into the owners' xq, xq_s
        (wait_map: a push right after the schedule first waits until every owner placed its rows)."""
        p, launch = self.turn_params[turn], self.launches
        if direction == "pull":  # the sources were published before (the routing flag, or an earlier round)
            for part in ("codes", "scales"):
                kc.move_rows("dispatch_pull", p[part], launch[part])
            return
        if wait_map:
            kc.wait_peers(p["codes"], launch["codes"], "kFlagMap", "kOpDispatchPush")
        for i, part in enumerate(("codes", "scales")):
            if i:  # NOTE: a new epoch, so that the scales' wait is met by the scales' flags only
                kc.begin_round(p[part], launch[part])
            kc.move_rows("dispatch_push", p[part], launch[part])
            kc.wait_peers(p[part], launch[part], "kFlagDispatch", "kOpDispatchPush")

    def fused_words(self, ranks, turn: int = 0, pass_: str = "fwd") -> tuple:
        """A fused FP8 pass's params (fused_forward_fp8, fused_backward_fp8) for turn `turn` of the
        ring: (W x kFusedGemms packed Fp8GemmParams, the routed slots' first and second GEMM on the
        turn's rows (forward: gate_up, down; backward: down_bwd with dgq, duq, gate_up_bwd), the
        other slots zero; W packed QuantParams, each launch rank's rows the incoming transfer's
        movers quantize: forward recv -> xq, xq_s (none with fp8 dispatch), backward recv_dy -> dyq,
        dyq_s: the ring's rows, the same every turn)."""
        layer, b = self.layer, self.layer._b
        src, dst = {"fwd": ("recv", "xq"), "bwd": ("recv_dy", "dyq")}[pass_]
        gemms, quants = [], []
        for r in ranks:
            for slot, _ in abi.GEMM_SLOT.members:
                if slot in ("kSlotFirst", "kSlotSecond"):
                    fn, args, kwargs = self.steps(pass_, slot, r, turn, fused=True)[-1]
                    gemms.append(fn(*args, **{**kwargs, "pack_only": True}))
                else:
                    gemms.append(np.zeros(abi.FP8_GEMM_PARAMS.nbytes // 8, np.uint64))
            if pass_ == "fwd" and self.dispatch_fp8:  # the movers copy codes and scales: nothing to quantize
                quants.append(abi.QUANT_PARAMS.pack(dict.fromkeys(abi.QUANT_PARAMS.names, 0)))
                continue
            rows = b(src, r)
            quants.append(abi.QUANT_PARAMS.pack({**dict.fromkeys(abi.QUANT_PARAMS.names, 0), "batch": 1,
                                                 "rows": rows.shape[0], "cols": layer.shape.hidden, "x": rows,
                                                 "codes": b(dst, r), "scales": b(dst + "_s", r)}))
        return np.concatenate(gemms), np.concatenate(quants)

    def bf16_words(self, pass_: str, slot: str, r: int, turn: int, inside: bool) -> np.ndarray:
        """Rank r's packed GemmParams of routed GemmSlot `slot` in a fused FP8 pass: the BF16 weight
        gradient (inside: wgrads_inside; accumulating after the first turn), else a blank record
        whose error and timeout_ns alone the kernel reads (gemm_setup's abort check, the pool's
        tickets): the routed tiles are FP8 (fused_words)."""
        if inside and pass_ == "bwd" and slot in ROUTED_WGRAD:
            fn, args, kwargs = self.steps(pass_, slot, r, turn, accumulate=turn > 0)[-1]
            return fn(*args, **{**kwargs, "pack_only": True})
        return abi.GEMM_PARAMS.pack({**dict.fromkeys(abi.GEMM_PARAMS.names, 0), "error": self.layer.error.ptr})

    def fused_args(self, fused, turn: int, comm_in: bool, pass_: str = "fwd") -> dict:
        """A fused FP8 pass's launch arguments for turn `turn` (fused.fp8_words). The movers quantize
        the rows they pull (forward xq = q(recv), backward dyq = q(recv_dy)); rows a transfer outside
        the kernel (comm_in False) moved are quantized first, here, by the sequential quantizer
        (enqueued now). fp8 dispatch (forward): the movers pull the token owners' codes and scales
        rows (dispatch_params); outside the kernel, the caller moved them (dispatch). A backward with
        its (bf16) routed weight gradients inside: their x rows' dequantization (fp8 dispatch) first."""
        gemms, quants = fused.fp8_words[turn]
        if pass_ == "bwd" and fused.plan.routed_wgrads:  # bf16 weight gradients inside: their x rows first
            for r in self.layer.ranks:
                for fn, args, kwargs in self.steps("bwd", "kSlotGateUpWgrad", r, turn)[:-1]:
                    fn(*args, **kwargs)
        if pass_ == "fwd" and self.dispatch_fp8:
            rows = (self.turn_params[turn]["codes"], self.turn_params[turn]["scales"]) if comm_in else None
            return {"fp8_gemm_params": gemms, "quant_params": None, "dispatch_params": rows}
        for r in ([] if comm_in else self.layer.ranks):
            for fn, args, kwargs in self.steps(pass_, "kSlotFirst", r, turn)[:-1]:
                fn(*args, **kwargs)
        return {"fp8_gemm_params": gemms, "quant_params": quants if comm_in else None}

    def launch(self, pass_: str, slot: str, r: int, turn: int = 0, accumulate: bool = False):
        """Launch the routed GemmSlot `slot` of pass `pass_` for rank r on turn `turn`'s rows: its
        quantizers, then its FP8 GEMM (accumulate: a weight gradient adds to what it holds)."""
        for fn, args, kwargs in self.steps(pass_, slot, r, turn, accumulate):
            fn(*args, **kwargs)

    def steps(self, pass_: str, slot: str, r: int, turn: int = 0, accumulate: bool = False,
              fused: bool = False) -> list:
        """[(function, args, kwargs)] of `launch`, in launch order. dgq, duq = q(dg), q(du): the row
        quantizer's launches before gate_up_bwd, or (fused: the fused kernel, which launches nothing)
        down_bwd's epilogue; the same bits (docs/design.md 5.10)."""
        layer = self.layer
        b, rows, err = layer._b, layer._rows(r, turn), {"error": layer.error}
        h, i_ffn = layer.shape.hidden, layer.shape.ffn

        def q(name):  # codes and scales, 1 x B along a row of the ring
            return b(name, r), b(name + "_s", r)

        def qt(name, cols):  # the same bytes as the transposed quantization [cols, M], [cols, M / B]
            codes, scales = q(name)
            return codes.reshape(cols, -1), scales.reshape(cols, -1)

        def w(name):  # a weight's codes and scales, "" (W) or "_t" (W^T)
            return q("wq_" + name)

        def rows_q(src, dst):
            return kq.quantize_segment_rows, (b(src, r), *rows, *q(dst)), {}

        def cols_q(src, dst, cols):
            return kq.quantize_segment_columns, (b(src, r), *rows, *qt(dst, cols)), err

        wgrad = {"accumulate": accumulate, **err}
        table = {
            ("fwd", "kSlotFirst"): [] if self.dispatch_fp8 else [rows_q("recv", "xq")],
            ("fwd", "kSlotSecond"): [],
            ("bwd", "kSlotFirst"): [rows_q("recv_dy", "dyq")],
            ("bwd", "kSlotSecond"): [] if fused else [rows_q("dg", "dgq"), rows_q("du", "duq")],
            ("bwd", "kSlotDownWgrad"): [cols_q("h", "hq", i_ffn), cols_q("recv_dy", "dyq", h)],
            ("bwd", "kSlotGateUpWgrad"): [(kq.quantize_segment_columns, (b("xq", r), *rows, *qt("dyq", h)),
                                           {"x_scales": b("xq_s", r), **err}),
                                          cols_q("dg", "dgq", i_ffn), cols_q("du", "duq", i_ffn)],
        }
        gemms = {
            ("fwd", "kSlotFirst"): (kg.gate_up, (q("xq"), w("gate_t"), w("up_t"), *rows, b("h", r), q("hq")),
                                    {"g": b("g", r), "u": b("u", r), **err}),
            ("fwd", "kSlotSecond"): (kg.down, (q("hq"), w("down_t"), *rows, b("y", r)), err),
            ("bwd", "kSlotFirst"): (kg.down_bwd, (q("dyq"), w("down"), b("g", r), b("u", r), *rows, b("dg", r),
                                                  b("du", r)), {**({"dgq": q("dgq"), "duq": q("duq")} if fused else {}), **err}),
            ("bwd", "kSlotSecond"): (kg.gate_up_bwd, (q("dgq"), q("duq"), w("gate"), w("up"), *rows,
                                                      b("dx_rows", r)), err),
            ("bwd", "kSlotDownWgrad"): (kg.down_wgrad, (qt("hq", i_ffn), qt("dyq", h), *rows, b("dw_down", r)),
                                        wgrad),
            ("bwd", "kSlotGateUpWgrad"): (kg.gate_up_wgrad, (qt("dyq", h), qt("dgq", i_ffn), qt("duq", i_ffn), *rows,
                                                             b("dw_gate", r), b("dw_up", r)), wgrad),
        }
        if not layer.run.fp8_wgrad:  # bf16 weight gradients: the BF16 layer's GEMMs, no transposed quantization;
            # with fp8 dispatch x's bf16 rows are its codes dequantized into recv (which nothing else writes then)
            table.update({("bwd", "kSlotDownWgrad"): [], ("bwd", "kSlotGateUpWgrad"): [
                (kq.dequantize_segment_rows, (*q("xq"), *rows, b("recv", r)), {})] if self.dispatch_fp8 else []})
            gemms.update({
                ("bwd", "kSlotDownWgrad"): (gemm.down_wgrad, (b("h", r), b("recv_dy", r), *rows, b("dw_down", r)), wgrad),
                ("bwd", "kSlotGateUpWgrad"): (gemm.gate_up_wgrad, (b("recv", r), b("dg", r), b("du", r), *rows,
                                                                   b("dw_gate", r), b("dw_up", r)), wgrad)})
        if (pass_, slot) not in gemms:
            raise ValueError(f"no routed FP8 GEMM for {pass_} {slot}")
        return table[pass_, slot] + [gemms[pass_, slot]]
