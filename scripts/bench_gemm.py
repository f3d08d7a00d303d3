"""python scripts/bench_gemm.py [--precision bf16|fp8] [--shapes kimi-k2.7,...] [--problems down_wgrad,...] [--iters 20]

Our grouped expert GEMMs against torch._grouped_mm and a dense cuBLAS GEMM, on one GPU
(mok_proto.bench.gemm_problems); with --precision fp8, our FP8 GEMMs against our BF16 ones and
torch._scaled_grouped_mm (below).

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
--epilogue-share: our GEMM (FP8: our FP8 GEMM, in the interleaved runs) timed again, built without
its epilogue (cuda/gemm.cuh kEpilogue: the tiles run their k-loops, store nothing); column `epi` and row
field `epilogue_share`: the share of our time the epilogue adds, 1 - bare / ours (what overlapping
it with the MMAs could win at most).

--precision fp8 (mok_proto.bench.gemm_fp8_problems, gemm_fp8_rows): the same loads, each expert's
rows at a multiple of plan.SEGMENT_ROWS (128) as in the layer. Per problem, in one run, interleaved (each iteration
runs all three, the first one moving along, each after the flush and the sleep): our FP8 GEMM
(block-scaled e4m3), our BF16 GEMM on the same bf16 values, and torch._scaled_grouped_mm on
row-wise e4m3 operands quantized from them (what torch offers on sm_90; bf16 out, no fast
accumulation; quantized before timing); x bf16 and x torch8 are medians of the per-iteration time
ratios. of dense: over the dense BF16 matmul; of fp8: over a dense FP8 torch._scaled_mm. Every FP8
output is checked against float64 on its dequantized operands: `err`, the least GEMM error the
output allows (beyond its bf16 rounding) over each expert's max |ref|, at most 2e-3; gate_up's h
and hq also bit for bit as a launch that writes g and u too (whose g and u are checked), hq the
quantization of h. Bars: gate_up and down at least 1.5 x our BF16 and 1.25 x torch; a bar whose
baseline did not run (no torch._scaled_grouped_mm) is not met. Rows: results/bench_gemm_fp8.jsonl.
"""

from __future__ import annotations

import sys

from mok_proto.bench import append_result, require_gpu
from mok_proto.bench import gemm_fp8_rows as rows_fp8
from mok_proto.bench.cli import Bar, add_bar_option, parse_bars, parser
from mok_proto.bench.gemm_problems import ERR_TOL, PROBLEMS, make_operands, problems, reference_errors, settle, timed
from mok_proto.config import PAPER_SHAPES, get_shape

BARS = {f"{name}_x_torch": Bar(value, f"{name}: ours x torch._grouped_mm, TFLOP/s") for name, value in
        zip(PROBLEMS, (0.9, 0.9, 0.85, 0.85, 0.8, 0.8))}


def run_fp8(args, wanted, bars) -> int:
    """--precision fp8: every shape, routing and problem timed, checked, printed and appended to
    results/bench_gemm_fp8.jsonl; the exit status."""
    import cupy
    import torch

    from mok_proto.bench import gemm_fp8_problems as problems_fp8
    from mok_proto.bench.ceilings import DENSE_N, dense_fp8_tflops, dense_matmul_tflops
    from mok_proto.kernels import fp8 as quantizer
    from mok_proto.kernels import gemm, gemm_fp8
    from mok_proto.kernels.errors import ErrorRecord

    dense, dense_fp8 = dense_matmul_tflops(), dense_fp8_tflops()
    print(f"# bench_gemm --precision fp8 on {torch.cuda.get_device_name()}: EP={args.ep}, {args.tokens} tokens/rank, "
          f"TFLOP/s median over {args.iters}; x bf16, x torch8 = our FP8 GEMM's per-iteration time ratio over our "
          f"BF16 GEMM and torch._scaled_grouped_mm (row-wise); of dense, of fp8 = over a dense {DENSE_N}^3 BF16 "
          f"matmul ({dense:.0f} TFLOP/s) and FP8 torch._scaled_mm "
          f"({'none' if dense_fp8 is None else f'{dense_fp8:.0f} TFLOP/s'})")
    print(rows_fp8.HEADER + ("    epi" if args.epilogue_share else ""))
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.float32, device="cuda")
    failed = []  # rows that miss a bar or whose output is wrong
    for shape_name in args.shapes.split(","):
        for routing in args.routing.split(","):
            ops = problems_fp8.make_operands(get_shape(shape_name), args.ep, args.tokens, routing, cupy, quantizer)
            err = ErrorRecord(gemm.TIMEOUT_NS / 1e9)
            for name in wanted:
                runs = problems_fp8.ours(ops, name, err)
                if args.epilogue_share:
                    runs["fp8_no_epilogue"] = without_epilogue(runs["fp8"])
                torch_run, torch_note = problems_fp8.torch_fp8(ops, name)
                if torch_run is not None:
                    runs["torch_fp8"] = torch_run
                samples = rows_fp8.time_problem(runs, args.iters, args.warmup, lambda: settle(flush))
                if name == "gate_up":
                    problems_fp8.check_launch(ops, err)
                err.check()
                error, mismatched = problems_fp8.fp8_error(name, ops, quantizer)
                row = rows_fp8.fp8_row(name, samples, problems_fp8.flops(name, ops), error, mismatched, torch_note,
                                       dense, dense_fp8, bars, shape=shape_name, ep=args.ep, routing=routing,
                                       **problems_fp8.row_fields(ops))
                why = rows_fp8.failures(row, bars)
                print(rows_fp8.line(row, bars, why), flush=True)
                append_result(rows_fp8.BENCH, row)
                failed += [f"{shape_name} {routing} {name}: {reason}" for reason in why]
                runs = torch_run = None  # torch's operands go with them
            ops = None
            cupy.get_default_memory_pool().free_all_blocks()
            torch.cuda.empty_cache()
    return finish(gemm_fp8.MODULE, gemm_fp8.NAMESPACE, gemm_fp8.smem_bytes(), failed,
                  "bars missed or outputs wrong", "all bars met, all FP8 outputs match")


