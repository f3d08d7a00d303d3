"""The GPU layer's memory per rank, stated: every buffer (from the layout the layer allocates,
mok_proto.layer.layout), its role, the totals, and the formula. No GPU needed.

    python -m mok_proto.memory --shape kimi-k2.7 --ep 64 [--macrobatch-rows M] [--capacity C] [--free-gb G]
                               [--precision fp8 [--dispatch-dtype fp8] [--wgrad-precision bf16]]

Legend: N tokens/rank, H hidden, I expert FFN, Is shared FFN (0 without a shared expert), K top-k,
R ranks, El = E/R local experts, C logical receive capacity (rows of the schedule's index space:
4-byte indices), M ring rows (macrobatch_rows: the receive-row buffers, 4H + 5I bf16 values a
row; precision fp8 adds 2H + 3I e4m3 codes a row and their fp32 scales, one per 128, and with fp8
dispatch drops the bf16 x rows, unless bf16 weight gradients read them). GB = 1e9 bytes.

Counted: every symmetric buffer of a rank (layout.layer_layout) and the layer's private error
record. Left out: the CUDA context and NVSHMEM's own reserve (the free memory is what is left of
them), the allocator's alignment, the launch parameter structs and GEMM descriptors (a few KB),
and a fused plan's device tables (kernels.fused.FusedPass: per task its table entry and timeline
record, 96 bytes, per counter 20 bytes; a plan's tasks grow with its capacity rows).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

from mok_proto import abi
from mok_proto.config import PRESETS, MoEShape, RunConfig, get_shape
from mok_proto.kernels.comm import SCHEDULE_SEGMENT
from mok_proto.layer.layout import ROLES, layer_layout, nbytes, role_of, whole_ring
from mok_proto.plan import SEGMENT_ROWS
from mok_proto.schedule import max_receive_slots
from mok_proto.validate import check_int

GB = 1e9
# What a process finds free on an 80 GB H100 (81,559 MiB on the card, less the CUDA context and
# NVSHMEM's own allocations). On a GPU pass cupy.cuda.runtime.memGetInfo()[0] instead.
H100_FREE_BYTES = 78 * 2**30
DEFAULT_FRACTION = 0.9  # of the free memory the layer may take (the rest: the allocator's slack, other work)
PRIVATE = {"error": ((abi.ERROR_RECORD.nbytes // 8,), np.uint64)}  # kernels.errors.ErrorRecord, one per process


@dataclass(frozen=True)
class Buffer:
    """One buffer of one rank."""

    name: str
    shape: tuple
    dtype: str
    bytes: int
    symmetric: bool  # on the symmetric heap (peers reach it), else private to the rank's process
    role: str  # layout.ROLES: index, ring, token, weights, gradients, control


@dataclass(frozen=True)
class LayerMemory:
    """One rank's memory for a layer of `shape` on `num_ranks` ranks with a logical capacity of
    `capacity` rows and a ring of `macrobatch_rows` rows."""

    shape: MoEShape
    num_ranks: int
    capacity: int
    macrobatch_rows: int
    buffers: tuple
    precision: str = "bf16"  # RunConfig.precision: fp8 adds the routed experts' codes and scales
    dispatch_dtype: str = "bf16"  # RunConfig.dispatch_dtype
    wgrad_precision: str | None = None  # RunConfig.wgrad_precision

    @property
    def total_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers)

    @property
    def symmetric_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers if b.symmetric)

    @property
    def private_bytes(self) -> int:
        return self.total_bytes - self.symmetric_bytes

    def by_role(self) -> dict:
        """{role: bytes} in ROLES order."""
        return {role: sum(b.bytes for b in self.buffers if b.role == role) for role in ROLES}

    def symbols(self) -> dict:
        """The formula's symbols for this layer."""
        s = self.shape
        return {"N": s.num_tokens, "H": s.hidden, "I": s.ffn, "Is": s.shared_ffn_size if s.num_shared else 0,
                "K": s.top_k, "R": self.num_ranks, "El": s.num_experts // self.num_ranks, "C": self.capacity,
                "M": self.macrobatch_rows}

    def terms(self) -> tuple:
        """The formula's terms for this layer's precision (formula_terms)."""
        return formula_terms(self.precision, self.dispatch_dtype, self.wgrad_precision)

    def formula_bytes(self) -> dict:
        """{role: bytes} by the formula (formula_terms), evaluated for this layer."""
        return {role: term(self.symbols()) for role, _, term in self.terms()}

    def formula(self) -> str:
        """The bytes per rank as a formula in N, H, I, Is, K, R, El, C, M, one line a role with its
        value for this layer, and the total."""
        values, terms = self.formula_bytes(), self.terms()
        width = max(len(text) for _, text, _ in terms)
        head = " ".join(f"{k}={v}" for k, v in self.symbols().items())
        lines = [f"bytes per rank ({head}{'' if self.precision == 'bf16' else ', ' + self._precision_text()}):"]
        lines += [f"  {role:<9} {text:<{width}}  {values[role] / GB:9.3f} GB" for role, text, _ in terms]
        lines.append(f"  {'total':<9} {'':<{width}}  {sum(values.values()) / GB:9.3f} GB")
        lines.append(f"  (control: F = {len(abi.FLAG_KIND)} flag kinds, W = {abi.CONST['kStateWords']} state words, "
                     f"{abi.ERROR_RECORD.nbytes} B of error record, private)")
        return "\n".join(lines)

    def _precision_text(self) -> str:
        wgrad = "" if self.wgrad_precision is None else f", weight gradients {self.wgrad_precision}"
        return f"precision {self.precision}, dispatch {self.dispatch_dtype}{wgrad}"

    def table(self) -> str:
        """Every buffer (name, shape, dtype, MB, symmetric or private, role), by role, then the totals."""
        rows = sorted(self.buffers, key=lambda b: ROLES.index(b.role))
        lines = [f"{'buffer':<14} {'shape':<22} {'dtype':<8} {'MB':>12}  {'where':<9} role"]
        lines += [f"{b.name:<14} {str(list(b.shape)):<22} {b.dtype:<8} {b.bytes / 1e6:12.3f}  "
                  f"{'symmetric' if b.symmetric else 'private':<9} {b.role}" for b in rows]
        lines.append("by role: " + ", ".join(f"{role} {v / GB:.3f} GB" for role, v in self.by_role().items()))
        lines.append(f"total {self.total_bytes / GB:.3f} GB per rank (symmetric {self.symmetric_bytes / GB:.3f}, "
                     f"private {self.private_bytes} B)")
        return "\n".join(lines)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The formula, one term a role: (role, text, bytes as a function of the symbols). Tests hold it equal
