"""Where a kernel's warps wait, from Nsight Compute's source page: the SASS instructions grouped
into regions, each region's share of the warp-state samples and its leading stall reasons.

    ncu --section SourceCounters ... -o rep python3 scripts/bench_gemm.py ...     (on the GPU)
    ncu -i rep.ncu-rep --page source --csv --print-source sass > source.csv
    python -m mok_proto.bench.ncu_source source.csv [--kernel grouped_gemm] [--by-count] [--top 12]

Regions: runs of consecutive instructions executed equally often (basic blocks, loop bodies), or
with --by-count every instruction executed a given number of times wherever it sits (the code run
once a tile, say: an epilogue spread over many blocks). `no_inst` (the warp waits for its next
instruction to be fetched) leading a region says its code does not stay in the instruction cache.
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Kernel:
    name: str
    rows: list  # [{column: text}], one SASS instruction each, in address order


@dataclass
class Region:
    first: str  # address of its first instruction
    executed: int  # times each of its instructions ran (summed over warps)
    instructions: int = 0
    samples: int = 0
    stalls: Counter = field(default_factory=Counter)


def load(path) -> list[Kernel]:
    """The kernels of a `--page source --csv --print-source sass` export, each once (ncu may print
    a kernel's listing twice in a row). ValueError where a listing lacks a column the report needs."""
    kernels, header, current = [], None, None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                current = Kernel(row[1], [])
                kernels.append(current)
            elif row[0] == "Address":
                header = row
                missing = [c for c in ("Source", SAMPLES, EXECUTED) if c not in header]
                if missing:
                    raise ValueError(f"{path}: no {', '.join(missing)} column (profile with --section SourceCounters; "
                                     "export with --page source --csv --print-source sass)")
            elif current is not None and header is not None:
                current.rows.append(dict(zip(header, row)))
    unique = []
    for k in kernels:
        if not (unique and unique[-1].name == k.name and unique[-1].rows == k.rows):
            unique.append(k)
    return unique


def _int(text: str) -> int:
    """A count as ncu prints it ("1,234"); 0 for an empty or non-numeric cell ("n/a")."""
    try:
        return int(float(text.replace(",", "")))
    except (AttributeError, ValueError):
        return 0


def regions(kernel: Kernel, by_count: bool = False) -> list[Region]:
    """The kernel's regions (module docstring), in address order (by_count: by first address)."""
    out: dict = {}
    run, previous = -1, None
    for row in kernel.rows:
        executed = _int(row.get(EXECUTED, ""))
        if executed != previous:
            run, previous = run + 1, executed
        region = out.setdefault(executed if by_count else run, Region(row["Address"], executed))
        region.instructions += 1
        region.samples += _int(row.get(SAMPLES, ""))
        for column, text in row.items():
            if column.startswith("stall_") and "Not Issued" not in column:
                region.stalls[column[len("stall_"):]] += _int(text)
    return list(out.values())


def report(kernel: Kernel, by_count: bool = False, top: int = 12, label: str = "") -> str:
    """The kernel's total samples, its leading stalls, and the `top` regions by samples."""
    found = regions(kernel, by_count)
    total = sum(r.samples for r in found) or 1
    stalls = sum((r.stalls for r in found), Counter())
    lines = [f"{label}{kernel.name}: {len(kernel.rows)} instructions, {total} samples; stalls "
             + ", ".join(f"{k} {v / total:.0%}" for k, v in stalls.most_common(5))]
    lines.append(f"{'first':>16} {'instr':>6} {'executed':>10} {'samples':>8} {'share':>6}  leading stalls")
    for r in sorted(found, key=lambda r: -r.samples)[:top]:
        # (samples may carry no stall reason: their rest is shown as such)
        shares = r.stalls + Counter({"no reason": r.samples - sum(r.stalls.values())})
        lead = ", ".join(f"{k} {v / max(r.samples, 1):.0%}" for k, v in shares.most_common(3) if v > 0)
        lines.append(f"{r.first:>16} {r.instructions:>6} {r.executed:>10} {r.samples:>8} {r.samples / total:>6.1%}  {lead}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mok_proto.bench.ncu_source", description=__doc__.split("\n\n")[0])
    p.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass > this file")
    p.add_argument("--kernel", default="", help="only kernels whose name contains this")
    p.add_argument("--by-count", action="store_true", help="group instructions by how often they ran")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    try:
        kernels = [(i, k) for i, k in enumerate(load(args.csv), 1) if args.kernel in k.name]
    except (OSError, ValueError) as e:
        p.error(str(e))
    if not kernels:
        p.error(f"no kernel in {args.csv}" + (f" whose name contains {args.kernel!r}" if args.kernel else ""))
    print("\n\n".join(report(k, args.by_count, args.top, f"[{i}] ") for i, k in kernels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
