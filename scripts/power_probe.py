"""python scripts/power_probe.py [--shapes kimi-k2.7,...] [--secs 2.5] [--comm 0] [--minibatch 2048]

Power and SM clock of the sequential and the fused passes under sustained load, on the GPU
(mok_proto.bench.power).

Why: a GPU holds its board power limit by lowering the SM clock, and a layer pass replayed back
to back runs at that limit. The time of a pass then follows its energy, so a fused
pass that overlaps the same work saves little time; bench_layer.py's short interleaved runs see
it only in part. This measures it. Per shape (one EP=64 rank's share on one GPU, as
bench_layer.py emulates it): the sequential pass and the fused pass (comm blocks, minibatch rows,
the plans' default assignment, order and claimed pool: plan.FusedKnobs) of the forward and of
the backward are each captured in a graph; after a warm-up phase, one graph at a time is replayed
for --secs seconds (sequential, fused, sequential, fused per pass) while nvidia-smi samples clocks
and power every 20 ms.

A progress line per phase; per shape and pass a summary: median ms, mean SM clock, mean power and
energy per pass (mean power x median time) of each schedule (mean of its two phases), then
x seq (sequential ms / fused ms: above 1, fused is faster), fused / sequential of the clock and
of the energy, and x cycles (sequential ms x MHz / fused ms x MHz: x seq at equal clocks, an
estimate from mean clocks). Power and clocks are averaged from the second second of each phase on
(nvidia-smi's power.draw is a one-second average: bench.power.SMI_SETTLE_S). One JSON line per phase
appended to results/power_probe.jsonl (keys: the stamp of mok_proto.bench.rows, shape, pass, schedule, phase,
comm_blocks, minibatch_tokens, assign, raster, claim_pairs (tile pairs claimed at run time),
secs, median_ms, iters, sm_mhz, power_w, energy_mj, power_capped: the fraction of samples under
the power cap, samples). No bars.
Exit status: 0; 1 if a fused result is not bitwise equal to the sequential one; 2 without a GPU,
or without an nvidia-smi that reports this GPU's clock and power.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time

from mok_proto.bench.cli import parser
from mok_proto.config import PAPER_SHAPES
from mok_proto.plan import SEGMENT_ROWS, FusedKnobs


def main():
    p = parser(__doc__)
    p.add_argument("--shapes", default=",".join(PAPER_SHAPES))
    p.add_argument("--secs", type=float, default=2.5, help="seconds of replays per phase (at least 2)")
    p.add_argument("--comm", type=int, default=0, help="the fused plans' communicating CTAs")
    p.add_argument("--minibatch", type=int, default=2048, help="the fused plans' minibatch rows")
    args = p.parse_args()
    if args.secs < 2:
        p.error(f"--secs must be at least 2 (the first second of a phase is not averaged), got {args.secs}")
    try:
        knobs = FusedKnobs(args.comm, args.minibatch)
    except ValueError as e:
        p.error(str(e))
    from mok_proto.bench import append_result, phase_power, require_gpu, smi_command, smi_samples
    from mok_proto.bench.power import compare, probe_shape

    require_gpu("power_probe.py")
    import cupy

    device = cupy.cuda.Device().pci_bus_id  # the GPU this process runs on (CUDA_VISIBLE_DEVICES applies)
    if shutil.which("nvidia-smi") is None:
        fail("power_probe.py needs nvidia-smi (it samples clocks and power); none on PATH")
    once = subprocess.run(smi_command(device, None), capture_output=True, text=True, timeout=60)
    if not len(smi_samples(once.stdout.splitlines())):
        fail(f"power_probe.py: nvidia-smi -i {device} gave no clock and power sample: "
             f"{(once.stdout + once.stderr).strip().splitlines()[:1]}")
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
    smi = subprocess.Popen(smi_command(device), stdout=log, stderr=subprocess.STDOUT, text=True)
    phases, unequal = [], []
    try:
        for name in args.shapes.split(","):
            got, bad = probe_shape(name, knobs, args.secs)
            phases += got
            unequal += bad
    finally:
        time.sleep(0.1)
        died = smi.poll()
        smi.terminate()
        smi.wait()
    log.seek(0)
    text = log.read()
    samples = smi_samples(text.splitlines())
    try:
        for ph in phases:
            ph.update(phase_power(samples, ph["t0"], ph["t1"]))
    except ValueError as e:
        fail(f"power_probe.py: {e} (nvidia-smi {'exited' if died is not None else 'ran'}; its last line: "
             f"{text.strip().splitlines()[-1:] or 'none'})")
    print(f"{'shape':16s} pass  {'sequential ms   MHz    W    mJ':>30s}  {'fused ms   MHz    W    mJ':>30s}"
          f"  x seq  clock  energy  x cycles")
    for ph in phases:
        ph["energy_mj"] = ph["power_w"] * ph["median_ms"]
        append_result("power_probe", {"shape": ph["shape"], "pass": ph["pass_"], "schedule": ph["schedule"],
                                      "phase": ph["phase"], "comm_blocks": args.comm,
                                      "minibatch_tokens": args.minibatch, "segment_rows": SEGMENT_ROWS,
                                      "assign": ph["assign"],
                                      "raster": ph["raster"], "claim_pairs": ph["claim_pairs"], "secs": args.secs,
                                      **{k: ph[k] for k in ("median_ms", "iters", "sm_mhz", "power_w", "energy_mj",
                                                            "power_capped", "samples")}})
    for name in args.shapes.split(","):
        for pass_ in ("fwd", "bwd"):
            seq, fus, ratio = compare(phases, name, pass_)
            cols = "  ".join(f"{m['median_ms']:11.3f} {m['sm_mhz']:5.0f} {m['power_w']:4.0f} {m['energy_mj']:5.0f}"
                             for m in (seq, fus))
            print(f"{name:16s} {pass_}  {cols}  {ratio['x_seq']:5.3f}  {ratio['clock']:5.3f}  {ratio['energy']:5.3f}  "
                  f"{ratio['x_cycles']:8.3f}  (power-capped samples {min(seq['power_capped'], fus['power_capped']):.0%})")
    if unequal:
        print(f"FAIL: fused not bitwise equal to sequential: {', '.join(unequal)}", file=sys.stderr)
        sys.exit(1)


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