def without_epilogue(run):
    """`run` launching the build of its kernel without epilogue (gemm.without_epilogue)."""
    from mok_proto.kernels import gemm

    def bare():
        with gemm.without_epilogue():
            run()
    return bare


def epilogue_share(ours, args, flush) -> dict:
    """--epilogue-share of a BF16 problem: our GEMM and its build without epilogue interleaved
    (each after the flush and the sleep), as the FP8 runs are: their row fields."""
    from mok_proto.bench.timing import rotating, summarize, time_stages

    runs = {"with": ours, "bare": without_epilogue(ours)}
    samples = time_stages(rotating(runs, lambda: settle(flush)), args.iters, args.warmup, api="torch")
    t_with, t_bare = summarize(samples["with"]), summarize(samples["bare"])
    return {"ours_no_epilogue": t_bare, "epilogue_share": 1.0 - t_bare["median_ms"] / t_with["median_ms"]}


def finish(module, namespace, smem, failed, failure: str, success: str) -> int:
    """The run's last lines: the GEMMs' grid (down's kernel of `module`), then the failed rows (on
    stderr) or `success`; the exit status."""
    from mok_proto.kernels import gemm

    kernel = module.function(f"{namespace}::grouped_gemm<{gemm.PROBLEMS.index('down')}>")
    print(f"# grid: {gemm.resident_clusters(kernel, smem=smem)} clusters of {gemm.CLUSTER} CTAs")
    if failed:
        print(f"FAIL: {len(failed)} {failure}:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    print(success)
    return 0


def main():
    p = parser(__doc__)
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                   help="bf16: our GEMMs against torch._grouped_mm (results/bench_gemm.jsonl); fp8: our FP8 GEMMs "
                        "against our BF16 ones and torch._scaled_grouped_mm (results/bench_gemm_fp8.jsonl)")
    p.add_argument("--shapes", default=",".join(PAPER_SHAPES))
    p.add_argument("--ep", type=int, default=64)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--routing", default="uniform,skewed")
    p.add_argument("--problems", default=",".join(PROBLEMS), help="a subset of " + ",".join(PROBLEMS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--epilogue-share", action="store_true",
                   help="also time our GEMMs built without their epilogue (row field epilogue_share)")
    add_bar_option(p, {**BARS, **rows_fp8.BARS})
    args = p.parse_args()
    wanted = list(dict.fromkeys(name for name in args.problems.split(",") if name))  # in order, once each
    unknown = [name for name in wanted if name not in PROBLEMS]
    if unknown or not wanted:
        said = f"unknown problem(s) {','.join(unknown)}" if unknown else "--problems names no problem"
        p.error(f"{said}; choose from {','.join(PROBLEMS)}")
    try:  # only the bars of the precision that runs
        bars = parse_bars(args.bar, rows_fp8.BARS if args.precision == "fp8" else BARS)
    except ValueError as e:
        p.error(str(e))
    require_gpu("bench_gemm.py", need_torch=True)
    if args.precision == "fp8":
        return run_fp8(args, wanted, bars)
    import torch

    from mok_proto.kernels import gemm

    from mok_proto.bench.ceilings import DENSE_N, dense_matmul_tflops, of_dense

    dense_ceiling = dense_matmul_tflops()
    print(f"# bench_gemm on {torch.cuda.get_device_name()}: EP={args.ep}, {args.tokens} tokens/rank, bf16, "
          f"TFLOP/s median over {args.iters} (ratio = ours / torch._grouped_mm); of dense = ours / a dense "
          f"{DENSE_N}^3 torch.matmul ({dense_ceiling:.0f} TFLOP/s)")
    print(f"{'shape':<16}{'routing':<8}{'problem':<14}{'ours':>8}{'grouped':>9}{'dense':>8}{'ratio':>7}{'bar':>6}"
          f"{'of dense':>9}{'err':>9}  ok" + ("    epi" if args.epilogue_share else ""))
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
                bare = {}
                if args.epilogue_share:  # (its launches leave the outputs checked below as they are)
                    bare = epilogue_share(ours, args, flush)
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
                line = (f"{shape_name:<16}{routing:<8}{name:<14}{tf['ours']:>8.0f}{tf['torch']:>9.0f}"
                        f"{tf['dense']:>8.0f}{ratio:>7.2f}{bar:>6.2f}{tf['ours'] / dense_ceiling:>9.2f}{error:>9.1e}  "
                        f"{'yes' if ok else ('NO' if correct else 'WRONG'):<5}"
                        + (f"{bare['epilogue_share']:>7.1%}" if bare else ""))
                print(line.rstrip(), flush=True)
                append_result("bench_gemm", of_dense({
                    "shape": shape_name, "ep": args.ep, "routing": routing, "problem": name,
                    "experts": int(num_experts), "rows": int(rows), "flops": int(flops), "ours": t_ours,
                    "torch_grouped_mm": t_torch, "dense": t_dense, "tflops": tf, "ratio": ratio, "bar": bar,
                    "max_rel_err": error, **bare}, tf["ours"], dense_ceiling))
    return finish(gemm.MODULE, "mok::gemm", None, failed, "rows miss their bar or are wrong",
                  "all bars met, all outputs match")


if __name__ == "__main__":
    sys.exit(main())
