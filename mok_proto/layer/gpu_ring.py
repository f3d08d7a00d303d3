"""The GPU layer's passes through a ring of several turns (docs/design.md 3.1), sequential or fused.

Legend: C logical receive capacity (rows), M ring rows (macrobatch_rows), T = ceil(C / M) turns.
Receive rows [t M, (t+1) M) are turn t; they live in rows 0 .. M-1 of the ring buffers (recv, g,
u, h, y, recv_dy, dg, du, dx_rows), and turn t's launches get CommParams with ring_lo = t M
(GpuMoELayer.turn_params) and GEMM segments from kernels.comm.turn_segments. The forward runs
turns T-1 .. 0, so the ring ends holding turn 0; the backward runs 0 .. T-1, replaying the
dispatch and gate/up of every turn after the first (standalone launches, also before a fused
backward). Each turn starts a new epoch on every rank (begin_round: all ranks run the same
launches, so their epochs agree), and two flags order the ring's reuse: kFlagRingFree (an owner's
ring may take the turn: pushes into it wait for every owner's) and kFlagPulled (a token owner
pulled the turn's rows out of every ring: owners wait for all before the next turn). Weight
gradients of turns after the first accumulate (GemmParams.accumulate): the bits of one pass.
A fused plan runs once a turn over the turn's rows (the shared expert's tiles in turn 0 only: the
other turns run the same plan built without them, FusedPass.rest); the backward's dy_slots and
token gradients then run outside it, once. FP8 routed experts (layer/gpu_fp8.py) run the same
turns: their dispatch (and its replay) moves codes and scales with dispatch_dtype fp8, and each
turn's fused backward is preceded by its quantizers (Fp8Experts.fused_args: dy's where the
reverse-combine ran outside, x's dequantizer for bf16 weight gradients inside with fp8 dispatch).
"""

from __future__ import annotations

from mok_proto.kernels import comm as kc
from mok_proto.kernels import token as kt

ROUTED_WGRAD = ("kSlotDownWgrad", "kSlotGateUpWgrad")  # the GEMMs that accumulate over turns


def _free_ring(p, launch, push_into_ring: bool, op: str):
    """A turn's start: a new epoch; my ring is free (every earlier use of it is done: my own
    launches, and every peer's pulls, waited for at the end of the previous turn); a rank that will
    push into the owners' rings waits until every owner said so."""
    kc.begin_round(p, launch)
    kc.raise_flag(p, launch, "kFlagRingFree")
    if push_into_ring:
        kc.wait_peers(p, launch, "kFlagRingFree", op)


def _into_ring(p, launch, direction: str, push_op: str):
    """Token-side rows of the turn into the owners' rings (their sources already published)."""
    if direction == "pull":
        kc.move_rows("dispatch_pull", p, launch)
    else:
        kc.move_rows("dispatch_push", p, launch)
        kc.wait_peers(p, launch, "kFlagDispatch", push_op)


def _dispatch_into_ring(layer, turn: int, direction: str):
    """Turn `turn`'s x rows into the owners' rings: bf16 rows, or with dispatch_dtype fp8 their
    codes and scales (layer/gpu_fp8.py)."""
    fp8 = getattr(layer, "fp8", None)
    if fp8 is not None and fp8.dispatch_fp8:
        fp8.dispatch(direction, turn, wait_map=False)
    else:
        _into_ring(layer.turn_params["fwd"][turn], layer.launch, direction, "kOpDispatchPush")


def _out_of_ring(p, launch, direction: str, push_op: str, pull_op: str, pushed_inside: bool = False):
    """The turn's result rows out of the rings into the token owners' slots (pushed_inside: a fused
    kernel pushed them: its flag and the wait); after a pull every token owner tells every owner it
    is done with its ring, and owners wait for all of them."""
    if pushed_inside or direction == "push":
        if not pushed_inside:
            kc.move_rows("combine_push", p, launch)
        else:
            kc.raise_flag(p, launch, "kFlagCombine")
        kc.wait_peers(p, launch, "kFlagCombine", push_op)
        return
    kc.raise_flag(p, launch, "kFlagReady")
    kc.wait_peers(p, launch, "kFlagReady", pull_op)
    kc.move_rows("combine_pull", p, launch)
    kc.raise_flag(p, launch, "kFlagPulled")
    kc.wait_peers(p, launch, "kFlagPulled", pull_op)


