"""Our grouped expert GEMMs against torch._grouped_mm and a dense cuBLAS GEMM, on one GPU.

    python scripts/bench_gemm.py [--shapes kimi-k2.7,...] [--problems down_wgrad,...] [--iters 20]

The per-rank load of EP=64: 2048 tokens x K choices spread over E/64 local experts, uniform
(equal rows per expert) or skewed (rows proportional to 1/(e+1)). For each problem, in one run:
our kernel, torch._grouped_mm on the same operands (the GEMM only: it gets no fused epilogue, so
the ratio is conservative for gate_up and down_bwd), and one dense torch.mm of the same FLOPs as
the ceiling. One CUDA event pair per iteration after an L2 flush and a GPU sleep that hides host
launch cost; median (p20, p80). Every timed kernel's output is also checked against
torch._grouped_mm's (plus the fused elementwise step in float32): column `err`, max |ours - ref| /
max |ref|, must stay below ERR_TOL.
Bars: forward >= 0.9x, data gradients >= 0.85x, weight gradients >= 0.8x of torch._grouped_mm.
Exit status: 0 when every row meets its bar and its output check, 1 otherwise (the failed rows are
listed), 2 on a machine without a GPU, CuPy or torch (one line says which).
Results: JSON lines appended to results/bench_gemm.jsonl.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from mok_proto.bench import append_result, require_gpu, summarize, time_stages
from mok_proto.config import PAPER_SHAPES, get_shape
from mok_proto.kernels import gemm
from mok_proto.kernels.errors import ErrorRecord
from mok_proto.problem import rows_per_expert

ERR_TOL = 2.0 ** -6  # bf16 outputs (ours fuse in fp32, the reference rounds GEMM outputs to bf16 first)
BARS = {"gate_up": 0.9, "down": 0.9, "down_bwd": 0.85, "gate_up_bwd": 0.85, "down_wgrad": 0.8, "gate_up_wgrad": 0.8}


def timed(fn, iters, warmup, flush):
    """One event pair around fn per iteration, after an L2 flush and a GPU sleep that hides the
    host's launch cost (neither is timed)."""
    import torch

    def iteration(mark):
        flush.zero_()
        torch.cuda._sleep(2_000_000)  # ~1 ms: longer than any wrapper's host-side cost
        mark("run")
        fn()
        mark(None)

    return summarize(time_stages(iteration, iters, warmup, api="torch")["run"])


def rel_err(got, want):
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def reference_errors(name, x, dy, h, g, u, dgu, wgu, wd, offs, out, dwd, dwg, dwu):
    """Max relative error of our outputs for problem `name` against torch._grouped_mm."""
    import torch

    ffn = h.shape[1]
    if name == "gate_up":
        ref = grouped_mm(x, wgu, offs)().float()
        return rel_err(out["h"], torch.nn.functional.silu(ref[:, :ffn]) * ref[:, ffn:])
    if name == "down":
        return rel_err(out["y"], grouped_mm(h, wd, offs)())
    if name == "down_bwd":
        dh, sig = grouped_mm(dy, wd.transpose(-2, -1), offs)().float(), torch.sigmoid(g.float())
        return max(rel_err(out["dg"], dh * u.float() * sig * (1 + g.float() * (1 - sig))),
                   rel_err(out["du"], dh * g.float() * sig))
    if name == "gate_up_bwd":
        return rel_err(out["dx"], grouped_mm(dgu, wgu.transpose(-2, -1), offs)())
    if name == "down_wgrad":
        return rel_err(dwd, grouped_mm(h.t(), dy, offs)())
    ref = grouped_mm(x.t(), dgu, offs)()
    return max(rel_err(dwg, ref[..., :ffn]), rel_err(dwu, ref[..., ffn:]))


