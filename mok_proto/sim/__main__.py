"""Command line of the simulator.

    python -m mok_proto.sim --validate [--h200-only]
    python -m mok_proto.sim --shape kimi-k2.7 --ep 64 --gpu gb300-nvl72 --pass fwd --comm-sms 40 --minibatch 2048
    python -m mok_proto.sim --fused --comm-sms 0 ...   # the megakernel's plan (plan.fused_forward, --pass bwd:
                                                       # plan.fused_backward)
    python -m mok_proto.sim --fused --vs-sequential ... # and the sequential plan of the same pass: x sequential

Exit status: 0 ok; 1 an H200 row outside its bar (--validate); 2 bad argument.
"""

from __future__ import annotations

import argparse
import sys
import time

from mok_proto import plan as plans
from mok_proto.config import get_shape, parse_policy
from mok_proto.sim.model import simulate
from mok_proto.sim.params import get_params, h200
from mok_proto.sim.validate import H200_TOLERANCE, format_table, h200_rows, paper_rows, tolerance_of


def main(argv=None) -> int:
    defaults = plans.FusedKnobs.PASS_DEFAULTS  # the fused plans' per-pass knob defaults, for --help
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--validate", action="store_true", help="compare against our H200 results and the paper")
    ap.add_argument("--h200-only", action="store_true", help="with --validate: only the H200 rows")
    ap.add_argument("--shape", default="kimi-k2.7")
    ap.add_argument("--ep", type=int, default=64)
    ap.add_argument("--gpu", default="gb300-nvl72")
    ap.add_argument("--pass", dest="pass_", default="fwd", choices=plans.PASSES)
    ap.add_argument("--policy", default="")
    ap.add_argument("--comm-sms", type=int, default=40)
    ap.add_argument("--minibatch", type=int, default=2048)
    ap.add_argument("--sequential", action="store_true")
    ap.add_argument("--fused", action="store_true",
                    help="the megakernel's plan: plan.fused_forward, or plan.fused_backward with --pass bwd")
    ap.add_argument("--vs-sequential", action="store_true",
                    help="also simulate the sequential plan of the same pass and print the ratio (x sequential)")
    ap.add_argument("--assign", default=None, choices=plans.ASSIGNMENTS,
                    help=f"with --fused: tile pairs to clusters (default {defaults['fwd']['assign']} forward, "
                         f"{defaults['bwd']['assign']} backward)")
    ap.add_argument("--raster", default=None, choices=plans.RASTERS,
                    help=f"with --fused: the order of a minibatch's tile pairs (default {defaults['fwd']['raster']})")
    ap.add_argument("--claim", default=None,
                    help=f"with --fused: tile pairs claimed at run time, an int, all or tail (default "
                         f"{defaults['fwd']['claim']} forward, {defaults['bwd']['claim']} backward)")
    args = ap.parse_args(argv)
    try:
        if args.validate:
            calibrated = h200()
            rows = h200_rows(calibrated)
            bad = [r for r in rows if not r.ok(H200_TOLERANCE)]
            if not args.h200_only:
                rows += paper_rows()
            print(f"# h200 parameters: {calibrated.note}")
            print(format_table(rows, tolerance_of))
            print(f"# {len(bad)} H200 rows outside {H200_TOLERANCE * 100:.0f}%")
            return 1 if bad else 0
        gpu = get_params(args.gpu)
        shape = get_shape(args.shape)
        policy = parse_policy(args.policy)
        t0 = time.perf_counter()
        if args.claim is not None and not args.fused:
            raise ValueError("--claim applies to the megakernel's plan: add --fused")
        if args.vs_sequential and args.sequential:
            raise ValueError("--vs-sequential compares another plan with the sequential one: drop --sequential")

        def sequential_plan():
            return plans.sequential(shape, args.ep, pass_=args.pass_, policy=policy, num_sms=gpu.num_sms)

        if args.sequential:
            p = sequential_plan()
        elif args.fused:
            make = plans.fused_forward if args.pass_ == "fwd" else plans.fused_backward
            claim = None if args.claim is None else plans.parse_claim(args.claim)
            knobs = plans.FusedKnobs(args.comm_sms, args.minibatch, assign=args.assign, raster=args.raster, claim=claim)
            p = make(shape, args.ep, knobs, policy=policy, num_sms=gpu.num_sms - gpu.num_sms % 2)
        else:
            p = plans.fixed_split(shape, args.ep, args.comm_sms, args.minibatch, pass_=args.pass_, policy=policy,
                                  num_sms=gpu.num_sms)
        result = simulate(p, gpu)
        baseline = None
        if args.vs_sequential:
            baseline = simulate(sequential_plan(), gpu)
        elapsed = time.perf_counter() - t0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(p.describe())
    print(f"{gpu.name}: {result.time_ns / 1e3:.1f} us, of which the plan's tasks {result.kernel_ns / 1e3:.1f} us "
          f"(slowest rank {result.slowest_rank}); simulated in {elapsed:.2f} s"
          + (" (both plans)" if baseline is not None else ""))
    if baseline is not None:
        print(f"sequential plan: {baseline.time_ns / 1e3:.1f} us; x sequential {baseline.time_ns / result.time_ns:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