# to the sum over the layout's buffers. FORMULA is bf16's; formula_terms adds precision fp8's.
FORMULA = (
    ("ring", "2 M (4H + 5I)", lambda s: 2 * s["M"] * (4 * s["H"] + 5 * s["I"])),
    ("index", "4 (2C + 2El + 1) + 8 T El (T = ceil(C/M) turns, when T > 1)",
     lambda s: 4 * (2 * s["C"] + 2 * s["El"] + 1) + (8 * _cdiv(s["C"], s["M"]) * s["El"] if s["C"] > s["M"] else 0)),
    ("token", f"2NH (6 + 3K) + 10 N Is + 4NK (4 + R) + 4 (R El ceil(NK/{SCHEDULE_SEGMENT}) + R El + 1)",
     lambda s: (2 * s["N"] * s["H"] * (6 + 3 * s["K"]) + 10 * s["N"] * s["Is"] + 4 * s["N"] * s["K"] * (4 + s["R"])
                + 4 * (s["R"] * s["El"] * _cdiv(s["N"] * s["K"], SCHEDULE_SEGMENT) + s["R"] * s["El"] + 1))),
    ("weights", "2 x 3 (El H I + H Is)", lambda s: 6 * (s["El"] * s["H"] * s["I"] + s["H"] * s["Is"])),
    ("gradients", "4 x 3 (El H I + H Is)", lambda s: 12 * (s["El"] * s["H"] * s["I"] + s["H"] * s["Is"])),
    ("control", "8 (F R + W) + 16 + error record",
     lambda s: 8 * (len(abi.FLAG_KIND) * s["R"] + abi.CONST["kStateWords"]) + 16 + abi.ERROR_RECORD.nbytes),
)


