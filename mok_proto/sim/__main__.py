"""Command line of the simulator.

    python -m mok_proto.sim --validate [--measured-only]   # each calibrated set against its GPU's rows
    python -m mok_proto.sim --shape kimi-k2.7 --ep 64 --gpu gb300-nvl72 --pass fwd --comm-sms 40 --minibatch 2048
    python -m mok_proto.sim --fused --comm-sms 0 ...   # the megakernel's plan (plan.fused_forward, --pass bwd:
                                                       # plan.fused_backward)
    python -m mok_proto.sim --fused --vs-sequential ... # and the sequential plan of the same pass: x sequential
    python -m mok_proto.sim --link-gbps 368,900        # bench_layer.py --link-gbps's emulation: one GPU, EP=64's
                                                       # share, both passes, sequential and fused with the link
    python -m mok_proto.sim --fused --vs-sequential --ep 8 --link-gbps 450 ...  # a projection with link_gbs 450
    python -m mok_proto.sim --routing hot:0.25 ...     # skewed routing (mok_proto.routing), rank 0 the hot rank
    python -m mok_proto.sim calibrate --gpu h200       # refit calibration/h200.json on results/ (h100: the H100's)

A simulation's first output line names every setting it ran with, "(default)" after those not given.
Exit status: 0 ok; 1 a measured row outside its bar (--validate); 2 bad argument (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from mok_proto import plan as plans
from mok_proto import results
from mok_proto.bench.cli import routing_spec
from mok_proto.bench.layer_rows import overlap_efficiency
from mok_proto.config import MOK_POLICY, PRESETS, ep_share, get_shape, parse_policy
from mok_proto.link import DEFAULT_LATENCY_US, LinkModel
from mok_proto.routing import UNIFORM, expected_rows
from mok_proto.sim import calibrate, fused, layer
from mok_proto.sim.model import plan_align, simulate, spec_load
from mok_proto.sim.params import PARAMS, get_params, params_from_json
from mok_proto.sim.validate import (MEASURED_TOLERANCE, calibrated_sets, format_table, link_note, measured_rows,
                                    paper_rows, tolerance_of)

PROG = "python -m mok_proto.sim"
SPLIT_DEFAULTS = {"comm_sms": 40, "minibatch": 2048}  # MoK's fixed split on GB300 (the paper's forward setting)
FUSED_DEFAULTS = {"comm_sms": plans.FusedKnobs.comm_blocks, "minibatch": plans.FusedKnobs.minibatch_rows}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's own adds the usage)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    fused = plans.FusedKnobs.PASS_DEFAULTS  # the fused plans' per-pass knob defaults
    ap = _Parser(prog=PROG, description=__doc__.splitlines()[0],
                 epilog=f"calibrate: {PROG} calibrate --help. Exit status: 0 ok; 1 a measured row outside its bar "
                        "(--validate); 2 bad argument.")
    ap.add_argument("--validate", action="store_true",
                    help="compare against our results (each calibrated set, h200 and h100, against its own GPU's rows) "
                         "and the paper")
    ap.add_argument("--measured-only", "--h200-only", dest="measured_only", action="store_true",
                    help="with --validate: only the measured rows, not the paper's (--h200-only: its old name)")
    ap.add_argument("--shape", default="kimi-k2.7", choices=list(PRESETS), help="the layer's shape (default %(default)s)")
    ap.add_argument("--ep", type=int, default=64, help="ranks (GPUs), dividing the shape's experts (default %(default)s)")
    ap.add_argument("--gpu", default="gb300-nvl72", choices=list(PARAMS), help="parameter set (default %(default)s)")
    ap.add_argument("--pass", dest="pass_", default="fwd", choices=plans.PASSES, help="pass (default %(default)s)")
    ap.add_argument("--policy", default="", help="transfer directions, e.g. dispatch=push,combine=pull (default "
                    "MoK's: " + ",".join(f"{k}={v}" for k, v in MOK_POLICY.items()) + ")")
    ap.add_argument("--comm-sms", type=int, default=None,
                    help=f"communicating SMs (default {SPLIT_DEFAULTS['comm_sms']}; with --fused "
                         f"{FUSED_DEFAULTS['comm_sms']}: plan.FusedKnobs)")
    ap.add_argument("--minibatch", type=int, default=None,
                    help=f"receive rows per minibatch (default {SPLIT_DEFAULTS['minibatch']}; with --fused "
                         f"{FUSED_DEFAULTS['minibatch']}: plan.FusedKnobs)")
    ap.add_argument("--sequential", action="store_true", help="the sequential plan (default: MoK's fixed split)")
    ap.add_argument("--fused", action="store_true",
                    help="the megakernel's plan: plan.fused_forward, or plan.fused_backward with --pass bwd "
                         "(default: MoK's fixed split)")
    ap.add_argument("--vs-sequential", action="store_true",
                    help="also simulate the sequential plan of the same pass and print the ratio (x sequential)")
    ap.add_argument("--assign", default=None, choices=plans.ASSIGNMENTS,
                    help=f"with --fused: tile pairs to clusters (default {fused['fwd']['assign']} forward, "
                         f"{fused['bwd']['assign']} backward)")
    ap.add_argument("--raster", default=None, choices=plans.RASTERS,
                    help=f"with --fused: the order of a minibatch's tile pairs (default {fused['fwd']['raster']} "
                         f"forward, {fused['bwd']['raster']} backward)")
    ap.add_argument("--claim", default=None,
                    help=f"with --fused: tile pairs claimed at run time, an int >= 0, {' or '.join(plans.CLAIMS)} "
                         f"(default {fused['fwd']['claim']} forward, {fused['bwd']['claim']} backward)")
    ap.add_argument("--segment-rows", type=int, default=None,
                    help=f"with --fused: the expert segments' padding, a multiple of {plans.BM} (default "
                         f"{plans.SEGMENT_ROWS}: plan.SEGMENT_ROWS, the GPU layer's; another: a what-if)")
    ap.add_argument("--link-gbps", default=None, metavar="G[,G...]",
                    help="a link's rate per direction, GB/s. Without --sequential, --fused, --vs-sequential: "
                         "bench_layer.py --link-gbps's emulation (one GPU, default h200; one EP=--ep rank's share on 2 "
                         "virtual ranks, every row rank 0 moves paying the emulated link, mok_proto.link.LinkModel): "
                         "the sequential and fused passes (the fused knobs: --comm-sms ... --claim) with and without "
                         "the link, both passes (or --pass), each G. With one of them: that projection with the --gpu "
                         "parameter set's link_gbs = G (one G)")
    ap.add_argument("--routing", type=routing_spec, default=UNIFORM, metavar="SPEC",
                    help="uniform (default), zipf:ALPHA or hot:FRACTION (mok_proto.routing): the routing of the --ep "
                         "ranks' layout, rank 0 the hot (timed) rank; with the emulation (--link-gbps alone) rank 0 "
                         "of the emulation receives what rank 0 of that layout receives, as bench_layer.py --routing")
    ap.add_argument("--link-latency-us", type=float, default=None,
                    help=f"the emulated link's round trip (default {DEFAULT_LATENCY_US}: mok_proto.link); a projection "
                         "keeps its parameter set's round trips")
    return ap


def _calibrate(argv) -> int:
    ap = _Parser(prog=f"{PROG} calibrate", description="Fit a GPU parameter set on results/ and write its "
                 "calibration file, which the simulator reads.")
    ap.add_argument("--gpu", required=True, choices=list(calibrate.CALIBRATIONS), help="the parameter set")
    ap.add_argument("--results", default=str(results.RESULTS_DIR), help="the results folder (default %(default)s)")
    ap.add_argument("--out", default=None, help="the file to write (default mok_proto/sim/calibration/<gpu>.json)")
    args = ap.parse_args(argv)
    try:
        path = calibrate.write_calibration(args.gpu, args.results, args.out)
    except (ValueError, KeyError, OSError) as e:
        print(f"{PROG} calibrate: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}: " + calibrate.describe(params_from_json(json.loads(path.read_text())["params"])))
    return 0


def _link_speeds(text: str) -> list[float]:
    """--link-gbps G[,G...] -> [G, ...] (ValueError naming the flag otherwise)."""
    try:
        return list(dict.fromkeys(float(g) for g in text.split(",")))
    except ValueError:
        raise ValueError(f"--link-gbps: {text!r} is not G[,G...] in GB/s") from None


def _emulation(args, given: set) -> int:
    """--link-gbps without a plan option: bench_layer's one-GPU emulation at each link speed."""
    latency = DEFAULT_LATENCY_US if args.link_latency_us is None else args.link_latency_us
    speeds = _link_speeds(args.link_gbps)
    try:
        links = [LinkModel(g, latency, every_row=True) for g in speeds]
    except ValueError as e:
        raise ValueError(f"--link-gbps, --link-latency-us: {e}") from None
    if "policy" in given:
        raise ValueError("--policy: the emulation's sequential stages follow MoK's directions (sim/layer.py)")
    if "gpu" not in given:
        args.gpu = "h200"  # a GPU bench_layer runs on (--gpu h100 for the other)
    gpu, knobs = get_params(args.gpu), plans.FusedKnobs(args.comm_sms, args.minibatch, assign=args.assign,
                                                         raster=args.raster, claim=args.claim,
                                                         segment_rows=args.segment_rows)
    shape = ep_share(args.shape, args.ep)
    passes = [args.pass_] if "pass" in given else list(plans.PASSES)
    fused_knobs = {p: knobs.resolved(p, MOK_POLICY).describe(p, MOK_POLICY) for p in passes}  # (checks them)
    num_sms, one = gpu.num_sms - gpu.num_sms % 2, layer.one_gpu(gpu)
    table = []  # bench_layer's link table's columns (ms): the sequential and fused passes without and with the link
    routed = {"routing": args.routing, "ep": args.ep}
    for link in links:
        for pass_ in passes:
            seq, seq_link = (layer.sequential_stages_ns(shape, pass_, one, link=k, **routed)["total"] / 1e6
                             for k in (None, link))
            fus, fus_link = (fused.fused_pass_ns(shape, gpu, pass_, knobs, num_sms, k, **routed) / 1e6
                             for k in (None, link))
            eff = overlap_efficiency(seq, seq_link, fus, fus_link)
            table.append(f"{link.gbps:>6g}  {args.shape:<16}{pass_:<5}{seq:>9.3f}{seq_link:>9.3f}{fus:>9.3f}"
                         f"{fus_link:>9.3f}{seq_link / fus_link:>7.2f}{'-' if eff is None else f'{eff:.2f}':>8}")
    item = lambda name, value: f"{name} {value}" + ("" if name in given else " (default)")  # noqa: E731
    _, num, _ = layer.emulation(shape, args.routing, 0, args.ep)
    print("# " + ", ".join([item("shape", args.shape), item("ep", args.ep), item("gpu", args.gpu),
                            f"one GPU: {num} virtual ranks, every row rank 0 moves pays the link",
                            f"link-gbps {','.join(f'{link.gbps:g}' for link in links)}",
                            item("link-latency-us", f"{latency:g}"), item("comm-sms", args.comm_sms),
                            item("minibatch", args.minibatch), item("routing", args.routing)]))
    for pass_, row in fused_knobs.items():
        print(f"# fused {pass_}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    print(f"{'link':>6}  {'shape':<16}{'pass':<5}{'seq_ms':>9}{'seq_link':>9}{'fused_ms':>9}{'fus_link':>9}{'x seq':>7}"
          f"{'overlap':>8}")
    print("\n".join(table))
    return 0


