"""The kernel ABI: ONE description of every struct, enum and constant that Python and CUDA share.

`cuda/abi.cuh` is generated from this file and checked in (`python -m mok_proto.abi` rewrites
it; `tests/test_abi.py` regenerates it and fails on any difference, so neither side can drift).
The header carries `static_assert`s on every struct's `sizeof` and on every field's offset, and
the Python side packs parameter blocks with `Struct.pack`, built from the same field list. Sizes
that only the compiler knows (a kernel's shared memory, `sizeof` of a shared-memory layout) are
written by a small export kernel of the header and read once from the compiled module
(`kernels.build.CudaModule.read_sizes`), never recomputed here.

This module imports nothing of the project: every layer (protocol, kernels, layer) may use it.

Legend: N tokens/rank, H hidden, K top-k, R ranks, E experts, El = E/R local experts,
C receive capacity (rows of the receive buffer), W ranks driven by one launch.
Names: a *slot* is a token's j-th choice, s = t*K + j (token side); a *receive row* is a row of
an expert owner's receive buffer (expert side); the *slot buffer* is the token owner's [N*K, H].
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

HEADER = "abi.cuh"  # under cuda/


# ---------------------------------------------------------------------------------------------
# Spec types
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Enum:
    """A C++ `enum Name : int` whose k-th member has value k; `count` adds kNum<Name>s."""

    name: str
    members: tuple  # ((cpp_name, text), ...): text is what errors print
    namespace: str = "mok"
    count: str | None = None  # name of a trailing member holding the number of members

    def __getitem__(self, cpp_name: str) -> int:
        for value, (name, _) in enumerate(self.members):
            if name == cpp_name:
                return value
        raise KeyError(f"{self.name} has no member {cpp_name!r}")

    def text(self, value: int) -> str:
        """What an error message prints for a value read back from the device."""
        if 0 <= value < len(self.members):
            return self.members[value][1]
        return f"<{self.name} {value}>"

    def __len__(self):
        return len(self.members)


@dataclass(frozen=True)
class Const:
    name: str
    value: int
    comment: str
    namespace: str = "mok"


# C++ field types and their NumPy formats. A field type may end in "[n]" (an array: `int x[2];`).
# Structs take C's layout: every field at a multiple of its size, the struct padded to a multiple
# of its largest field (NumPy's align=True), so the static_asserts of the header hold.
FIELD_TYPES = {"i64": "<i8", "u64": "<u8", "const u64*": "<u8", "ErrorRecord*": "<u8",
               "int": "<i4", "bool": "|b1", "TaskKind": "<i4", "CounterKind": "<i4"}


def _field_format(ctype: str):
    """"int[2]" -> ("<i4", (2,)); "i64" -> "<i8"."""
    base, _, count = ctype.partition("[")
    return (FIELD_TYPES[base], (int(count.rstrip("]")),)) if count else FIELD_TYPES[base]


@dataclass(frozen=True)
class Struct:
    name: str
    fields: tuple  # ((ctype, name, comment), ...)
    namespace: str = "mok"

    @property
    def names(self) -> tuple:
        return tuple(name for _, name, _ in self.fields)

    @cached_property
    def dtype(self) -> np.dtype:
        """The C layout (natural alignment, trailing padding) as a NumPy record type."""
        return np.dtype({"names": list(self.names), "formats": [_field_format(t) for t, _, _ in self.fields]},
                        align=True)

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize

    def offset(self, name: str) -> int:
        return self.dtype.fields[name][1]

    def pack(self, values: dict) -> np.ndarray:
        """values (every field, by name) -> the struct's bytes as a uint64 host array. A value may
        be an int, anything with `.data.ptr` (a CuPy array: its device address), or a NumPy array
        (its host address: CPU tests' stand-ins)."""
        missing, extra = set(self.names) - set(values), set(values) - set(self.names)
        if missing or extra:
            raise ValueError(f"{self.name}: missing fields {sorted(missing)}, unknown fields {sorted(extra)}")
        record = np.zeros(1, self.dtype)
        for ctype, name, _ in self.fields:
            value = values[name]
            if hasattr(value, "data") and hasattr(value.data, "ptr"):
                value = value.data.ptr
            elif isinstance(value, np.ndarray):
                value = value.ctypes.data
            value = int(value)
            if FIELD_TYPES[ctype] == "<u8":
                value &= 0xFFFFFFFFFFFFFFFF
            record[name] = value
        return record.view(np.uint64)

    def unpack(self, words) -> dict:
        """uint64 words (as read back from the device) -> {field: int}."""
        record = np.ascontiguousarray(words, dtype=np.uint64)[: self.nbytes // 8].view(self.dtype)[0]
        return {name: int(record[name]) for name in self.names}


# ---------------------------------------------------------------------------------------------
# Enums
# ---------------------------------------------------------------------------------------------
ERROR_CODE = Enum("ErrorCode", (("kErrNone", "no error"), ("kErrTimeout", "timeout"),
                                ("kErrCapacity", "capacity")))

# One namespace of operators for every kernel: what an error record's `op` names.
OP = Enum("Op", (
    ("kOpRouting", "routing all-gather"),
    ("kOpSchedule", "schedule"),
    ("kOpDispatchPull", "dispatch (pull)"),
    ("kOpDispatchPush", "dispatch (push)"),
    ("kOpCombinePush", "combine (push)"),
    ("kOpCombinePull", "combine (pull)"),
    ("kOpRevCombinePull", "reverse-combine (pull)"),
    ("kOpRevCombinePush", "reverse-combine (push)"),
    ("kOpRevDispatchPush", "reverse-dispatch (push)"),
    ("kOpRevDispatchPull", "reverse-dispatch (pull)"),
    ("kOpGemmLoad", "GEMM producer (waiting for a free stage)"),
    ("kOpGemmMma", "GEMM consumer (waiting for a loaded stage)"),
    ("kOpGemmAux", "GEMM consumer (waiting for an epilogue operand stage)"),
    ("kOpFusedWait", "fused layer task (waiting for a ready counter)"),
    ("kOpFusedClaim", "fused layer cluster (handing a claimed tile pair to its CTAs)"),
    ("kOpQuantColumns", "segment column quantizer (waiting for a staged item)"),
    # Token side, after the combine: slots whose expert owner placed no receive row (its buffer
    # overflowed), found by the weighted sum (cuda/common.cuh report_unplaced_slots).
    ("kOpWeightedSum", "weighted sum"),
), count="kNumOps")

# Flags of a communication round: flags[kind, src] on every rank, raised by src.
FLAG_KIND = Enum("FlagKind", (
    ("kFlagRouting", "routing"),
    ("kFlagMap", "map"),
    ("kFlagDispatch", "dispatch"),
    ("kFlagReady", "ready"),
    ("kFlagCombine", "combine"),
    ("kFlagRingFree", "ring free"),  # an expert owner's ring may take the turn's rows (pushes wait for it)
    ("kFlagPulled", "pulled"),  # a token owner pulled the turn's rows out of every owner's ring
), count="kNumFlagKinds")

GEMM_PROBLEM = Enum("Problem", (
    ("kGateUp", "gate_up"),
    ("kDown", "down"),
    ("kDownBwd", "down_bwd"),
    ("kGateUpBwd", "gate_up_bwd"),
    ("kDownWgrad", "down_wgrad"),
    ("kGateUpWgrad", "gate_up_wgrad"),
), namespace="mok::gemm")

# Plans (mok_proto/plan/): what one task of a CTA's table does, and what a counter counts. The
# text is the Python name (plan.TaskKind.GATE_UP is text "gate_up" upper-cased).
TASK_KIND = Enum("TaskKind", (
    # forward
    ("kTaskDispatch", "dispatch"),
    ("kTaskSharedGateUp", "shared_gate_up"),
    ("kTaskSharedDown", "shared_down"),
    ("kTaskGateUp", "gate_up"),  # SwiGLU fused in the epilogue
    ("kTaskDown", "down"),
    ("kTaskCombine", "combine"),
    ("kTaskWeightedSum", "weighted_sum"),
    # backward
    ("kTaskRevCombine", "rev_combine"),
    ("kTaskSharedDownBwd", "shared_down_bwd"),
    ("kTaskSharedGateUpBwd", "shared_gate_up_bwd"),
    ("kTaskDownBwd", "down_bwd"),  # SwiGLU backward fused
    ("kTaskGateUpBwd", "gate_up_bwd"),
    ("kTaskRevDispatch", "rev_dispatch"),
    ("kTaskDownWgrad", "down_wgrad"),
    ("kTaskGateUpWgrad", "gate_up_wgrad"),
    ("kTaskSharedDownWgrad", "shared_down_wgrad"),
    ("kTaskSharedGateUpWgrad", "shared_gate_up_wgrad"),
    ("kTaskSlotSum", "slot_sum"),  # sum of the K input-gradient slots + the shared expert's
    ("kTaskScale", "scale"),  # dy_slots = w * dout of kEpilogueRows tokens (what the reverse-combine moves)
), namespace="mok::plan", count="kNumTaskKinds")

COUNTER_KIND = Enum("CounterKind", (
    ("kCounterArrived", "arrived"),  # per minibatch: its rows landed in the ring (dispatch / rev_combine)
    ("kCounterFirstDone", "first_done"),  # per row tile: first GEMM's tiles (fwd: h; bwd: dg, du)
    ("kCounterSecondDone", "second_done"),  # per minibatch: second GEMM's tiles (fwd: y; bwd: dx)
    ("kCounterReleased", "released"),  # per minibatch: its ring slot may be refilled
    ("kCounterSlotsArrived", "slots_arrived"),  # one: every [N*K, H] slot row of this rank arrived
    ("kCounterSharedFirstDone", "shared_first_done"),  # per shared row tile
    ("kCounterSharedDone", "shared_done"),  # one: the shared expert's output (or input gradient)
    ("kCounterDataGradDone", "data_grad_done"),  # per macrobatch: weight gradients may start
    ("kCounterWgradDone", "wgrad_done"),  # per macrobatch: weight gradients read the ring rows
    ("kCounterStageDone", "stage_done"),  # per stage (sequential plans only)
    ("kCounterSharedSecondDone", "shared_second_done"),  # one: the shared expert's second GEMM (bwd: dx_base)
    ("kCounterPublished", "published"),  # one: the rows peers pull from this rank are written (bwd: dy_slots)
    ("kCounterClaimed", "claimed"),  # one (fused plans with a pool): pool pairs claimed so far (the ticket)
), namespace="mok::plan", count="kNumCounterKinds")

# The fused layer's GEMMs of one launch rank, in FusedParams.gemm order (a forward leaves the
# weight-gradient slots zero).
GEMM_SLOT = Enum("GemmSlot", (
    ("kSlotSharedFirst", "shared expert, first GEMM (fwd: gate/up; bwd: down_bwd)"),
    ("kSlotSharedSecond", "shared expert, second GEMM (fwd: down; bwd: gate_up_bwd)"),
    ("kSlotFirst", "routed experts, first GEMM (fwd: gate/up; bwd: down_bwd)"),
    ("kSlotSecond", "routed experts, second GEMM (fwd: down; bwd: gate_up_bwd)"),
    ("kSlotSharedDownWgrad", "shared expert, down's weight gradient (bwd)"),
    ("kSlotSharedGateUpWgrad", "shared expert, gate/up's weight gradients (bwd)"),
    ("kSlotDownWgrad", "routed experts, down's weight gradients (bwd)"),
    ("kSlotGateUpWgrad", "routed experts, gate/up's weight gradients (bwd)"),
), namespace="mok::fused", count="kFusedGemms")

# The task kinds the fused kernel's movers run (kMoverKinds below): the transfers' chunks and the
# backward's token-side work (the scale before the reverse-combine, the token gradients).
MOVER_KINDS = ("kTaskDispatch", "kTaskCombine", "kTaskRevCombine", "kTaskRevDispatch", "kTaskSlotSum", "kTaskScale")

# The remote counters (raised by every rank's tasks) the fused kernel executes, as the round's peer
# flags (kRemoteCounterKinds below; cuda/fused_sync.cuh remote_flag: SLOTS_ARRIVED as kFlagCombine,
# PUBLISHED as kFlagRouting).
REMOTE_COUNTER_KINDS = ("kCounterSlotsArrived", "kCounterPublished")

ENUMS = (ERROR_CODE, OP, FLAG_KIND, GEMM_PROBLEM, TASK_KIND, COUNTER_KIND, GEMM_SLOT)

# ---------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------
CONSTS = (
    # Communication kernels
    Const("kCommThreads", 256, "threads of a row-copy block: 8 warps, one row per warp"),
    Const("kScheduleThreads", 1024, "threads of the schedule's scan block"),
    Const("kScheduleSegment", 1024, "slots of one source rank per block of the schedule's count and place steps"),
    Const("kStateWords", 1 + len(OP), "a round's state: the epoch, then one last-block counter per Op "
          "(the comm kernels use theirs)"),
    # Grouped GEMM tiles
    Const("kBM", 128, "rows of a GEMM tile (one 64-row half per consumer warpgroup)", "mok::gemm"),
    Const("kBN", 256, "columns of a GEMM tile (dual problems: 128 of each matrix)", "mok::gemm"),
    Const("kBK", 64, "k depth of one pipeline stage", "mok::gemm"),
    Const("kStages", 4, "stages of the shared-memory ring", "mok::gemm"),
    Const("kThreads", 384, "warpgroup 0: producer; 1, 2: consumers", "mok::gemm"),
    Const("kCluster", 2, "CTAs per cluster (tile pairs along M sharing B by multicast)", "mok::gemm"),
    Const("kConsumerWarps", 8, "warps of the two consumer warpgroups", "mok::gemm"),
    Const("kMaxGroups", 1024, "experts one grouped GEMM launch may cover", "mok::gemm"),
    Const("kStagingFloats", 2 * 8 * 32, "epilogue staging per consumer warp: 2 areas of 8 rows x 32 fp32",
          "mok::gemm"),
    # Plans
    Const("kMoverKinds", sum(1 << TASK_KIND[k] for k in MOVER_KINDS), "bit k set: the fused kernel's movers (a "
          "communicating CTA's warps, a compute CTA's spare warps) run TaskKind k, its GEMM warps the others",
          "mok::plan"),
    Const("kRemoteCounterKinds", sum(1 << COUNTER_KIND[k] for k in REMOTE_COUNTER_KINDS), "bit k set: the fused "
          "kernel keeps a remote counter of CounterKind k as peer flags (remote_flag)", "mok::fused"),
    Const("kFusedLocalTimeoutFactor", 2, "the fused kernel's waits on its own counters give up after this x the "
          "timeout of a wait on a peer's flag (the peer's timeout is reported first)", "mok::fused"),
    Const("kEpilogueRows", 16, "tokens of one weighted-sum / slot-sum task (row_tile: tokens kEpilogueRows "
          "row_tile ..)", "mok::plan"),
    # FP8 quantization (mok_proto/fp8.py is the rule; cuda/fp8.cuh matches it bit for bit)
    Const("kQuantBlock", 128, "edge of a quantization block: 1 x 128 (activations), 128 x 128 (weights)", "mok::fp8"),
    Const("kE4m3Max", 448, "the largest finite e4m3 value (scale = amax / kE4m3Max)", "mok::fp8"),
    Const("kQuantThreads", 256, "threads of a quantizer block (8 warps)", "mok::fp8"),
    Const("kQuantCtasPerSm", 6, "the segment row quantizer's grid: this many CTAs per SM", "mok::fp8"),
    Const("kQuantColumnCtasPerSm", 2, "the segment column quantizer's grid and register bound: this many CTAs "
          "per SM, each with kQuantColumnStages items in flight", "mok::fp8"),
    Const("kQuantColumnStages", 2, "the segment column quantizer's staged items a CTA (TMA boxes in flight)",
          "mok::fp8"),
    Const("kQuantColumnItemBytes", 128, "the segment column quantizer's items: B rows x this many bytes of each "
          "row (one TMA box of x_map, 128-byte swizzle)", "mok::fp8"),
    Const("kQuantColumns", 64, "columns of x one block of the whole-array column quantizer takes (a grid's x: "
          "ceil(cols / this))", "mok::fp8"),
)
CONST = {c.name: c.value for c in CONSTS}

# ---------------------------------------------------------------------------------------------
# Structs
# ---------------------------------------------------------------------------------------------
ERROR_RECORD = Struct("ErrorRecord", (
    ("u64", "code", "ErrorCode; 0 = no error. The first failure in a process wins (atomicCAS)"),
    ("i64", "op", "Op: which operator"),
    ("i64", "rank", "EP rank that noticed (-1: not rank-specific)"),
    ("i64", "peer", "timeout: peer waited for; capacity: rows needed (kOpWeightedSum: the expert owner "
                    "that overflowed); -1 if none"),
    ("i64", "expected", "timeout: epoch (or barrier parity) waited for; capacity: capacity in rows "
                        "(kOpWeightedSum: the rank's slots, N*K)"),
    ("i64", "seen", "timeout: flag value seen; capacity, kOpWeightedSum: slots that got no expert result"),
    ("i64", "block", "blockIdx.x of the reporting thread"),
    ("i64", "thread", "threadIdx.x of the reporting thread"),
    ("i64", "detail", "kernel-specific: the GEMM Problem for kOpGemm*, the task for kOpFusedWait, the cluster's "
                      "ticket (claim) for kOpFusedClaim; -1 otherwise"),
))

COMM_PARAMS = Struct("CommParams", (
    ("i64", "num_ranks", "R"),
    ("i64", "rank_base", "EP rank of blockIdx.y == 0"),
    ("i64", "num_tokens", "N"),
    ("i64", "top_k", "K"),
    ("i64", "num_experts", "E"),
    ("i64", "num_local_experts", "El"),
    ("i64", "row_bytes", "row size in bytes (H * sizeof(elem); even)"),
    ("i64", "slot_rows", "token-side source `x`: 0 one row per token (x[s / K]), 1 one row per slot"),
    ("i64", "hidden", "H (elements)"),
    ("i64", "capacity", "C"),
    ("i64", "align", "expert segments start at multiples of align"),
    ("i64", "timeout_ns", "every wait gives up after this"),
    ("const u64*", "topk_idx", "int32 [N, K]             local input"),
    ("const u64*", "topk_w", "float [N, K]             local input"),
    ("const u64*", "routing", "int32 [R, N*K]           all-gather target"),
    ("const u64*", "x", "rows  [N, H]             dispatch source"),
    ("const u64*", "recv", "rows  [C, H]             expert side in"),
    ("const u64*", "y", "rows  [C, H]             expert side out"),
    ("const u64*", "slots", "rows  [N*K, H]           slot buffer (token side in)"),
    ("const u64*", "base", "float [N, H]             shared-expert output; zeros without one"),
    ("const u64*", "out", "float [N, H]"),
    ("const u64*", "recv_row", "int32 [N*K]              receive row of each slot on its expert owner"),
    ("const u64*", "sched", "int32 [El+1 | El | C | C] offsets, counts, src_rank, src_slot"),
    ("const u64*", "sched_scratch", "int32 [R*Q*El | El*R | 1] the schedule's segment counts, M, fits"),
    ("const u64*", "flags", "u64   [kNumFlagKinds, R]"),
    ("const u64*", "state", "u64   [kStateWords]      epoch, then last-block counters"),
    ("const u64*", "scale", "float [E]                stand-in expert: y = scale[e] * x"),
    ("ErrorRecord*", "error", "this process's error record"),
    # The emulated link (mok_proto/link.py; read only by kernels built with MOK_LINK)
    ("i64", "link_fs_per_byte", "femtoseconds per byte per direction; 0: no emulated link"),
    ("i64", "link_latency_ns", "one round trip: a pull waits one per batch of loads, a signal or a push's flush one"),
    ("i64", "link_every_row", "1: every row a rank moves pays (it stands for remote peers); 0: rows between two ranks"),
    ("const u64*", "link_clock", "u64   [2]                the link busy until (ns): into this rank, out of it"),
    # The ring (the layer's turns): the receive rows this launch moves, where they live
    ("i64", "ring_rows", "M: rows of the ring buffers recv, y; 0: no ring (they hold all C rows)"),
    ("i64", "ring_lo", "the turn's first receive row: rows [ring_lo, ring_lo + M) live in recv, y rows 0 .. M-1"),
    ("i64", "num_turns", "T = ceil(C / M): turns a pass runs (turn_segments writes each one's segments)"),
    ("const u64*", "turn_sched", "int32 [T, 2, El]         each turn's expert segments in the ring: offsets, counts"),
))

GEMM_PARAMS = Struct("GemmParams", (
    ("i64", "num_groups", "El"),
    ("i64", "m", "weight gradients: M (fixed); row problems: unused (M = T_e)"),
    ("i64", "n", "N of every expert's problem"),
    ("i64", "k", "row problems: K (fixed); weight gradients: unused (K = T_e)"),
    ("i64", "lda", "leading dimensions (elements)"),
    ("i64", "ldb", ""),
    ("i64", "ldo", ""),
    ("i64", "b_group_stride", "elements between experts' weights (row problems)"),
    ("i64", "o_group_stride", "elements between experts' outputs (weight gradients)"),
    ("i64", "k_split", "kGateUpBwd: k < k_split reads a1/b1, else a2/b2 at k - k_split"),
    ("i64", "timeout_ns", "every pipeline wait is bounded"),
    ("i64", "a1", "operand addresses (bf16)"),
    ("i64", "a2", ""),
    ("i64", "b1", ""),
    ("i64", "b2", ""),
    ("i64", "out1", "output addresses"),
    ("i64", "out2", ""),
    ("i64", "out3", ""),
    ("i64", "row_scale", "kDown: optional fp32 [rows] (0 = none)"),
    ("i64", "row_offsets", "int32 [El]"),
    ("i64", "row_counts", "int32 [El]"),
    ("ErrorRecord*", "error", "where a failed wait is reported"),
    ("i64", "tmap_a1", "CUtensorMap addresses (global memory), 128B swizzle"),
    ("i64", "tmap_a2", ""),
    ("i64", "tmap_b1", ""),
    ("i64", "tmap_b2", ""),
    ("i64", "tmap_aux1", "kDownBwd: g, u in boxes of 128 rows x 64 columns"),
    ("i64", "tmap_aux2", ""),
    ("i64", "accumulate", "weight gradients: 1 starts each tile from the stored output (a later turn's rows), 0 from 0"),
), namespace="mok::gemm")

# The grouped FP8 GEMMs (cuda/gemm_fp8.cuh): e4m3 codes with fp32 block scales (layouts:
# mok_proto/fp8.py), every operand K-major. The fields named as in GemmParams mean the same there
# (gemm.cuh's tile naming and epilogues read them).
FP8_GEMM_PARAMS = Struct("Fp8GemmParams", (
    ("i64", "num_groups", "El"),
    ("i64", "m", "weight gradients: M (fixed); row problems: unused (M = T_e)"),
    ("i64", "n", "N of every expert's problem"),
    ("i64", "k", "row problems: K (fixed, a multiple of 128); weight gradients: unused (K = T_e)"),
    ("i64", "ldo", "elements between output rows (bf16 or fp32); kGateUp: also the bytes between hq rows"),
    ("i64", "o_group_stride", "elements between experts' outputs (weight gradients)"),
    ("i64", "k_split", "kGateUpBwd: k < k_split reads a1/b1, else a2/b2 at k - k_split"),
    ("i64", "a_scale_stride", "floats between rows of A's scales: row problems K_a / 128, weight gradients rows / 128"),
    ("i64", "b_scale_stride", "floats between rows of B's scales: row problems K_b / 128 (128 x 128 blocks), "
                              "weight gradients rows / 128"),
    ("i64", "b_scale_group_stride", "row problems: floats between experts' B scales"),
    ("i64", "pow2", "kGateUp, kDownBwd: 1 quantizes h (dg, du) with power-of-two scales"),
    ("i64", "timeout_ns", "every pipeline wait is bounded"),
    ("i64", "scale_a1", "fp32 scales of the operands (row problems' A: [rows, K/128]; B: [E, N/128, K/128]; "
                        "weight gradients': [M or N, rows/128])"),
    ("i64", "scale_a2", ""),
    ("i64", "scale_b1", ""),
    ("i64", "scale_b2", ""),
    ("i64", "out1", "output addresses (bf16 rows, fp32 weight gradients)"),
    ("i64", "out2", ""),
    ("i64", "out3", ""),
    ("i64", "out_codes", "kGateUp: hq, e4m3 [rows, I] (h quantized 1 x 128); kDownBwd: dgq (0: none)"),
    ("i64", "out_scales", "kGateUp: hs, fp32 [rows, I / 128]; kDownBwd: dgs"),
    ("i64", "row_scale", "kDown: optional fp32 [rows] (0 = none)"),
    ("i64", "row_offsets", "int32 [El]; weight gradients: multiples of 128 (no scale block straddles two experts)"),
    ("i64", "row_counts", "int32 [El]"),
    ("ErrorRecord*", "error", "where a failed wait is reported"),
    ("i64", "tmap_a1", "CUtensorMap addresses: codes in boxes of 128 rows x 128 bytes, 128B swizzle"),
    ("i64", "tmap_a2", ""),
    ("i64", "tmap_b1", ""),
    ("i64", "tmap_b2", ""),
    ("i64", "tmap_aux1", "kDownBwd: g, u (bf16) in boxes of 128 rows x 64 columns"),
    ("i64", "tmap_aux2", ""),
    ("i64", "accumulate", "weight gradients: 1 starts each tile from the stored output (a later turn's rows), 0 from 0"),
    ("i64", "out_codes2", "kDownBwd: duq, e4m3 [rows, I] (du quantized 1 x 128; out_codes: dgq; 0: neither)"),
    ("i64", "out_scales2", "kDownBwd: dus, fp32 [rows, I / 128] (out_scales: dgs)"),
), namespace="mok::gemm_fp8")

TOKEN_PARAMS = Struct("TokenParams", (
    ("i64", "num_tokens", "N"),
    ("i64", "top_k", "K"),
    ("i64", "hidden", "H (a multiple of 8: rows move as 16-byte octets)"),
    ("i64", "rank_base", "EP rank of blockIdx.y == 0"),
    ("i64", "has_base", "1: add the shared expert's rows (base, dx_base); 0: there is none"),
    ("i64", "num_local_experts", "El (the expert owner of slot s is topk_idx[s] / El)"),
    ("const u64*", "topk_idx", "int32 [N, K]    expert of each slot"),
    ("const u64*", "topk_w", "float [N, K]    router weights"),
    ("const u64*", "recv_row", "int32 [N*K]     receive row of each slot on its expert owner (-1: none placed)"),
    ("const u64*", "base", "bf16  [N, H]    shared expert's output"),
    ("const u64*", "y_slots", "bf16  [N*K, H]  expert outputs in slot order (combine's slot buffer)"),
    ("const u64*", "out", "bf16  [N, H]    layer output"),
    ("const u64*", "dout", "bf16  [N, H]    output gradient"),
    ("const u64*", "dy_slots", "bf16  [N*K, H]  w[t,j] * dout[t]: what reverse-combine moves"),
    ("const u64*", "dx_slots", "bf16  [N*K, H]  input gradients in slot order (reverse-dispatch's slot buffer)"),
    ("const u64*", "dx_base", "bf16  [N, H]    shared expert's input gradient"),
    ("const u64*", "dx", "bf16  [N, H]    layer input gradient"),
    ("const u64*", "d_topk_w", "float [N, K]    router-weight gradient"),
    ("ErrorRecord*", "error", "this process's error record (the weighted sum reports slots without a result)"),
))

# A plan's tables as the megakernel reads them: Task[num_tasks] sorted by (block, seq), Counter[num_counters].
TASK = Struct("Task", (
    ("int", "block", "CTA that runs the task"),
    ("int", "seq", "position in that CTA's table"),
    ("TaskKind", "kind", ""),
    ("int", "minibatch", "-1 where none (shared expert, epilogue, weight gradients)"),
    ("int", "macrobatch", "weight-gradient tiles: the macrobatch they reduce (0 stores, > 0 adds); -1 elsewhere"),
    ("int", "row_tile", "receive-buffer row tile (routed), token row tile (shared, epilogue), weight row tile "
                        "(wgrad); comm tasks: the chunk of the minibatch"),
    ("int", "col_tile", "output column tile; comm tasks: the chunks of the minibatch's transfer (row_tile of "
                        "col_tile); -1 for epilogue tasks"),
    ("int", "expert", "local expert of a weight-gradient tile; -1 elsewhere (found on the device)"),
    ("int[2]", "wait_counter", "-1: no wait"),
    ("int[2]", "wait_target", "wait until counter >= target"),
    ("int[2]", "signal_counter", "-1: no signal; otherwise add 1 when done"),
), namespace="mok::plan")

COUNTER = Struct("Counter", (
    ("CounterKind", "kind", ""),
    ("int", "index", "minibatch, row tile, macrobatch or stage"),
    ("int", "target", "value once every signal arrived"),
    ("bool", "remote", "raised by the tasks of every rank"),
), namespace="mok::plan")

# The fused layer's launch (cuda/fused.cuh): one plan's tables, the round's CommParams, and the
# GEMM params of each launch rank (kFusedGemms per rank, in GemmSlot order).
FUSED_PARAMS = Struct("FusedParams", (
    ("i64", "comm_ctas", "CTAs 0 .. comm_ctas - 1 only communicate (the plan's comm_blocks; 0: none)"),
    ("i64", "num_tasks", "tasks of the plan (per rank: every rank runs the same plan)"),
    ("i64", "num_counters", "ready counters per rank"),
    ("i64", "first_remote", "counters first_remote .. num_counters - 1 are the remote ones (plan.Plan.first_remote_counter)"),
    ("i64", "claim_counter", "the CLAIMED counter (the clusters' ticket for the pool: tasks[task_begin[num_ctas] .. "
                             "num_tasks), pair k = tasks 2k, 2k + 1 of it); -1: no pool (plan.Plan.claim_counter)"),
    ("i64", "minibatch_rows", "receive rows per minibatch (a multiple of 2 kBM)"),
    ("i64", "ring_rows", "receive row r lives in row r % ring_rows of the row buffers"),
    ("i64", "record_trace", "1: write a TraceRecord per task into `trace` (the timeline); 0: none"),
    ("i64", "timeout_ns", "every counter wait gives up after this"),
    ("i64", "tasks", "Task [num_tasks], sorted by (block, seq)"),
    ("i64", "task_begin", "int32 [num_ctas + 1]: CTA b runs tasks[task_begin[b] .. task_begin[b + 1])"),
    ("i64", "comm", "const CommParams* of the round (rank = rank_base + blockIdx.y)"),
    ("i64", "gemm", "GemmParams [W][kFusedGemms]: each launch rank's GEMMs, GemmSlot order"),
    ("i64", "counters", "u32 [W][num_counters], zero before the launch"),
    ("i64", "counter_info", "Counter [num_counters]: the plan's counters (a remote one is kept as peer flags)"),
    ("i64", "token", "const TokenParams* of the launch ranks (the token-gradient tasks; 0 when the plan has none)"),
    ("i64", "trace", "TraceRecord [W][num_tasks] (record_trace)"),
    ("ErrorRecord*", "error", "this process's error record"),
    ("i64", "fp8_gemm", "Fp8GemmParams [W][kFusedGemms] (the FP8 kernels: their routed slots; 0 in a bf16 pass)"),
    ("i64", "quant", "QuantParams [W] (the FP8 kernels: each launch rank's rows the incoming transfer's movers "
                     "quantize, recv -> xq or recv_dy -> dyq; 0: that transfer runs outside the kernel, moves fp8 "
                     "rows, or the pass is bf16)"),
    ("i64", "dispatch_codes", "const CommParams* (fused_forward_fp8 with fp8 dispatch pulled inside: the token owners' "
                              "codes rows xq_tok -> xq; 0: none)"),
    ("i64", "dispatch_scales", "const CommParams* (with dispatch_codes: their scales rows xq_tok_s -> xq_s)"),
), namespace="mok::fused")

TRACE_RECORD = Struct("TraceRecord", (
    ("i64", "start_ns", "%globaltimer when the task began (before its waits)"),
    ("i64", "ready_ns", "when its waits were met"),
    ("i64", "end_ns", "when it signalled (a task that signals nothing: its lead thread's work done)"),
    ("int", "task", "index into the plan's task table; -1: not run"),
    ("int", "sm", "%smid"),
    ("int", "block", "blockIdx.x of the CTA that ran it (a claimed pair's: known only at run time)"),
), namespace="mok::fused")

# The standalone quantizers (cuda/fp8.cuh; layouts: mok_proto/fp8.py). Row-major arrays; x is
# [batch, rows, cols] (quantize_rows: batch 1). The segment quantizers read only the rows of expert
# segments (the GPU layer's receive rows, offsets and counts on the device).
QUANT_PARAMS = Struct("QuantParams", (
    ("i64", "batch", "matrices (quantize_blocks: experts); 1 for quantize_rows"),
    ("i64", "rows", "rows of each matrix"),
    ("i64", "cols", "columns (the contiguous dimension)"),
    ("i64", "pow2", "1: power-of-two scales; 0: amax / kE4m3Max"),
    ("i64", "x", "input, fp32 or bf16 bits [batch, rows, cols]"),
    ("i64", "codes", "uint8: [batch, rows, cols]; quantize_rows<transposed>: [cols, rows]"),
    ("i64", "scales", "fp32: rows [rows, cols / B] (transposed: [cols, rows / B]); blocks [batch, rows / B, cols / B]"),
    ("i64", "codes_t", "quantize_blocks: uint8 [batch, cols, rows], the transposed codes; 0: none"),
    ("i64", "scales_t", "quantize_blocks: fp32 [batch, cols / B, rows / B], the transposed scales; 0: none"),
    ("i64", "x_scales", "segment quantizers with e4m3 input: fp32 [rows, cols / B], x's 1 x B scales; 0: none"),
    ("i64", "num_groups", "segment quantizers: expert segments (El)"),
    ("i64", "row_offsets", "segment quantizers: int32 [num_groups], each segment's first row (a multiple of B)"),
    ("i64", "row_counts", "segment quantizers: int32 [num_groups], each segment's rows"),
    ("i64", "x_map", "the segment column quantizer: x's CUtensorMap (global memory) as [rows, cols], boxes of "
                     "B rows x kQuantColumnItemBytes bytes, 128B swizzle (the other quantizers: unused)"),
    ("i64", "error", "the segment column quantizer: ErrorRecord* its bounded waits report into; a launch given a "
                     "record that holds an error quantizes nothing (the other quantizers: unused)"),
    ("i64", "timeout_ns", "the segment column quantizer: the bound of each wait for a staged item"),
    ("i64", "out", "dequantize_segment_rows: bf16 [rows, cols], the dequantized rows (the others: unused)"),
), namespace="mok::fp8")

STRUCTS = (ERROR_RECORD, COMM_PARAMS, GEMM_PARAMS, FP8_GEMM_PARAMS, TOKEN_PARAMS, TASK, COUNTER, FUSED_PARAMS,
           TRACE_RECORD, QUANT_PARAMS)


# ---------------------------------------------------------------------------------------------
# The generated header
# ---------------------------------------------------------------------------------------------
def _in_namespaces(items, render) -> list:
    lines, current = [], None
    for item in items:
        if item.namespace != current:
            if current is not None:
                lines.append(f"}}  // namespace {current}")
                lines.append("")
            lines.append(f"namespace {item.namespace} {{")
            current = item.namespace
        lines += render(item)
    if current is not None:
        lines.append(f"}}  // namespace {current}")
    return lines


def _enum_lines(e: Enum) -> list:
    members = [f"{name} = {value}" for value, (name, text) in enumerate(e.members)]
    if e.count:
        members.append(f"{e.count} = {len(e.members)}")
    texts = [f"//   {name}: {text}" for name, text in e.members]
    return [f"// {e.name}, as errors print it:", *texts, f"enum {e.name} : int {{ {', '.join(members)} }};"]


def _struct_lines(s: Struct) -> list:
    width = max(len(t.partition("[")[0]) for t, _, _ in s.fields) + 1
    body = []
    for t, n, c in s.fields:
        base, bracket, count = t.partition("[")  # "int[2]" -> int name[2];
        body.append(f"  {base.ljust(width)}{n}{bracket}{count};" + (f"  // {c}" if c else ""))
    checks = [f"static_assert(sizeof({s.name}) == {s.nbytes}, \"{s.name}: size differs from mok_proto/abi.py\");"]
    # One line per struct (tests/test_abi.py names the field that differs). NVRTC has no offsetof
    # builtin: nvcc checks the offsets (the CPU compile tests), NVRTC the sizes.
    offsets = " && ".join(f"__builtin_offsetof({s.name}, {n}) == {s.offset(n)}" for n in s.names)
    checks.append(f"static_assert({offsets}, \"{s.name}: field offsets differ from mok_proto/abi.py\");")
    return [f"struct {s.name} {{", *body, "};", checks[0], "#ifndef __CUDACC_RTC__", checks[1], "#endif", ""]


def render_header() -> str:
    """The text of cuda/abi.cuh."""
    lines = [
        "// GENERATED by `python -m mok_proto.abi` from mok_proto/abi.py: do not edit by hand.",
        "// tests/test_abi.py regenerates it and fails on any difference.",
        "// Every struct, enum and constant that Python and CUDA share; sizes and offsets asserted.",
        "#pragma once",
        "",
        "namespace mok {",
        "typedef long long i64;",
        "typedef unsigned long long u64;",
        "typedef unsigned int u32;",
        "}  // namespace mok",
        "",
    ]
    lines += _in_namespaces(ENUMS, _enum_lines)
    lines.append("")
    lines += _in_namespaces(CONSTS, lambda c: [f"constexpr int {c.name} = {c.value};  // {c.comment}"])
    lines.append("")
    lines += _in_namespaces(STRUCTS, _struct_lines)
    return "\n".join(lines).rstrip() + "\n"


def header_path():
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "cuda" / HEADER


def write_header() -> bool:
    """Rewrite cuda/abi.cuh if it differs; True if it changed."""
    path, text = header_path(), render_header()
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    return True


if __name__ == "__main__":
    print(f"{header_path()}: {'rewritten' if write_header() else 'up to date'}")