# precision fp8 (layout.fp8_row_layout): codes and scales of x, h, dy, dg, du a ring row (33/32 bytes
# a value: a 4-byte scale per 128), the weights' codes in both orientations (and a scale per 128 x 128),
# with fp8 dispatch the token owner's x codes and scales, and no bf16 x rows in the ring (unless bf16
# weight gradients read x from them).
FP8_TERMS = {
    "ring": ("33 M (2H + 3I) / 32", lambda s: 33 * s["M"] * (2 * s["H"] + 3 * s["I"]) // 32),
    "weights": ("6 El H I (1 + 1/4096)", lambda s: 6 * s["El"] * s["H"] * s["I"] * 4097 // 4096),
}
FP8_DISPATCH_TERMS = {"token": ("33 NH / 32", lambda s: 33 * s["N"] * s["H"] // 32)}
NO_RECV_TERMS = {"ring": ("- 2MH", lambda s: -2 * s["M"] * s["H"])}


def formula_terms(precision: str = "bf16", dispatch_dtype: str = "bf16", wgrad_precision: str | None = None) -> tuple:
    """FORMULA with precision fp8's terms added to their roles (and fp8 dispatch's: without `recv`
    where the weight gradients are fp8 too, layout.layer_row_layout)."""
    extra = []
    if precision == "fp8":
        fp8_dispatch = dispatch_dtype == "fp8"
        extra = ([FP8_TERMS] + [FP8_DISPATCH_TERMS] * fp8_dispatch
                 + [NO_RECV_TERMS] * (fp8_dispatch and (wgrad_precision or precision) == "fp8"))
    terms = []
    for role, text, term in FORMULA:
        for more in extra:
            if role in more:
                text, term = _plus(text, term, *more[role])
        terms.append((role, text, term))
    return tuple(terms)


def _plus(text, term, more_text, more_term):
    joined = f"{text} {more_text}" if more_text.startswith("-") else f"{text} + {more_text}"
    return joined, lambda s: term(s) + more_term(s)


def worst_capacity(shape: MoEShape, num_ranks: int) -> int:
    """The worst-case logical capacity: every rank's N K slots on this rank, each of its El
    experts' segments padded to SEGMENT_ROWS (schedule.max_receive_slots)."""
    return max_receive_slots(shape.num_tokens, shape.top_k, num_ranks, shape.num_experts // num_ranks, SEGMENT_ROWS)


def _buffers(shape: MoEShape, num_ranks: int, capacity: int, macrobatch_rows: int, precision: str = "bf16",
             dispatch_dtype: str = "bf16", wgrad_precision: str | None = None) -> tuple:
    run = RunConfig(shape, num_ranks, precision=precision, dispatch_dtype=dispatch_dtype,
                    wgrad_precision=wgrad_precision)
    out = [Buffer(name, tuple(shp), np.dtype(dt).name, nbytes(shp, dt), True, role_of(name))
           for name, (shp, dt) in layer_layout(run, capacity, macrobatch_rows).items()]
    out += [Buffer(name, shp, np.dtype(dt).name, nbytes(shp, dt), False, "control")
            for name, (shp, dt) in PRIVATE.items()]
    return tuple(out)


def _bytes(shape: MoEShape, num_ranks: int, capacity: int, macrobatch_rows: int, **precision) -> int:
    return sum(b.bytes for b in _buffers(shape, num_ranks, capacity, macrobatch_rows, **precision))


def _kinds(shape: MoEShape, num_ranks: int, precision: str, dispatch_dtype: str,
           wgrad_precision: str | None = None) -> dict:
    """{precision, dispatch_dtype, wgrad_precision} checked (RunConfig's rules; fp8: H, I multiples of 128)."""
    kinds = dict(precision=precision, dispatch_dtype=dispatch_dtype, wgrad_precision=wgrad_precision)
    RunConfig(shape, num_ranks, **kinds)
    if precision == "fp8":
        from mok_proto.reference_fp8 import check_fp8_shape

        check_fp8_shape(shape.hidden, shape.ffn, None)
    return kinds


def kinds_of(run: RunConfig) -> dict:
    """A RunConfig's fields that size its buffers (the keyword arguments of layer_memory and co.)."""
    return dict(precision=run.precision, dispatch_dtype=run.dispatch_dtype, wgrad_precision=run.wgrad_precision)


def _capacity(shape: MoEShape, num_ranks: int, capacity) -> int:
    RunConfig(shape, num_ranks)  # R must divide E
    worst = worst_capacity(shape, num_ranks)
    if capacity is None:
        return worst
    capacity = check_int(capacity, "capacity", minimum=1)
    if capacity > worst:
        raise ValueError(f"capacity must be in [1, {worst}] rows (the worst case), got {capacity}")
    return capacity


def default_macrobatch_rows(shape: MoEShape, num_ranks: int, free_bytes: int | None = None,
                            fraction: float = DEFAULT_FRACTION, capacity: int | None = None, precision: str = "bf16",
                            dispatch_dtype: str = "bf16", wgrad_precision: str | None = None) -> int:
    """The default ring: the largest multiple of SEGMENT_ROWS, at most the capacity rounded up to
    one, for which the whole layer (weights, gradients, ring, indices, token buffers) fits in
    fraction x free_bytes (default H100_FREE_BYTES). capacity: the logical capacity (default the
    worst case); precision, dispatch_dtype, wgrad_precision: RunConfig's (fp8 has more bytes a row).
    ValueError, naming the shortfall, when even one segment does not fit."""
    kinds = _kinds(shape, num_ranks, precision, dispatch_dtype, wgrad_precision)
    capacity = _capacity(shape, num_ranks, capacity)
    free_bytes = H100_FREE_BYTES if free_bytes is None else free_bytes
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if not free_bytes > 0:
        raise ValueError(f"free_bytes must be > 0, got {free_bytes}")
    budget = fraction * free_bytes
    # The ring's bytes a row, and the rest with the most turn segments any ring of whole segments has.
    per_row = sum(b.bytes for b in _buffers(shape, num_ranks, capacity, 1, **kinds) if b.role == "ring")
    fixed = (_bytes(shape, num_ranks, capacity, capacity, **kinds) - per_row * capacity
             + 8 * _cdiv(capacity, SEGMENT_ROWS) * (shape.num_experts // num_ranks))
    fits = math.floor((budget - fixed) / per_row) // SEGMENT_ROWS * SEGMENT_ROWS
    if fits < SEGMENT_ROWS:
        need = fixed + SEGMENT_ROWS * per_row
        raise ValueError(f"{shape.name} at R={num_ranks}: the layer needs {need / GB:.2f} GB per rank with a ring of "
                         f"one segment ({SEGMENT_ROWS} rows), {fraction:g} x {free_bytes / GB:.2f} GB free holds "
                         f"{budget / GB:.2f} GB: short by {(need - budget) / GB:.2f} GB")
    return min(fits, whole_ring(capacity))


def layer_memory(shape: MoEShape, num_ranks: int, capacity: int | None = None,
                 macrobatch_rows: int | None = None, precision: str = "bf16",
                 dispatch_dtype: str = "bf16", wgrad_precision: str | None = None) -> LayerMemory:
    """One rank's memory (LayerMemory: its buffers, totals, formula()) for a layer of `shape` on
    `num_ranks` ranks. capacity: the logical capacity (default the worst case, worst_capacity);
    macrobatch_rows: the ring's rows, a multiple of SEGMENT_ROWS up to the capacity rounded up to
    one, or the capacity itself (a ring that holds exactly every row); default
    default_macrobatch_rows on an 80 GB H100. precision, dispatch_dtype, wgrad_precision: RunConfig's."""
    kinds = _kinds(shape, num_ranks, precision, dispatch_dtype, wgrad_precision)
    capacity = _capacity(shape, num_ranks, capacity)
    if macrobatch_rows is None:
        macrobatch_rows = default_macrobatch_rows(shape, num_ranks, capacity=capacity, **kinds)
    top = whole_ring(capacity)
    m = check_int(macrobatch_rows, "macrobatch_rows", minimum=1)
    if m != capacity and (m % SEGMENT_ROWS or m > top):
        raise ValueError(f"macrobatch_rows must be a multiple of {SEGMENT_ROWS} (plan.SEGMENT_ROWS) up to {top} "
                         f"(the capacity {capacity} rounded up), or the capacity itself; got {m}")
    return LayerMemory(shape, num_ranks, capacity, m, _buffers(shape, num_ranks, capacity, m, **kinds), **kinds)


def _parser():
    from mok_proto.bench.cli import parser

    p = parser(__doc__)
    p.prog = "python -m mok_proto.memory"
    p.add_argument("--shape", default="kimi-k2.7", choices=list(PRESETS), help="the layer's shape")
    p.add_argument("--ep", type=int, default=64, help="ranks R, dividing the shape's experts")
    p.add_argument("--capacity", type=int, default=None, help="logical capacity C (default: the worst case)")
    p.add_argument("--macrobatch-rows", type=int, default=None,
                   help=f"ring rows M, a multiple of {SEGMENT_ROWS} (default: the largest that fits "
                        f"{DEFAULT_FRACTION:g} x --free-gb)")
    p.add_argument("--free-gb", type=float, default=H100_FREE_BYTES / GB,
                   help="free GPU memory, GB (an 80 GB H100's)")
    p.add_argument("--precision", default="bf16", help="the routed experts': bf16 or fp8")
    p.add_argument("--dispatch-dtype", default="bf16", help="with --precision fp8: what the dispatch moves, bf16 or fp8")
    p.add_argument("--wgrad-precision", default=None, help="with --precision fp8: the routed weight gradients', "
                   "fp8 (default) or bf16")
    return p


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    try:
        shape = get_shape(args.shape)
        if args.free_gb <= 0:
            raise ValueError(f"--free-gb must be > 0, got {args.free_gb}")
        kinds = _kinds(shape, args.ep, args.precision, args.dispatch_dtype, args.wgrad_precision)
        capacity = _capacity(shape, args.ep, args.capacity)
        m = args.macrobatch_rows
        if m is None:
            m = default_macrobatch_rows(shape, args.ep, args.free_gb * GB, capacity=capacity, **kinds)
        mem = layer_memory(shape, args.ep, capacity, m, **kinds)
    except ValueError as e:
        p.error(str(e))
    worst = worst_capacity(shape, args.ep)
    print(f"# {shape.describe()} R={args.ep}: capacity C={mem.capacity} rows (worst case {worst}), ring "
          f"M={mem.macrobatch_rows} rows ({_cdiv(mem.capacity, mem.macrobatch_rows)} turns a pass); "
          f"free {args.free_gb:.2f} GB")
    print(mem.table())
    print(mem.formula())
    fits = mem.total_bytes <= DEFAULT_FRACTION * args.free_gb * GB
    print(f"{'fits' if fits else 'does NOT fit'} in {DEFAULT_FRACTION:g} x {args.free_gb:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