def forward_turns(layer, policy: dict, mark, inside=None):
    """After the schedule: the turns' segments, then per turn (last first) dispatch, gate/up, down,
    combine, the GEMMs (and a fused plan's transfers: `inside` = (incoming, outgoing) inside its
    kernel; None: sequential) per turn; the weighted sum."""
    launch, params, fused = layer.launch, layer.turn_params["fwd"], layer.fused if inside else None
    comm_in, comm_out = inside or (False, False)
    kc.turn_segments(layer.params_fwd, launch)
    layer._cache_valid = fused is None or fused.plan.ring_minibatches >= fused.plan.num_minibatches
    if fused is None:
        mark("shared")
        layer._launch_gemms("fwd", ("kSlotSharedFirst", "kSlotSharedSecond"))
    push = policy["dispatch"] == "push" and not comm_in
    if push:  # every owner placed its rows (the round's epoch: before any turn)
        kc.wait_peers(layer.params_fwd, launch, "kFlagMap", "kOpDispatchPush")
    mark("turns")
    for t in reversed(range(layer.num_turns)):
        p = params[t]
        _free_ring(p, launch, push, "kOpDispatchPush")
        if not comm_in:
            _dispatch_into_ring(layer, t, policy["dispatch"])
        if fused is None:
            layer._launch_gemms("fwd", ("kSlotFirst", "kSlotSecond"), turn=t)
        else:  # the shared expert's tiles in the last turn run (turn 0) only
            fp8 = {} if layer.fp8 is None else layer.fp8.fused_args(fused, t, comm_in)
            (fused if t == 0 else fused.rest).launch(p, layer._fused_words[t], layer.error,
                                                     int(layer.run.timeout_s * 1e9), trace=layer.trace, **fp8)
        _out_of_ring(p, launch, policy["combine"], "kOpCombinePush", "kOpCombinePull", pushed_inside=comm_out)
    mark("weighted_sum")
    kt.weighted_sum(layer.params_tok, launch)
    mark(None)


def backward_turns(layer, policy: dict, mark, inside=None, replay_first: bool = False):
    """After the round's start: dy_slots, [the shared expert's gradients], then per turn (first
    first) [replay: dispatch, gate/up], reverse-combine, down_bwd, gate_up_bwd, reverse-dispatch,
    the weight gradients (a fused plan: its kernel, `inside` as forward_turns'); the token gradients.
    replay_first: turn 0 is replayed too, for a backward that may not directly follow its forward
    (a graph of the backward alone: the last backward left the ring holding its last turn)."""
    launch, bwd = layer.launch, layer.turn_params["bwd"]
    fused = layer.fused_bwd if inside else None
    comm_in, comm_out = inside or (False, False)
    kt.scale_to_slots(layer.params_tok, launch)
    if fused is None:
        mark("shared")
        layer._launch_gemms("bwd", ("kSlotSharedFirst", "kSlotSharedSecond", "kSlotSharedDownWgrad",
                                    "kSlotSharedGateUpWgrad"))
    if policy["rev_combine"] == "pull":  # my dy rows are written (the round's epoch: before any turn)
        kc.raise_flag(layer.params_bwd, launch, "kFlagRouting")
        kc.wait_peers(layer.params_bwd, launch, "kFlagRouting", "kOpRevCombinePull")
    for t in range(layer.num_turns):
        p = bwd[t]
        pushes = ((t > 0 or replay_first) and policy["dispatch"] == "push") or policy["rev_combine"] == "push"
        if t > 0 or replay_first:  # later turns overwrote this turn's activations: replay them
            mark(f"replay.{t}")
            _free_ring(p, launch, pushes, "kOpDispatchPush")
            _dispatch_into_ring(layer, t, policy["dispatch"])
            layer._launch_gemms("fwd", ("kSlotFirst",), turn=t)  # gate/up + SwiGLU: g, u, h again
            kc.begin_round(p, launch)  # the reverse-combine's flags must not meet the replay's
            mark(f"turn.{t}")
        else:
            mark(f"turn.{t}")
            _free_ring(p, launch, pushes, "kOpRevCombinePush")
        if not comm_in:
            _into_ring(p, launch, policy["rev_combine"], "kOpRevCombinePush")
        if fused is None:
            layer._launch_gemms("bwd", ("kSlotFirst", "kSlotSecond"), turn=t)
        else:  # the shared expert's gradients in the first turn only
            fp8 = {} if layer.fp8 is None else layer.fp8.fused_args(fused, t, comm_in, "bwd")
            (fused if t == 0 else fused.rest).launch(p, layer._fused_bwd_words[t], layer.error,
                                                     int(layer.run.timeout_s * 1e9), trace=layer.trace,
                                                     token_params=layer.params_tok, **fp8)
        _out_of_ring(p, launch, policy["rev_dispatch"], "kOpRevDispatchPush", "kOpRevDispatchPull",
                     pushed_inside=comm_out)
        if fused is None or not fused.plan.routed_wgrads:  # (FP8 weight gradients run after the kernel)
            layer._launch_gemms("bwd", ROUTED_WGRAD, turn=t, accumulate=t > 0)
    mark("token_grads")
    kt.slot_sum(layer.params_tok, launch)
    kt.topk_weight_grad(layer.params_tok, launch)
    mark(None)