def _validate(measured_only: bool) -> int:
    """--validate: each calibrated set whose file exists against its own GPU's rows (a line for each
    other set), then the paper's rows unless measured_only; 1 when a measured row misses its bar."""
    names, notes = calibrated_sets()
    rows, described = [], []
    for name in names:
        calibrated = get_params(name)
        rows += measured_rows(name, calibrated)
        described.append(f"# {name} parameters: {calibrate.describe(calibrated)}")
        notes += [note for note in (link_note(measured_on=name),) if note]
    bad = [r for r in rows if not r.ok(MEASURED_TOLERANCE)]
    if not measured_only:
        rows += paper_rows()
    print("\n".join(described + [format_table(rows, tolerance_of)] + notes))
    per_set = ", ".join(f"{name} {sum(r.group.split(' ', 1)[0] == name for r in bad)}" for name in names)
    print(f"# {len(bad)} measured rows outside {MEASURED_TOLERANCE * 100:.0f}% ({per_set})")
    return 1 if bad else 0


def _settings(args, given: set, plan: str, policy: dict) -> str:
    """The header line: every setting of the run, "(default)" after those not given."""
    def item(name, value, flag=None):
        return f"{name} {value}" + ("" if (flag or name) in given else " (default)")
    out = [item("shape", args.shape), item("ep", args.ep), item("gpu", args.gpu), item("pass", args.pass_),
           f"plan {plan}", item("policy", ",".join(f"{k}={v}" for k, v in policy.items())),
           item("routing", args.routing)]
    if args.link_gbps is not None:
        out.append(f"link-gbps {args.link_gbps} (the parameter set's link_gbs)")
    if plan != "sequential":
        out += [item("comm-sms", args.comm_sms), item("minibatch", args.minibatch)]
    if plan == "fused":
        resolved = plans.FusedKnobs(args.comm_sms, args.minibatch, assign=args.assign, raster=args.raster,
                                    claim=args.claim, segment_rows=args.segment_rows).resolved(args.pass_, policy)
        out += [item(k, getattr(resolved, k)) for k in ("assign", "raster", "claim")]
        out.append(item("segment-rows", resolved.segment_rows))
    return "# " + ", ".join(out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["calibrate"]:
        return _calibrate(argv[1:])
    ap = _parser()
    args = ap.parse_args(argv)
    given = {a.lstrip("-").split("=")[0].replace("_", "-") for a in argv if a.startswith("--")}
    try:
        if args.validate:
            if "routing" in given:
                raise ValueError("--validate compares the measured rows of uniform routing: drop --routing")
            return _validate(args.measured_only)
        # bench_layer's one-GPU emulation with its link: --link-gbps without a plan option
        emulation = args.link_gbps is not None and not (args.sequential or args.fused or args.vs_sequential)
        if args.sequential and args.fused:
            raise ValueError("--sequential and --fused name two plans: give one")
        for flag, value in (("--claim", args.claim), ("--segment-rows", args.segment_rows)):
            if value is not None and not (args.fused or emulation):
                raise ValueError(f"{flag} applies to the megakernel's plan: add --fused")
        if args.vs_sequential and args.sequential:
            raise ValueError("--vs-sequential compares another plan with the sequential one: drop --sequential")
        plan = "sequential" if args.sequential else "fused" if args.fused else "fixed_split"
        for name, value in (FUSED_DEFAULTS if args.fused or emulation else SPLIT_DEFAULTS).items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        gpu = get_params(args.gpu)
        shape = get_shape(args.shape)
        if args.ep < 1 or shape.num_experts % args.ep:
            raise ValueError(f"--ep must be a positive divisor of {args.shape}'s {shape.num_experts} experts, "
                             f"got {args.ep}")
        if args.minibatch < 1 or args.comm_sms < 0:
            raise ValueError(f"--minibatch must be >= 1 and --comm-sms >= 0, got {args.minibatch} and {args.comm_sms}")
        policy = parse_policy(args.policy)
        if args.claim is not None:
            args.claim = plans.parse_claim(args.claim)
        if emulation:
            return _emulation(args, given)
        if args.link_latency_us is not None:
            raise ValueError("--link-latency-us sets the emulated link's round trip (--link-gbps without --sequential, "
                             "--fused, --vs-sequential); a projection keeps its parameter set's round trips")
        if args.link_gbps is not None:
            speeds = _link_speeds(args.link_gbps)
            if len(speeds) != 1 or not 0 < speeds[0] < float("inf"):
                raise ValueError(f"--link-gbps: a projection takes one link rate > 0 in GB/s, got {args.link_gbps!r}")
            gpu = dataclasses.replace(gpu, link_gbs=speeds[0])
        header = _settings(args, given, plan, policy)
        t0 = time.perf_counter()
        # Under a skewed routing the plans hold its largest rank's padded rows (not the uniform default).
        need = None if args.routing.is_uniform else int(
            spec_load(shape, args.ep, args.routing, align=args.segment_rows or plans.SEGMENT_ROWS)
            .expert_offsets[:, -1].max())
        capacity = lambda rows: None if need is None else -(-need // rows) * rows  # noqa: E731

        def sequential_plan():
            return plans.sequential(shape, args.ep, pass_=args.pass_, policy=policy, num_sms=gpu.num_sms,
                                    capacity_rows=capacity(plans.BM))

        def run(p):
            load = None if need is None else spec_load(shape, args.ep, args.routing, align=plan_align(p))
            return simulate(p, gpu, load)

        if args.sequential:
            p = sequential_plan()
        elif args.fused:
            make = plans.fused_forward if args.pass_ == "fwd" else plans.fused_backward
            knobs = plans.FusedKnobs(args.comm_sms, args.minibatch, assign=args.assign, raster=args.raster,
                                     claim=args.claim, segment_rows=args.segment_rows)
            p = make(shape, args.ep, knobs, policy=policy, num_sms=gpu.num_sms - gpu.num_sms % 2,
                     capacity_rows=capacity(knobs.minibatch_rows))
        else:
            p = plans.fixed_split(shape, args.ep, args.comm_sms, args.minibatch, pass_=args.pass_, policy=policy,
                                  num_sms=gpu.num_sms, capacity_rows=capacity(args.minibatch))
        result = run(p)
        baseline = None
        if args.vs_sequential:
            baseline = run(sequential_plan())
        elapsed = time.perf_counter() - t0
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(header)
    if need is not None:
        rows = result.load.tokens_per_expert.sum(axis=1)
        print(f"# routing {args.routing}: rank 0 receives {rows[0]} rows ({expected_rows(args.routing, shape, args.ep):.0f} "
              f"expected: mok_proto.routing.expected_rows), the busiest rank {rows.max()}; uniform: "
              f"{shape.num_tokens * shape.top_k}")
    print(p.describe())
    print(f"{gpu.name}: {result.time_ns / 1e3:.1f} us, of which the plan's tasks {result.kernel_ns / 1e3:.1f} us "
          f"(slowest rank {result.slowest_rank}); simulated in {elapsed:.2f} s"
          + (" (both plans)" if baseline is not None else ""))
    if baseline is not None:
        print(f"sequential plan: {baseline.time_ns / 1e3:.1f} us; x sequential {baseline.time_ns / result.time_ns:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