def grouped_mm(a, b, offs):
    """torch._grouped_mm, with the operand layout it accepts (layouts prepared outside timing)."""
    import torch

    try:
        torch._grouped_mm(a, b, offs=offs)
        return lambda: torch._grouped_mm(a, b, offs=offs)
    except RuntimeError:
        bt = b.transpose(-2, -1).contiguous().transpose(-2, -1)
        torch._grouped_mm(a, bt, offs=offs)
        return lambda: torch._grouped_mm(a, bt, offs=offs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(PAPER_SHAPES))
    p.add_argument("--ep", type=int, default=64)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--routing", default="uniform,skewed")
    p.add_argument("--problems", default=",".join(BARS), help="a subset of " + ",".join(BARS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    wanted = list(dict.fromkeys(name for name in args.problems.split(",") if name))  # in order, once each
    unknown = [name for name in wanted if name not in BARS]
    if unknown or not wanted:
        said = f"unknown problem(s) {','.join(unknown)}" if unknown else "--problems names no problem"
        p.error(f"{said}; choose from {','.join(BARS)}")
    require_gpu("bench_gemm.py", need_torch=True)
    import cupy
    import torch

    dev = torch.device("cuda")
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.float32, device=dev)
    cp = lambda t: cupy.from_dlpack(t.view(torch.int16) if t.dtype == torch.bfloat16 else t)  # noqa: E731

    print(f"# bench_gemm on {torch.cuda.get_device_name()}: EP={args.ep}, {args.tokens} tokens/rank, bf16, "
          f"TFLOP/s median over {args.iters} (ratio = ours / torch._grouped_mm)")
    print(f"{'shape':<16}{'routing':<8}{'problem':<14}{'ours':>8}{'grouped':>9}{'dense':>8}{'ratio':>7}{'bar':>6}"
          f"{'err':>9}  ok")
    failed = []  # rows that miss their bar or whose output is wrong
    for shape_name in args.shapes.split(","):
        shape = get_shape(shape_name)
        num_experts, hidden, ffn = shape.num_experts // args.ep, shape.hidden, shape.ffn
        rows = args.tokens * shape.top_k
        torch.manual_seed(0)
        bf = lambda *s, scale=1.0: (torch.randn(*s, device=dev) * scale).to(torch.bfloat16)  # noqa: E731
        x, dy = bf(rows, hidden), bf(rows, hidden)
        h, g, u, dg, du = (bf(rows, ffn) for _ in range(5))
        wg, wu = bf(num_experts, hidden, ffn, scale=hidden ** -0.5), bf(num_experts, hidden, ffn, scale=hidden ** -0.5)
        wd = bf(num_experts, ffn, hidden, scale=ffn ** -0.5)
        wgu, dgu = torch.cat([wg, wu], dim=2), torch.cat([dg, du], dim=1)
        c = {name: cp(t) for name, t in (("x", x), ("dy", dy), ("h", h), ("g", g), ("u", u), ("dg", dg), ("du", du),
                                         ("wg", wg), ("wu", wu), ("wd", wd))}
        out = {name: torch.empty(rows, n, dtype=torch.bfloat16, device=dev) for name, n in
               (("h", ffn), ("y", hidden), ("dg", ffn), ("du", ffn), ("dx", hidden))}
        dwd = torch.empty(num_experts, ffn, hidden, device=dev)
        dwg, dwu = torch.empty(num_experts, hidden, ffn, device=dev), torch.empty(num_experts, hidden, ffn, device=dev)
        c.update({"out_" + name: cp(t) for name, t in out.items()})
        c.update(dwd=cp(dwd), dwg=cp(dwg), dwu=cp(dwu))
        for routing in args.routing.split(","):
            counts = rows_per_expert(rows, num_experts, routing)
            offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
            d_off, d_cnt = cupy.asarray(offsets.astype(np.int32)), cupy.asarray(counts.astype(np.int32))
            offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=dev)
            err = ErrorRecord(gemm.TIMEOUT_NS / 1e9)
            problems = {
                "gate_up": (lambda: gemm.gate_up(c["x"], c["wg"], c["wu"], d_off, d_cnt, c["out_h"], error=err),
                            lambda: grouped_mm(x, wgu, offs), (x, wgu[0]), 2 * rows * hidden * 2 * ffn),
                "down": (lambda: gemm.down(c["h"], c["wd"], d_off, d_cnt, c["out_y"], error=err),
                         lambda: grouped_mm(h, wd, offs), (h, wd[0]), 2 * rows * ffn * hidden),
                "down_bwd": (lambda: gemm.down_bwd(c["dy"], c["wd"], c["g"], c["u"], d_off, d_cnt, c["out_dg"],
                                                   c["out_du"], error=err),
                             lambda: grouped_mm(dy, wd.transpose(-2, -1), offs), (dy, wd[0].t()),
                             2 * rows * hidden * ffn),
                "gate_up_bwd": (lambda: gemm.gate_up_bwd(c["dg"], c["du"], c["wg"], c["wu"], d_off, d_cnt, c["out_dx"],
                                                         error=err),
                                lambda: grouped_mm(dgu, wgu.transpose(-2, -1), offs), (dgu, wgu[0].t()),
                                2 * rows * 2 * ffn * hidden),
                "down_wgrad": (lambda: gemm.down_wgrad(c["h"], c["dy"], d_off, d_cnt, c["dwd"], error=err),
                               lambda: grouped_mm(h.t(), dy, offs), (h.t(), dy), 2 * rows * ffn * hidden),
                "gate_up_wgrad": (lambda: gemm.gate_up_wgrad(c["x"], c["dg"], c["du"], d_off, d_cnt, c["dwg"], c["dwu"],
                                                             error=err),
                                  lambda: grouped_mm(x.t(), dgu, offs), (x.t(), dgu), 2 * rows * hidden * 2 * ffn),
            }
            for name in wanted:
                ours, make_torch, (da, db), flops = problems[name]
                t_ours = timed(ours, args.iters, args.warmup, flush)
                t_torch = timed(make_torch(), args.iters, args.warmup, flush)
                t_dense = timed(lambda: torch.mm(da, db), args.iters, args.warmup, flush)
                err.check()
                error = reference_errors(name, x, dy, h, g, u, dgu, wgu, wd, offs, out, dwd, dwg, dwu)
                tf = {k: flops / (t["median_ms"] * 1e-3) / 1e12 for k, t in
                      (("ours", t_ours), ("torch", t_torch), ("dense", t_dense))}
                ratio = tf["ours"] / tf["torch"]
                correct = error <= ERR_TOL
                ok = ratio >= BARS[name] and correct
                if not ok:
                    failed.append(f"{shape_name} {routing} {name}: " + (f"ratio {ratio:.2f} < bar {BARS[name]}"
                                  if correct else f"max rel err {error:.1e} > {ERR_TOL:.1e}"))
                print(f"{shape_name:<16}{routing:<8}{name:<14}{tf['ours']:>8.0f}{tf['torch']:>9.0f}{tf['dense']:>8.0f}"
                      f"{ratio:>7.2f}{BARS[name]:>6.2f}{error:>9.1e}  "
                      f"{'yes' if ok else ('NO' if correct else 'WRONG')}", flush=True)
                append_result("bench_gemm", {"shape": shape_name, "ep": args.ep, "routing": routing, "problem": name,
                                             "experts": int(num_experts), "rows": int(rows), "flops": int(flops),
                                             "ours": t_ours, "torch_grouped_mm": t_torch, "dense": t_dense,
                                             "tflops": tf, "ratio": ratio, "bar": BARS[name], "max_rel_err": error})
    kernel = gemm.MODULE.function(f"mok::gemm::grouped_gemm<{gemm.PROBLEMS.index('down')}>")
    print(f"# grid: {gemm.resident_clusters(kernel)} clusters of {gemm.CLUSTER} CTAs")
    if failed:
        print(f"FAIL: {len(failed)} rows miss their bar or are wrong:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    print("all bars met, all outputs match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
