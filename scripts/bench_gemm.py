"""python scripts/bench_gemm.py [--shapes kimi-k2.7,...] [--problems down_wgrad,...] [--iters 20]

Our grouped expert GEMMs against torch._grouped_mm and a dense cuBLAS GEMM, on one GPU
(mok_proto.bench.gemm_problems).

The per-rank load of EP=64: 2048 tokens x K choices spread over E/64 local experts, uniform
(equal rows per expert) or skewed (rows proportional to 1/(e+1)). For each problem, in one run:
our kernel, torch._grouped_mm on the same operands (the GEMM only: it gets no fused epilogue, so
the ratio is conservative for gate_up and down_bwd), and one dense torch.mm of the same FLOPs as
the ceiling. One CUDA event pair per iteration after an L2 flush and a GPU sleep that hides host
launch cost; median (p20, p80). Every timed kernel's output is also checked against
torch._grouped_mm's (plus the fused elementwise step in float32): column `err`, max |ours - ref| /
max |ref|, must stay below gemm_problems.ERR_TOL.
Bars (--bar KEY=VALUE; --help lists them with their defaults): each problem's TFLOP/s x
torch._grouped_mm's.
Exit status: 0 when every row meets its bar and its output check, 1 otherwise (the failed rows are
listed), 2 on a machine without a GPU, CuPy or torch (one line says which).
Results: JSON lines appended to results/bench_gemm.jsonl.
"""

from __future__ import annotations

import sys

from mok_proto.bench import append_result, require_gpu
from mok_proto.bench.cli import Bar, add_bar_option, parse_bars, parser
from mok_proto.bench.gemm_problems import ERR_TOL, PROBLEMS, make_operands, problems, reference_errors, timed
from mok_proto.config import PAPER_SHAPES, get_shape

BARS = {f"{name}_x_torch": Bar(value, f"{name}: ours x torch._grouped_mm, TFLOP/s") for name, value in
        zip(PROBLEMS, (0.9, 0.9, 0.85, 0.85, 0.8, 0.8))}


def main():
    p = parser(__doc__)
    p.add_argument("--shapes", default=",".join(PAPER_SHAPES))
    p.add_argument("--ep", type=int, default=64)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--routing", default="uniform,skewed")
    p.add_argument("--problems", default=",".join(PROBLEMS), help="a subset of " + ",".join(PROBLEMS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    add_bar_option(p, BARS)
    args = p.parse_args()
    wanted = list(dict.fromkeys(name for name in args.problems.split(",") if name))  # in order, once each
    unknown = [name for name in wanted if name not in PROBLEMS]
    if unknown or not wanted:
        said = f"unknown problem(s) {','.join(unknown)}" if unknown else "--problems names no problem"
        p.error(f"{said}; choose from {','.join(PROBLEMS)}")
    try:
        bars = parse_bars(args.bar, BARS)
    except ValueError as e:
        p.error(str(e))
    require_gpu("bench_gemm.py", need_torch=True)
    import torch

    from mok_proto.kernels import gemm

    from mok_proto.bench.ceilings import DENSE_N, dense_matmul_tflops, of_dense

    dense_ceiling = dense_matmul_tflops()
    print(f"# bench_gemm on {torch.cuda.get_device_name()}: EP={args.ep}, {args.tokens} tokens/rank, bf16, "
          f"TFLOP/s median over {args.iters} (ratio = ours / torch._grouped_mm); of dense = ours / a dense "
          f"{DENSE_N}^3 torch.matmul ({dense_ceiling:.0f} TFLOP/s)")
    print(f"{'shape':<16}{'routing':<8}{'problem':<14}{'ours':>8}{'grouped':>9}{'dense':>8}{'ratio':>7}{'bar':>6}"
          f"{'of dense':>9}{'err':>9}  ok")
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.float32, device="cuda")
    failed = []  # rows that miss their bar or whose output is wrong
    for shape_name in args.shapes.split(","):
        ops = make_operands(get_shape(shape_name), args.ep, args.tokens)
        num_experts, rows = ops.num_experts, ops.rows
        for routing in args.routing.split(","):
            table, offs, err = problems(ops, routing)
            for name in wanted:
                ours, make_torch, (da, db), flops = table[name]
                t_ours = timed(ours, args.iters, args.warmup, flush)
                t_torch = timed(make_torch(), args.iters, args.warmup, flush)
                t_dense = timed(lambda: torch.mm(da, db), args.iters, args.warmup, flush)
                err.check()
                error = reference_errors(name, ops, offs)
                tf = {k: flops / (t["median_ms"] * 1e-3) / 1e12 for k, t in
                      (("ours", t_ours), ("torch", t_torch), ("dense", t_dense))}
                ratio, bar = tf["ours"] / tf["torch"], bars[f"{name}_x_torch"].value
                correct = error <= ERR_TOL
                ok = bars[f"{name}_x_torch"].met(ratio) and correct
                if not ok:
                    failed.append(f"{shape_name} {routing} {name}: " + (f"ratio {ratio:.2f} < bar {bar}"
                                  if correct else f"max rel err {error:.1e} > {ERR_TOL:.1e}"))
                print(f"{shape_name:<16}{routing:<8}{name:<14}{tf['ours']:>8.0f}{tf['torch']:>9.0f}{tf['dense']:>8.0f}"
                      f"{ratio:>7.2f}{bar:>6.2f}{tf['ours'] / dense_ceiling:>9.2f}{error:>9.1e}  "
                      f"{'yes' if ok else ('NO' if correct else 'WRONG')}", flush=True)
                append_result("bench_gemm", of_dense({
                    "shape": shape_name, "ep": args.ep, "routing": routing, "problem": name,
                    "experts": int(num_experts), "rows": int(rows), "flops": int(flops), "ours": t_ours,
                    "torch_grouped_mm": t_torch, "dense": t_dense, "tflops": tf, "ratio": ratio, "bar": bar,
                    "max_rel_err": error}, tf["ours"], dense_ceiling))
    kernel = gemm.MODULE.function(f"mok::gemm::grouped_gemm<{gemm.PROBLEMS.index('down')}>")
    print(f"# grid: {gemm.resident_clusters(kernel)} clusters of {gemm.CLUSTER} CTAs")
    if failed:
        print(f"FAIL: {len(failed)} rows miss their bar or are wrong:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    print("all bars met, all outputs match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
