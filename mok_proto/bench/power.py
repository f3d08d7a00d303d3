"""Power and clocks (scripts/power_probe.py): nvidia-smi sampled while one graph replays."""

from __future__ import annotations

import datetime

import numpy as np

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
