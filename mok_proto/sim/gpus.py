"""The GPUs the simulator has calibrated parameter sets for, as data (`GpuSpec`, one per set in
SPECS): which results rows are the set's GPU's (a match on a row's `gpu` field), its SM count, and
which of those rows its fit reads (the selectors). sim/calibrate.py fits a set on them and
sim/validate.py judges every other row of that GPU with it.

Every row source of a fit and of --validate keeps one GPU's rows (`GpuSpec.measured`, the
`measured_on` argument of sim.layer, sim.fused, sim.calibrate and sim.validate), so a run on one GPU
never moves another GPU's fit nor is judged with its parameters. Two sources may be another set's:

* the link (results/x2: NVSHMEM between two GPUs, and the NCCL baseline beside it): the 2 x H200
  run is the only real link measurement, so every set takes its link from the h200's rows
  (`link_from`); its calibration file's sources say so;
* the fused kernel's in-kernel copy and token-task rates, fitted on the set's GPU's calibration
  timelines (index rows with sim_calibrates): a key without one for the GPU carries its fields
  over from the `fused_from` set's calibration file (None: a missing timeline is an error).

This module imports no other sim module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LEGACY_GPU = "NVIDIA H200"  # what a row or index row without `gpu` (or with null) ran on: every run before the field
# The rows a set is fitted on (sim/calibrate.py; the same for every set today), by source:
SELECTORS = {
    "gemm": ("kimi-k2.7", "uniform"),  # bench_gemm: one tile rate per GEMM problem, from these rows
    "hbm": ("kimi-k2.7", 8, "push"),  # bench_comm, one GPU: push dispatch (+ the copy ceiling of that run)
    "row_move": ("kimi-k2.7", 8),  # bench_comm, one GPU: pull dispatch, push combine and pull combine
    "link": "kimi-k2.7",  # x2/bench_comm, 2 GPUs: push and pull dispatch, and their 4-byte-row signal stages
    "layer": "kimi-k2.7",  # bench_layer's sequential stages of this shape (sim.layer.LAYER_CALIBRATION)
}
# A set may add "fused_gemm": a shape whose fused passes (bench_layer, no link) fit GpuParams.fused_gemm.
# Not measurable from our results, public or assumed (the calibration file's sources say so): an
# NVLink 4 load round trip, the bulk loads one SM keeps in flight, the stores one SM posts, one
# peer's signal. H100 SXM and H200 both have NVLink 4.
NVLINK4_ASSUMED = {"rtt_ns": 1000.0, "pull_window_bytes": 64 << 10, "sm_push_gbs": 100.0, "signal_ns_per_peer": 1000.0}


@dataclass(frozen=True)
class GpuSpec:
    name: str  # the parameter set (sim.params.PARAMS; calibration/<name>.json)
    match: str  # a row ran on this GPU when its `gpu` field contains this ("H200" in "NVIDIA H200")
    num_sms: int
    link_from: str  # the set whose GPU's 2-GPU rows the link is fitted on
    fused_from: str | None = None  # the set whose fused-kernel rates a key without a timeline takes
    selectors: dict = field(default_factory=lambda: dict(SELECTORS))
    assumed: dict = field(default_factory=lambda: dict(NVLINK4_ASSUMED))

    def measured(self, row: dict) -> bool:
        """Whether a results row (or a timeline's index row) ran on this set's GPU."""
        return self.match in (row.get("gpu") or LEGACY_GPU)


SPECS = {
    "h200": GpuSpec("h200", "H200", num_sms=132, link_from="h200"),
    # H100 SXM: 132 SMs. Its fused copy rates come from the h200's timelines; its fused tiles' rate
    # (GpuParams.fused_gemm) is fitted on one shape's fused passes, since no H100 timeline times them.
    "h100": GpuSpec("h100", "H100", num_sms=132, link_from="h200", fused_from="h200",
                    selectors=dict(SELECTORS, fused_gemm="kimi-k2.7")),
}


def spec(name: str) -> GpuSpec:
    """The calibrated set `name`'s GpuSpec (ValueError naming the sets otherwise)."""
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"gpu: no calibration for {name!r}; calibrated sets: {', '.join(SPECS)}") from None


def rows_on(rows: list[dict], name: str) -> list[dict]:
    """The rows (results rows or index rows) that ran on set `name`'s GPU."""
    gpu = spec(name)
    return [r for r in rows if gpu.measured(r)]
