"""Power and SM clock of the sequential and the fused passes under sustained load
(scripts/power_probe.py): one graph replayed at a time while nvidia-smi samples clocks and power."""

from __future__ import annotations

import datetime
import time

import numpy as np

from mok_proto.bench.emulation import emulated_shape, make_inputs, result_bytes, staged_layer

# nvidia-smi's query, sampled every SMI_PERIOD_MS while one graph replays. clocks_event_reasons is a
# bit mask; SMI_POWER_CAP is its "SW power cap" bit (the board holds its power limit by lowering
# the SM clock).
SMI_QUERY = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"
SMI_PERIOD_MS = 20
SMI_POWER_CAP = 0x4


def smi_command(device: str, period_ms: int | None = SMI_PERIOD_MS) -> list:
    """nvidia-smi sampling SMI_QUERY of one GPU (`device`: its PCI bus id or index) every period_ms
    (None: once)."""
    loop = ["-lms", str(period_ms)] if period_ms else []
    return ["nvidia-smi", "-i", str(device), f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits", *loop]


def smi_samples(lines) -> np.ndarray:
    """nvidia-smi CSV lines of SMI_QUERY as a structured array (t: seconds since the epoch, read as
    this machine's local time like time.time(); sm_mhz; power_w; reasons). Lines that do not parse
    (a header, "[N/A]", a partial last line) are skipped."""
    dtype = np.dtype([("t", "f8"), ("sm_mhz", "f8"), ("power_w", "f8"), ("reasons", "i8")])
    out = []
    for line in lines:
        f = [x.strip() for x in line.split(",")]
        try:
            t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((t, float(f[1]), float(f[2]), int(f[3], 16)))
        except (ValueError, IndexError):
            continue
    return np.array(out, dtype)


PHASES = ("sequential", "fused", "sequential", "fused")  # per pass, after one warm-up phase
SMI_SETTLE_S = 1.0  # power.draw is a one-second average (NVML, Ampere and later): skip a phase's first second


def phase_power(samples: np.ndarray, t0: float, t1: float, settle_s: float = SMI_SETTLE_S) -> dict:
    """Mean SM clock and power of the samples taken in [t0 + settle_s, t1] (a phase of replays of
    one graph; during the first settle_s the averaged power still holds the phase before), and the
    fraction of them under the power cap. ValueError if there is none (the phase was shorter than
    settle_s plus a sampling period, or nvidia-smi gave no sample)."""
    s = samples[(samples["t"] >= t0 + settle_s) & (samples["t"] <= t1)]
    if not len(s):
        raise ValueError(f"no nvidia-smi sample in [{t0 + settle_s:.3f}, {t1:.3f}]: make the phase longer")
    return {"sm_mhz": float(s["sm_mhz"].mean()), "power_w": float(s["power_w"].mean()),
            "power_capped": float(np.mean((s["reasons"] & SMI_POWER_CAP) != 0)), "samples": int(len(s))}


def replay(graph, stream, secs: float):
    """Replays of `graph` on `stream` for about `secs` seconds, 20 a batch, each between two events:
    (ms per replay, start, end) with host times (time.time) around the timed replays."""
    import cupy

    for _ in range(5):
        graph.launch(stream)
    stream.synchronize()
    times, t0 = [], time.time()
    while time.time() - t0 < secs:
        events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(20)]
        for a, b in events:
            a.record(stream)
            graph.launch(stream)
            b.record(stream)
        stream.synchronize()
        times += [cupy.cuda.get_elapsed_time(a, b) for a, b in events]
    return times, t0, time.time()


def probe_shape(name: str, knobs, secs: float) -> tuple[list, list]:
    """One shape's phases (one EP=64 rank's share, mok_proto.bench.emulation): the sequential and
    the fused pass (plan.FusedKnobs `knobs`: the same for both passes) of the forward and of
    the backward each captured in a graph; after a warm-up phase, PHASES of one graph at a time
    replayed for `secs` seconds, a progress line each. Returns (phases: one dict each with its
    host times t0, t1 for phase_power; the passes whose fused results differ from the sequential)."""
    import cupy

    shape = emulated_shape(name)
    heap, layer = staged_layer(shape, make_inputs(shape))
    stream = cupy.cuda.Stream(non_blocking=True)
    graphs, reference, phases, unequal = {}, {}, [], []
    for pass_ in ("fwd", "bwd"):
        graphs["sequential", pass_] = layer.capture(forward=pass_ == "fwd", backward=pass_ == "bwd")
        reference[pass_] = result_bytes(layer, pass_)
    layer.set_forward_plan(layer.fused_forward_plan(knobs))
    layer.set_backward_plan(layer.fused_backward_plan(knobs))
    layer.enqueue_forward()
    layer.enqueue_backward()
    layer.check()
    graphs["fused", "fwd"] = layer.capture(forward=True, backward=False)
    layer.enqueue_forward()
    layer.check()  # (synchronizes: the eager forward ends before any replay)
    graphs["fused", "bwd"] = layer.capture(forward=False, backward=True)
    with stream:
        replay(graphs["sequential", "fwd"], stream, secs / 2)  # warm-up: to the power limit
        for pass_ in ("fwd", "bwd"):
            for k, schedule in enumerate(PHASES):
                times, t0, t1 = replay(graphs[schedule, pass_], stream, secs)
                layer.check()
                plan = (layer.fused if pass_ == "fwd" else layer.fused_bwd).plan
                phases.append(dict(shape=name, pass_=pass_, schedule=schedule, phase=k, t0=t0, t1=t1,
                                   median_ms=float(np.median(times)), iters=len(times),
                                   assign=plan.assign if schedule == "fused" else None,
                                   raster=plan.raster if schedule == "fused" else None,
                                   claim_pairs=plan.claim_pairs if schedule == "fused" else None))
                print(f"# {name} {pass_} {schedule:10s} {np.median(times):.3f} ms ({len(times)} replays)",
                      flush=True)
            if result_bytes(layer, pass_) != reference[pass_]:  # the fused graph replayed last
                unequal.append(f"{name} {pass_}")
    layer.set_forward_plan(None)
    layer.set_backward_plan(None)
    layer.close()
    heap.close()
    return phases, unequal


def compare(phases: list, shape: str, pass_: str):
    """(sequential, fused, ratios) of one shape and pass: each schedule's phases averaged (median_ms,
    sm_mhz, power_w, energy_mj, power_capped), and x_seq = sequential ms / fused ms, clock and energy
    = fused / sequential, x_cycles = sequential ms x MHz / (fused ms x MHz)."""
    mean = {s: {k: float(np.mean([ph[k] for ph in phases if (ph["shape"], ph["pass_"], ph["schedule"])
                                  == (shape, pass_, s)]))
                for k in ("median_ms", "sm_mhz", "power_w", "energy_mj", "power_capped")}
            for s in ("sequential", "fused")}
    seq, fus = mean["sequential"], mean["fused"]
    return seq, fus, {"x_seq": seq["median_ms"] / fus["median_ms"], "clock": fus["sm_mhz"] / seq["sm_mhz"],
                      "energy": fus["energy_mj"] / seq["energy_mj"],
                      "x_cycles": seq["median_ms"] * seq["sm_mhz"] / (fus["median_ms"] * fus["sm_mhz"])}
