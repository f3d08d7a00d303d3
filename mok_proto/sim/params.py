"""GPU parameter sets of the simulator: `h200` and `h100` from their calibration files
(calibration/<name>.json, fitted on this project's results/ of that GPU by `python -m mok_proto.sim
calibrate --gpu <name>`, sim/calibrate.py; sim/gpus.py says which rows), `gb300_nvl72` from public
specifications and the H200's calibrated efficiencies.

This module holds the parameters and what they price; it reads no results (sim/calibrate.py does).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mok_proto import plan as plans
from mok_proto.abi import GEMM_PROBLEM
from mok_proto.config import MoEShape
from mok_proto.kernels.features import CURRENT
from mok_proto.plan import BM, BN  # the kernels' tile (mok_proto/abi.py)

PROBLEMS = tuple(text for _, text in GEMM_PROBLEM.members)  # the kernels' enum Problem, by name
TOKEN_TRAFFIC = ("gather_sum", "scatter", "stream")  # access patterns of the token kernels (GpuParams.token_kernel_ns)
CALIBRATION_DIR = Path(__file__).resolve().parent / "calibration"  # <gpu>.json: a calibrated GpuParams

# The kernel features a measurement ran (fields of its benchmark row and of its timeline's index
# row, mok_proto.results): how a communicating CTA of the fused kernel (comm_blocks > 0) moves its
# rows, comm_mover (GpuParams.comm_mover); how the fused kernel's counter waits spin, wait_spin; and
# scale_to_slots' access pattern, scale_traffic (GpuParams.scale_traffic). A measurement without
# them counts as the current kernel's (KERNEL).
COMM_MOVERS = ("warps", "bulk")  # every warp copies rows through registers | one thread drives bulk copies
WAIT_SPINS = ("acquire", "backoff")  # ld.acquire with short sleeps | relaxed loads, backoff, one fence
KERNEL = dict(CURRENT)  # the current default kernel's features (every new benchmark row records them)


def kernel_of(measurement) -> dict:
    """The kernel features (KERNEL's keys) of a benchmark row or a timeline's index row: its fields,
    KERNEL's where it has none."""
    return {k: measurement.get(k, v) for k, v in KERNEL.items()}


def spare_warps_spun(measurement, comm_blocks: int, spread_from: int | None = None) -> bool:
    """Whether a fused measurement (a benchmark row or a timeline's index row) ran the acquire spin in
    a pass whose compute CTAs' spare warps move rows (comm_blocks == 0, or outgoing transfers spread
    over every CTA): a pass the model, with no cost for spinning, predicts short (validate.SPUN)."""
    return kernel_of(measurement)["wait_spin"] == "acquire" and (not comm_blocks or spread_from is not None)


@dataclass(frozen=True)
class GpuParams:
    """One GPU of a scale-up domain. Rates in GB/s (1e9 B/s) and TFLOP/s; times in ns."""

    name: str
    num_sms: int
    tile_tflops_per_sm: dict  # problem -> TFLOP/s of one SM on 128 x 256 tiles
    hbm_read_gbs: float  # effective read rate of a row-copy kernel (all SMs)
    hbm_write_gbs: float  # effective write rate
    link_gbs: float  # per GPU, each way
    link_efficiency: dict  # "push" | "pull" -> fraction of link_gbs a row transfer reaches
    rtt_ns: float  # one round trip over the link (a pull pays it per in-flight load window)
    pull_window_bytes: int  # bytes one SM keeps in flight when it pulls
    sm_push_gbs: float  # stores one SM can post per second
    launch_ns: float  # a kernel boundary (sequential stages) or the start of a pass
    fence_ns: float  # the receiver's fence after every peer's signal arrived
    signal_ns_per_peer: float  # a receiver waits for one more peer's signal
    nccl_link_efficiency: dict = field(default_factory=dict)  # operator kind -> NCCL's fraction of link
    # Sustained load: tile rate when the GPU runs kernels back to back (a training step) over the
    # isolated rate of tile_tflops_per_sm (bench_gemm: each GEMM after an L2 flush and a GPU sleep).
    # Below 1 where the board's power limit lowers the SM clock under tensor-core load; memory-bound
    # kernels do not slow (bench_comm times them back to back already).
    sustained_gemm: float = 1.0
    # The fused kernel's GEMM tiles' rate as a fraction of sustained_gemm's (the same tiles beside
    # the movers and the counter waits): 1.0 unless the set fits it (gpus.GpuSpec.selectors
    # "fused_gemm": one shape's fused passes without a link, sim.fused.fit_fused_gemm).
    fused_gemm: float = 1.0
    row_move_efficiency: float = 1.0  # a row-movement kernel's rate on local rows / copy_gbs
    sum_slots_efficiency: float = 1.0  # weighted_sum / slot_sum HBM traffic rate / a copy's traffic rate
    busy_kernel_ns: float = 0.0  # a kernel boundary on a busy stream (launches queued ahead of the GPU)
    # The fused kernel's in-kernel transfers (cuda/fused.cuh), per CTA: a task (one chunk) costs a
    # fixed part (wait, row mapping, fences) plus its copy (`fused_chunk_copy_ns`). A communicating CTA
    # (comm_blocks > 0) by comm_mover (COMM_MOVERS):
    # * "warps" (the current kernel): its warps copy rows through registers (chunk_task), so a CTA
    #   moves bytes at a fixed rate whatever the row size: comm_cta_gbs per CTA, plus comm_task_ns
    #   per task;
    # * "bulk" (the retired ring): one thread moved rows through a shared-memory ring with a few rows
    #   in flight, waiting row by row, so a row cost the same time whatever its size: bulk_row_ns per
    #   row, plus bulk_task_ns per task.
    comm_mover: str = "warps"
    scale_traffic: str = "stream"  # scale_to_slots' access pattern (a TOKEN_TRAFFIC; `recorded_at`)
    comm_cta_gbs: float = 0.0
    comm_task_ns: float = 0.0
    bulk_row_ns: float = 0.0
    bulk_task_ns: float = 0.0
    # The spare warps of a compute CTA (warps of its producer warpgroup, fused plans with comm_blocks
    # == 0 or a spread outgoing transfer) copying rows through registers beside its GEMM tiles: per
    # byte like the communicating CTAs' warps, spare_cta_gbs per CTA, plus spare_task_ns per task.
    spare_cta_gbs: float = 0.0
    spare_task_ns: float = 0.0
    # The fused backward's token-side tasks on a CTA's movers (SCALE: dy_slots = w * dout; SLOT_SUM: the
    # slot sum and d topk_weights; token.cuh's device functions on a few warps): bound by those warps'
    # loads in flight, not by a share of the GPU's HBM rate. Per task, bytes read / token_read_gbs +
    # bytes written / token_write_gbs (fused_token_task_ns; the bytes: model.token_task_bytes). A
    # communicating CTA's warps are assumed to run them at the same rate. 0 (not fitted): their share of
    # the standalone kernels at the GPU's rate.
    token_read_gbs: float = 0.0
    token_write_gbs: float = 0.0
    note: str = ""

    @property
    def copy_gbs(self) -> float:
        """Rate of a plain device copy (bytes copied per second)."""
        return 1.0 / (1.0 / self.hbm_read_gbs + 1.0 / self.hbm_write_gbs)

    def tile_ns(self, problem: str, k, sustained: bool = True):
        """One BM x BN output tile of `problem` with reduction length k, on one SM: isolated (as
        bench_gemm times it) or under sustained load (sustained_gemm; what a layer pass sees)."""
        rate = self.tile_tflops_per_sm[problem] * (self.sustained_gemm if sustained else 1.0)
        return 2.0 * BM * BN * k / (rate * 1e3)

    def row_copy_ns(self, nbytes):
        """A row-movement kernel (pull dispatch, push or pull combine) copying nbytes of rows that
        stay in this GPU's HBM: each row is read once and written once."""
        return nbytes / (self.copy_gbs * self.row_move_efficiency)

    def token_kernel_ns(self, traffic: str, read_bytes, write_bytes):
        """A token kernel that reads and writes every byte once from HBM, by its access pattern
        (TOKEN_TRAFFIC):
        * "gather_sum": weighted_sum and slot_sum (cuda/token.cuh sum_slots: a token's K slot rows
          summed per 16-byte octet): sum_slots_efficiency of a copy's traffic rate;
        * "scatter": the retired scale_to_slots (a thread per slot octet: each token row read K
          times, K scaled rows written): the access pattern of a push dispatch (K - 1 of a row's K
          reads hit L2), so its read/write split hbm_read_gbs / hbm_write_gbs, fitted to one;
        * "stream": topk_weight_grad (reads only; no measurement of its own) and the current
          scale_to_slots (each token row read once, K scaled rows written): a copy's traffic rate;
          a plain copy reads and writes copy_gbs each.
        scale_to_slots takes `scale_traffic` (model.SCALE_TO_SLOTS)."""
        if traffic == "gather_sum":
            return (read_bytes + write_bytes) / (2.0 * self.copy_gbs * self.sum_slots_efficiency)
        if traffic == "scatter":
            return read_bytes / self.hbm_read_gbs + write_bytes / self.hbm_write_gbs
        if traffic == "stream":
            return (read_bytes + write_bytes) / (2.0 * self.copy_gbs)
        raise ValueError(f"traffic must be one of {', '.join(TOKEN_TRAFFIC)}, got {traffic!r}")

    def __post_init__(self):
        if self.comm_mover not in COMM_MOVERS:
            raise ValueError(f"comm_mover must be one of {', '.join(COMM_MOVERS)}, got {self.comm_mover!r}")
        if self.scale_traffic not in TOKEN_TRAFFIC:
            raise ValueError(f"scale_traffic must be one of {', '.join(TOKEN_TRAFFIC)}, got {self.scale_traffic!r}")

    def fused_task_ns(self, comm_blocks: int) -> float:
        """The fixed cost of one in-kernel communication task of a fused plan (comm_blocks == 0:
        the spare warps'; else the communicating CTAs' mover's, comm_mover)."""
        if not comm_blocks:
            return self.spare_task_ns
        return self.comm_task_ns if self.comm_mover == "warps" else self.bulk_task_ns

    def fused_chunk_copy_ns(self, comm_blocks: int, rows, row_bytes: int):
        """One CTA copying `rows` rows of `row_bytes` bytes inside the fused kernel, its copy alone
        (the task's fixed part: fused_task_ns): spare warps (comm_blocks == 0) and the warp movers
        per byte, the bulk ring per row (the comments on comm_mover and spare_cta_gbs). Raises
        ValueError when the mover's rate is not set."""
        rate = (self.spare_cta_gbs if not comm_blocks else
                self.comm_cta_gbs if self.comm_mover == "warps" else self.bulk_row_ns)
        if rate <= 0:
            raise ValueError(f"{self.name}: no in-kernel copy rate for a fused plan with comm_blocks={comm_blocks} "
                             f"(comm_mover {self.comm_mover!r}: GpuParams.comm_cta_gbs / bulk_row_ns / spare_cta_gbs)")
        if comm_blocks and self.comm_mover == "bulk":
            return rows * rate
        return rows * row_bytes / rate

    def fused_token_task_ns(self, read_bytes, write_bytes):
        """One fused-kernel token-side task on a CTA's movers (see token_read_gbs), or None when its
        rates are not set (the caller then prices it as its share of the standalone kernels)."""
        if self.token_read_gbs <= 0 or self.token_write_gbs <= 0:
            return None
        return read_bytes / self.token_read_gbs + write_bytes / self.token_write_gbs

    def recorded_at(self, measurement) -> "GpuParams":
        """These parameters with the kernel a measurement (a benchmark row or a timeline's index row,
        `kernel_of`) ran: its communicating CTAs' mover and scale_to_slots' traffic."""
        kernel = kernel_of(measurement)
        return dataclasses.replace(self, comm_mover=kernel["comm_mover"], scale_traffic=kernel["scale_traffic"])

    def pull_sm_gbs(self) -> float:
        """One SM pulling: one window per round trip."""
        return self.pull_window_bytes / self.rtt_ns

    def signal_wait_ns(self, num_ranks: int) -> float:
        """A receiver's wait for every peer's signal plus a fence (push semantics)."""
        return self.fence_ns + (num_ranks - 1) * self.signal_ns_per_peer

    def scaled(self, **factors) -> "GpuParams":
        """A copy with some numeric fields multiplied (for sensitivity checks)."""
        changes = {}
        for name, f in factors.items():
            value = getattr(self, name)
            changes[name] = {k: v * f for k, v in value.items()} if isinstance(value, dict) else value * f
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------
# Grouped GEMMs as the standalone kernels run them (bench_gemm): persistent CTAs, tiles handed
# out with a static stride; used to calibrate the tile rates and to predict the other rows.
# ---------------------------------------------------------------------------------------------


def gemm_tiles(problem: str, rows: np.ndarray, shape: MoEShape) -> tuple[np.ndarray, np.ndarray]:
    """(number of output tiles, reduction length) per expert of a grouped GEMM, rows [experts],
    with the plan's tiling of the routed task that runs this problem (`plan.tile_grid`,
    `num_col_tiles`, `wgrad_grid`)."""
    try:
        kind = plans.ROUTED_KIND_OF[problem]
    except KeyError:
        raise ValueError(f"unknown GEMM problem {problem!r}") from None
    ones = np.ones_like(rows)
    if problem.endswith("wgrad"):  # one expert's weight: fixed tiles, k = its rows
        row_tiles, col_tiles = plans.wgrad_grid(kind, shape)
        return ones * row_tiles * col_tiles, rows
    return -(-rows // BM) * plans.num_col_tiles(kind, shape), ones * plans.tile_grid(kind, shape)[2]


def grouped_gemm_ns(gpu: GpuParams, problem: str, rows: np.ndarray, shape: MoEShape,
                    num_ctas: int | None = None) -> float:
    """Makespan of a grouped GEMM as the standalone kernel runs it in bench_gemm (isolated tile
    rates): CTAs in clusters of two share a weight tile, so a cluster takes two row tiles of one
    expert (256 rows) at once; cluster-tile t of the expert-major list runs on cluster t %
    clusters. Weight gradients: one CTA per output tile, tile t on CTA t % num_ctas."""
    num_ctas = num_ctas or gpu.num_sms
    rows = np.asarray(rows, np.int64)
    counts, k = gemm_tiles(problem, rows, shape)
    if not problem.endswith("wgrad"):
        counts = counts // (-(-rows // BM)).clip(1) * -(-rows // (2 * BM))  # per 256-row pair
        num_ctas //= 2
    dur = np.repeat(gpu.tile_ns(problem, k, sustained=False), counts)  # ns, as bench_gemm times it
    return float(np.bincount(np.arange(len(dur)) % num_ctas, dur).max()) if len(dur) else 0.0


def params_to_json(gpu: GpuParams) -> dict:
    """The fields of `gpu` as JSON values (a calibration file's "params"; `params_from_json` reads them back)."""
    return dataclasses.asdict(gpu)


def params_from_json(fields: dict) -> GpuParams:
    """A GpuParams from its fields as `params_to_json` wrote them."""
    return GpuParams(**fields)


def calibration_file(name: str) -> Path:
    """The calibration file of GPU parameter set `name` (calibration/<name>.json)."""
    return CALIBRATION_DIR / f"{name}.json"


def calibrated(name: str) -> GpuParams:
    """The GPU parameter set `name` as its calibration file holds it (a new object per call)."""
    path = calibration_file(name)
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"gpu: no calibration file {path}: write it with "
                         f"python -m mok_proto.sim calibrate --gpu {name}") from None
    return params_from_json(document["params"])


def h200() -> GpuParams:
    """H200 (132 SMs) as calibrated on this project's results (calibration/h200.json)."""
    return calibrated("h200")


def h100() -> GpuParams:
    """H100 SXM (132 SMs) as calibrated on this project's H100 results (calibration/h100.json; its
    link and what no H100 measurement fits come from the h200 set: the file's sources)."""
    return calibrated("h100")


H200_DENSE_BF16_TFLOPS = 989.0  # H200 SXM dense BF16 (NVIDIA H200 datasheet), to carry GEMM efficiency over


def gb300_nvl72(h200_params: GpuParams | None = None) -> GpuParams:
    """One GPU of a GB300 NVL72 rack from public specifications; what is not published carries
    over from the H200 calibration (our kernels' efficiencies, launch and fence costs), except the
    H200's sustained-load factor (a property of that board under our layer: assumed 1 here)."""
    h = h200_params or h200()
    num_sms = 148  # the paper's GB300 runs 40 of 148 SMs for communication (MOK_NOTES); the full
    # Blackwell Ultra die has 160 SMs (NVIDIA, Hot Chips 2025 / "Inside NVIDIA Blackwell Ultra")
    dense_bf16_tflops = 2500.0  # GB300 dense FP16/BF16 per GPU, 2.5 PFLOPS (NVIDIA GB300 NVL72 spec table)
    hbm_gbs = 8000.0  # HBM3e, 8 TB/s per GPU (NVIDIA GB300 NVL72 spec)
    link_gbs = 900.0  # NVLink 5: 1.8 TB/s per GPU total, 900 GB/s each way (NVIDIA NVLink 5 spec)
    # GEMM: the H200 tile efficiency (fraction of dense peak per SM) carried over to the GB300 peak.
    scale = (dense_bf16_tflops / num_sms) / (H200_DENSE_BF16_TFLOPS / h.num_sms)
    hbm_scale = hbm_gbs / 4800.0  # H200 HBM3e is 4.8 TB/s (NVIDIA H200 datasheet)
    return dataclasses.replace(
        h, name="gb300-nvl72", num_sms=num_sms,
        # Assumed: the tiles run at the peak-derived rate (no sustained-load clock drop). The
        # H200's sustained_gemm is its own board's power limit under our layer, not a published
        # GB300 figure, so it is not carried over.
        sustained_gemm=1.0,
        tile_tflops_per_sm={p: v * scale for p, v in h.tile_tflops_per_sm.items()},
        hbm_read_gbs=h.hbm_read_gbs * hbm_scale, hbm_write_gbs=h.hbm_write_gbs * hbm_scale, link_gbs=link_gbs,
        # Through an NVLink switch a load round trip is longer than on a direct H200 pair: assumed
        # 1.5 us; each peer's signal is one ordered remote store behind a fence: one round trip.
        rtt_ns=1500.0, signal_ns_per_peer=1500.0,
        # The fused kernel's per-CTA copy rates (comm_cta_gbs, comm_task_ns, bulk_*, spare_cta_gbs, spare_task_ns)
        # and its movers' token-task rates (token_read_gbs, token_write_gbs) carry over unchanged (assumed): one
        # CTA's copies are bound by its issue rate and latency, not by HBM or the link (their shares still cap them, and a remote pull pays a round trip:
        # model._fused_chunk_ns).
        note="public specs (NVIDIA GB300 NVL72: 2.5 PF dense BF16, 8 TB/s HBM, NVLink 5 900 GB/s each way); "
             "our kernels' efficiencies (GEMM tiles vs peak, row moves and token sums vs a copy, link) and the fused "
             "kernel's per-CTA copy and token-task rates from the H200 calibration; no sustained-load factor (assumed)")


def nccl_links(gpu: GpuParams) -> GpuParams:
    """The same GPU with row transfers at NCCL all_to_all's measured link efficiency (the
    sequential NCCL-like baseline): dispatch-like and combine-like transfers."""
    eff = gpu.nccl_link_efficiency
    return dataclasses.replace(gpu, name=gpu.name + "+nccl", link_efficiency={"push": eff["dispatch"], "pull": eff["combine"]})


PARAMS = {"h200": h200, "h100": h100, "gb300-nvl72": gb300_nvl72}  # (the calibrated ones: sim.gpus.SPECS)


def get_params(name: str) -> GpuParams:
    try:
        return PARAMS[name]()
    except KeyError:
        raise ValueError(f"gpu: unknown parameter set {name!r}; choose one of {', '.join(PARAMS)}") from None
