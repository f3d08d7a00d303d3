"""The whole MoE layer on R GPUs (one process per GPU, NVSHMEM): ours, sequential and fused,
against the PyTorch + NCCL layer, push against pull per transfer, bitwise checks, in one run.

    NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 mpirun --bind-to none -n 2 python scripts/bench_layer_mpi.py [--shapes kimi-k2.7,...] [--iters 10] [--warmup 3]
    python scripts/bench_layer_mpi.py --single 2 --compare results/x2/digests_mpi.json

(on the device machine, as root with a carried nvshmem4py: README, "Multi-GPU", gives the command)

or the other way round:

    python scripts/bench_layer_mpi.py --single 2
    NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 mpirun --bind-to none -n 2 python scripts/bench_layer_mpi.py --compare results/x2/digests_single.json

The mpirun line measures (one process per GPU); --single R runs the same global problem in ONE
process on one GPU (R virtual ranks, mok_proto.symm.virtual; the sequential layer only, shapes
whose R ranks do not fit on one GPU skipped) and checks that every rank's results are bitwise
those of the R processes. Each mode writes its digests (--digests-out, default
<results-dir>/digests_mpi.json or digests_single.json) and compares with the other's (--compare),
so either order works: the second run prints and records (JSON lines) the comparison.
(--bind-to none: Open MPI binds each of 2 ranks to one core by default; the plan helper
processes below leave that binding anyway.)

Per paper shape (config.PAPER_SHAPES, N = 2048 tokens per rank, E/R experts per rank, uniform
random top-K routing identical on every rank; weights, x and dout generated on the GPU per rank
from seeded CuPy generators, the same in both modes):
  ours      GpuMoELayer over NvshmemHeap, MoK's policy. Sequential and fused (fused_forward /
            fused_backward plans, comm CTAs 0 and minibatch 1024 or 2048 rows: the faster one is
            reported) timed as CUDA-graph replays; passes alternate (the forward graph, then the
            backward graph), only the timed pass between events, every rank starting each
            iteration together (heap.barrier: device synchronize + host barrier).
  torch     scripts/bench_nccl_baseline.TorchNcclLayer: the layer with all_to_all_single for
            dispatch and combine (split sizes read by the host), torch._grouped_mm experts, the
            same weights (our buffers, zero copy; gate/up concatenated into a copy when it fits)
            and inputs; forward under no_grad, backward = t(forward + backward) - t(forward), as
            bench_layer.py defines it (no gradient accumulation across iterations). Its output and
            input gradient against ours: max |ours - torch| / max |torch| (loose, bf16).
  push/pull For each transfer (dispatch, combine, rev_combine, rev_dispatch), the sequential
            layer's eager stages (one event pair per stage) with that transfer push and pull, the
            other three at MoK's choice. overhead_ms = stage_ms - bytes / link: the stage beyond
            moving its bytes at the link rate measured in this run (a stage that moves no rows
            cannot be timed in this layer, so this stands in for the signalling cost);
            bytes = the most bf16 rows any rank sends to or receives from other ranks in one
            transfer. pct_link = bytes / stage time against that link.
  link      every rank copies 1 GiB from the next rank's symmetric buffer at once (NVSHMEM peer
            mapping, the same loads/stores as our transfers: the link used above) and a 1 GiB
            NCCL all_to_all_single (bench_nccl_baseline.link_ceiling_gbs), bytes leaving a GPU/s.
  bitwise   digests (mok_proto.bench.digest: SHA-256 over GPU-side fingerprints of out and every
            gradient, per rank) of every policy, of the sequential graph replays and of each fused
            setting must be equal; and equal to the single-process run's (--compare).
Every timing is the slowest rank's median (p20, p80) over --iters iterations after --warmup.
Order: first, shape by shape, our sequential layer and the torch layer; then, shape by shape on a
fresh layer with the same inputs, the fused passes (never run over NVSHMEM processes before: a
device error there cannot cost the other measurements). Every failure is printed by the rank it
happened on, recorded, and the run goes on with what the ranks can still do together.
The fused plans are built and proved (Plan.check, minutes of CPU for the backward plans of
large shapes) by --plan-workers helper processes per rank while the GPU runs the rest; each plan
on one rank (plan i on rank i % R), sent to the others when it is used.
Receive capacity: the exact padded need of this routing (layer.gpu.receive_capacity); symmetric
heap: NVSHMEM_SYMMETRIC_SIZE defaults to the largest shape's layer (layer.gpu.symmetric_bytes)
plus 10%. A shape whose layer does not fit in GPU memory is skipped with the reason; the
torch layer keeps its gate/up apart (no copy) when the copy does not fit, or is skipped.
Bars (issue 15): fused forward >= 1.5x and fused backward >= 1.4x the torch layer on every
shape; bitwise across policies, sequential and fused, and to the single process (when compared).
--no-torch (implied when ranks share a GPU, e.g. `mpirun -n 2` on one GPU: NVSHMEM's MPG mode, a
check of the whole flow whose timings are not those of 2 GPUs) runs our layer only: the bars are
not judged, the bitwise checks are, and the fused passes' speed-up over the sequential is printed.
Exit status: 0 all met; 1 a bar or a check failed, or a shape was skipped or failed (listed);
2 no GPU, CuPy, torch, NVSHMEM (nvshmem4py) or mpi4py, or a bad argument (one line).
Results: JSON lines appended to <results-dir>/bench_layer_mpi.jsonl (default results/x<R>): per
shape a record "partial (no fused pass yet)" after the first part and a "complete" one (every
figure, the bars judged unless --no-torch: "bars_judged", "missed") at the end; --single writes mode
"single" records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

from mok_proto.bench import RESULTS_DIR, append_result, digest, git_sha  # noqa: E402
from mok_proto.config import (DIRECTIONS, MOK_POLICY, OPERATORS, PAPER_SHAPES, RunConfig, format_policy,  # noqa: E402
                              get_shape)
from mok_proto.layer.gpu import layer_row_layout, receive_capacity, round_layout, symmetric_bytes  # noqa: E402
from mok_proto.plan import FusedKnobs  # noqa: E402

BARS = {"fwd": 1.5, "bwd": 1.4}  # fused pass vs the torch + NCCL layer (issue 15)
FUSED_SETTINGS = "0:1024,0:2048"  # (communication CTAs, minibatch rows) of the fused passes
PASS_OF = {"dispatch": "fwd", "combine": "fwd", "rev_combine": "bwd", "rev_dispatch": "bwd"}  # stage -> pass
TIMEOUT_S = 60.0  # every device wait of the layer (the first pass compiles kernels)
HEAP_TIMEOUT_S = 60.0  # host barriers between ranks
NCCL_TIMEOUT_S = 120.0  # every NCCL collective of the torch layer (a failed peer ends the job, not the call)
MARGIN_BYTES = 4 << 30  # device memory left free beside an estimate (contexts, caches, temporaries)
WEIGHT_CHUNK_BYTES = 1 << 30  # float32 temporary while generating weights
SHARED_STREAM = 999  # the shared expert's generator: seed * 1000 + 999 (rank r's: seed * 1000 + r)
TORCH_REL_ERR = 5e-2  # max |ours - torch| / max |torch| (out, dx) beyond which the baseline is not the same layer
PROBE_TIMEOUT_S = 120.0  # a plan helper process must answer within this (else plans are proved inline)


# ---------------------------------------------------------------------------------------------
# Inputs: the same on every rank and in both modes
# ---------------------------------------------------------------------------------------------
def make_routing(shape, num_ranks: int, seed: int):
    """Every rank's routing, built identically by every process from `seed`: topk_idx [R,N,K]
    int32 (K distinct experts, uniform) and topk_weights [R,N,K] float32 (rows sum to 1)."""
    rng = np.random.default_rng(seed)
    n, k, e = shape.num_tokens, shape.top_k, shape.num_experts
    topk = np.argsort(rng.random((num_ranks * n, e), dtype=np.float32), axis=1)[:, :k].astype(np.int32)
    w = rng.random((num_ranks * n, k), dtype=np.float32) + np.float32(0.5)
    w /= w.sum(axis=1, keepdims=True)
    return topk.reshape(num_ranks, n, k), w.reshape(num_ranks, n, k)


def crossing_bytes(topk, num_experts: int, hidden: int) -> int:
    """Bytes of bf16 rows one transfer moves over a GPU's links in one direction, for the busiest
    rank: max over ranks of the rows it sends to, or receives from, other ranks (the reverse
    transfer moves the same rows back)."""
    num_ranks = topk.shape[0]
    owner = topk // (num_experts // num_ranks)  # [R, N, K]
    source = np.arange(num_ranks)[:, None, None]
    sent = (owner != source).sum(axis=(1, 2))
    received = [int(((owner == r) & (source != r)).sum()) for r in range(num_ranks)]
    return int(max(sent.max(), max(received))) * hidden * 2


def fill_layer(layer, rank: int, topk, topk_w, seed: int) -> None:
    """Rank `rank`'s weights, inputs and output gradient, generated on the GPU: its routed experts
    (chunks of experts, normal * fan_in^-0.5), x and dout (standard normal) from
    cupy.random.default_rng(seed * 1000 + rank), the shared expert (the same on every rank) from
    seed * 1000 + SHARED_STREAM. Deterministic, so both modes build the same problem."""
    import cupy

    s = layer.shape
    h, i, i_shared = s.hidden, s.ffn, s.shared_ffn_size
    rng = cupy.random.default_rng(seed * 1000 + rank)
    for key, dims in (("w_gate", (h, i)), ("w_up", (h, i)), ("w_down", (i, h))):
        per = max(1, WEIGHT_CHUNK_BYTES // (4 * dims[0] * dims[1]))
        for first in range(0, layer.num_local, per):
            num = min(per, layer.num_local - first)
            layer.set_weight_part(rank, key, rng.standard_normal((num,) + dims, dtype=np.float32) * dims[0] ** -0.5,
                                  first)
    x = rng.standard_normal((s.num_tokens, h), dtype=np.float32)
    dout = rng.standard_normal((s.num_tokens, h), dtype=np.float32)
    layer.set_inputs(rank, x, topk[rank], topk_w[rank])
    layer.set_dout(rank, dout)
    if layer.has_shared:
        shared = cupy.random.default_rng(seed * 1000 + SHARED_STREAM)
        for key, dims in (("shared_gate", (h, i_shared)), ("shared_up", (h, i_shared)), ("shared_down", (i_shared, h))):
            layer.set_weight_part(rank, key, shared.standard_normal(dims, dtype=np.float32) * dims[0] ** -0.5)


def result_digests(layer, rank: int) -> dict:
    """{"out": digest of the output, "grads": of every gradient} of `rank` (no host copy)."""
    views = layer.result_views(rank)
    out = views.pop("out")
    return {"out": digest({"out": out}), "grads": digest(views)}


class Problem:
    """One shape's global problem: routing of every rank, receive capacity, bytes per transfer."""

    def __init__(self, name: str, tokens: int | None, num_ranks: int, seed: int):
        paper = get_shape(name)
        self.name, self.shape = name, paper if tokens is None else paper.with_tokens(tokens)
        self.num_ranks, self.seed = num_ranks, seed
        if self.shape.num_experts % num_ranks:
            raise ValueError(f"{name}: E={self.shape.num_experts} experts are not divisible by R={num_ranks} ranks")
        self.topk, self.topk_w = make_routing(self.shape, num_ranks, seed)
        self.capacity = receive_capacity(self.topk, self.shape.num_experts)
        self.run = RunConfig(self.shape, num_ranks, timeout_s=TIMEOUT_S)
        self.layer_bytes = symmetric_bytes(self.run, self.capacity)
        self.crossing_bytes = crossing_bytes(self.topk, self.shape.num_experts, self.shape.hidden) \
            if num_ranks > 1 else 0

    def array_names(self) -> list:
        """The symmetric arrays of this shape's GpuMoELayer (name=self.name), in alloc order."""
        layout = {**round_layout(self.run, self.capacity),
                  **layer_row_layout(self.shape, self.run.num_local_experts, self.capacity)}
        return [f"{self.name}.{key}" for key in layout]

    def config(self) -> dict:
        s = self.shape
        return {"shape": self.name, "ranks": self.num_ranks, "tokens_per_rank": s.num_tokens, "hidden": s.hidden,
                "ffn": s.ffn, "experts": s.num_experts, "local_experts": s.num_experts // self.num_ranks,
                "top_k": s.top_k, "shared_ffn": s.shared_ffn_size if s.num_shared else 0, "seed": self.seed,
                "capacity": self.capacity, "layer_bytes": self.layer_bytes, "crossing_bytes": self.crossing_bytes}


# ---------------------------------------------------------------------------------------------
# Arguments, digests files, the comparison
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(PAPER_SHAPES))
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: the shape's, 2048)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--single", type=int, default=None, metavar="R",
                   help="one process, one GPU, R virtual ranks: digests of the sequential layer only")
    p.add_argument("--fused", default=FUSED_SETTINGS, help="fused settings COMM:MINIBATCH[,...] ('' = none)")
    p.add_argument("--no-torch", action="store_true",
                   help="our layer only: no torch + NCCL layer and no NCCL link ceiling, so the bars are not judged "
                        "(the bitwise checks are). Implied when ranks share a GPU (NCCL refuses that)")
    p.add_argument("--plan-workers", type=int, default=3,
                   help="helper processes per rank proving fused plans (a large backward plan: ~1-2 min, ~20 GB RAM)")
    p.add_argument("--plan-timeout", type=float, default=300.0, help="seconds to wait for one fused plan")
    p.add_argument("--results-dir", default=None, help="JSON lines and digests go here (default results/x<R>)")
    p.add_argument("--digests-out", default=None, help="this run's digests (default <results-dir>/digests_<mode>.json)")
    p.add_argument("--compare", default=None, help="digests file of the other mode to compare with")
    args = p.parse_args(argv)
    try:
        args.shapes = [name.strip() for name in args.shapes.split(",") if name.strip()]
        if not args.shapes:
            raise ValueError("--shapes: no shape given")
        for name in args.shapes:
            get_shape(name)
        args.fused = [tuple(int(v) for v in item.split(":")) for item in args.fused.split(",") if item.strip()]
        if any(len(item) != 2 or item[0] < 0 or item[1] <= 0 for item in args.fused):
            raise ValueError("--fused: expected COMM:MINIBATCH[,...] with COMM >= 0, MINIBATCH > 0")
        try:
            [FusedKnobs(*item) for item in args.fused]  # the fused plans' own checks of the two knobs
        except ValueError as e:
            raise ValueError(f"--fused: {e}") from None
        for name, value, low in (("--iters", args.iters, 1), ("--warmup", args.warmup, 0),
                                 ("--plan-workers", args.plan_workers, 1), ("--tokens", args.tokens, 1),
                                 ("--single", args.single, 1)):
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if args.compare and not Path(args.compare).is_file():
            raise ValueError(f"--compare: no file {args.compare}")
    except ValueError as e:
        p.error(str(e))
    return args


def results_dir(args, num_ranks: int) -> Path:
    return Path(args.results_dir) if args.results_dir else RESULTS_DIR / f"x{num_ranks}"


def write_digests(path: Path, mode: str, num_ranks: int, shapes: dict) -> None:
    """shapes: {name: {"config": {...}, "per_rank": {rank: {"out", "grads"}}} or {"config", "skipped"}}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"mode": mode, "ranks": num_ranks, "git": git_sha(), "shapes": shapes}, indent=1))


def compare_digests(mine: dict, path, mode: str) -> dict:
    """{shape: True (every rank equal) | False | None (not comparable: reason in 'why')} against the
    digests file of the other mode. Same problem = same shape, R, tokens per rank, seed, capacity."""
    other = json.loads(Path(path).read_text())
    out = {}
    for name, got in mine.items():
        theirs = other.get("shapes", {}).get(name)
        keys = ("ranks", "tokens_per_rank", "seed", "capacity")
        if other.get("mode") == mode:
            out[name] = {"equal": None, "why": f"{path} holds digests of the same mode ({mode})"}
        elif theirs is None:
            out[name] = {"equal": None, "why": f"{name} not in {path}"}
        elif "per_rank" not in theirs or "per_rank" not in got:
            # a shape skipped by a documented choice (e.g. --single: R ranks do not fit one GPU) is
            # not a failure; any other missing comparison is (judge)
            skipped = all("skipped" in entry for entry in (got, theirs) if "per_rank" not in entry)
            out[name] = {"equal": None, "skipped": skipped, "why": "no digests: " + "; ".join(
                f"{who}: {entry.get('skipped') or entry.get('error') or '?'}" for who, entry in (("this run", got),
                                                                                              (str(path), theirs))
                if "per_rank" not in entry)}
        elif any(theirs["config"].get(k) != got["config"].get(k) for k in keys):
            out[name] = {"equal": None, "why": "a different problem: " + ", ".join(
                f"{k} {got['config'].get(k)} vs {theirs['config'].get(k)}" for k in keys)}
        else:
            ranks = {r: got["per_rank"][r] == theirs["per_rank"].get(r) for r in got["per_rank"]}
            out[name] = {"equal": all(ranks.values()), "ranks": ranks, "other": str(path)}
    return out


def describe_comparison(result) -> str:
    if result is None:
        return "n/a"
    if result["equal"] is None:
        return f"not compared ({result['why']})"
    if result["equal"]:
        return "equal"
    return "DIFFERS on ranks " + ",".join(r for r, ok in result["ranks"].items() if not ok)


# ---------------------------------------------------------------------------------------------
# One process, R virtual ranks: the digests of the sequential layer
# ---------------------------------------------------------------------------------------------
def main_single(args) -> int:
    from mok_proto.bench import require_gpu

    require_gpu("bench_layer_mpi.py --single")
    import cupy

    num_ranks = args.single
    out_dir = results_dir(args, num_ranks)
    digests_path = Path(args.digests_out) if args.digests_out else out_dir / "digests_single.json"
    print(f"# bench_layer_mpi --single {num_ranks}: {num_ranks} virtual ranks on {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"sequential layer, policy {format_policy(MOK_POLICY)}, seed {args.seed}", flush=True)
    shapes, failed = {}, []
    for name in args.shapes:
        entry = shapes[name] = single_shape(name, args, num_ranks)
        if "error" in entry:
            failed.append(f"{name}: {entry['error']}")
        write_digests(digests_path, "single", num_ranks, shapes)  # after every shape: a stopped run keeps them
        result = compare_digests({name: entry}, args.compare, "single")[name] if args.compare else None
        if result is not None and result["equal"] is False:
            failed.append(f"{name}: differs from {args.compare}")
        elif result is not None and result["equal"] is None and not result.get("skipped"):
            failed.append(f"{name}: not compared with {args.compare} ({result['why']})")
        print(f"{name:<18} {'skipped: ' + entry['skipped'] if 'skipped' in entry else entry.get('error', 'ok')}; "
              f"vs the R processes: {describe_comparison(result)}", flush=True)
        append_result("bench_layer_mpi", {"mode": "single", **entry["config"], **{k: v for k, v in entry.items()
                                                                                  if k != "config"},
                                          "bitwise_vs_mpi": result}, out_dir)
    print(f"# digests: {digests_path}", flush=True)
    if failed:
        print(f"FAIL: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def single_shape(name: str, args, num_ranks: int) -> dict:
    """One shape on R virtual ranks: {"config", "per_rank": digests} or {"config", "skipped" | "error"}."""
    import cupy

    from mok_proto.layer.gpu import GpuMoELayer
    from mok_proto.symm.virtual import VirtualWorld

    start = time.time()
    try:
        prob = Problem(name, args.tokens, num_ranks, args.seed)
    except ValueError as e:
        return {"config": {"shape": name}, "skipped": str(e)}
    entry = {"config": prob.config()}
    cupy.get_default_memory_pool().free_all_blocks()
    free = cupy.cuda.runtime.memGetInfo()[0]
    need = num_ranks * prob.layer_bytes + MARGIN_BYTES
    if need > free:
        entry["skipped"] = (f"{num_ranks} virtual ranks need {need / 1e9:.1f} GB with the margin, the GPU has "
                            f"{free / 1e9:.1f} GB free")
        return entry
    world = layer = None
    try:
        world = VirtualWorld(num_ranks)
        layer = GpuMoELayer(world, prob.run, capacity=prob.capacity, name=name)
        for rank in range(num_ranks):
            fill_layer(layer, rank, prob.topk, prob.topk_w, args.seed)
        layer.enqueue_forward()
        layer.enqueue_backward()
        layer.check()
        entry["per_rank"] = {str(rank): result_digests(layer, rank) for rank in range(num_ranks)}
        print(f"# {name}: {time.time() - start:.1f} s, capacity {prob.capacity} rows, digests of {num_ranks} ranks",
              flush=True)
    except Exception as e:  # noqa: BLE001 - recorded, the next shape still runs
        traceback.print_exc()
        entry["error"] = f"{type(e).__name__}: {e}"
    finally:
        try:
            if layer is not None:
                layer.close()
            if world is not None:
                world.close()
        except Exception as e:  # noqa: BLE001 - after a device error freeing can fail too
            entry.setdefault("error", f"freeing failed: {type(e).__name__}: {e}")
        layer = world = None
        cupy.get_default_memory_pool().free_all_blocks()
    return entry


# ---------------------------------------------------------------------------------------------
# R processes: the benchmark
# ---------------------------------------------------------------------------------------------
class Ranks:
    """What every step of the MPI mode shares: the communicator, the heap, printing on rank 0,
    and phases whose failure every rank learns of, so that all ranks take the same path after it
    (the same collectives in the same order)."""

    def __init__(self, comm, heap, per_gpu: int = 1):
        self.comm, self.heap = comm, heap
        self.rank, self.num_ranks, self.lead = comm.rank, comm.size, comm.rank == 0
        self.per_gpu = per_gpu  # the most ranks on one GPU (each allocates its own layer there; every rank agrees)

    def say(self, text: str) -> None:
        if self.lead:
            print(text, flush=True)

    def phase(self, row: dict, name: str, fn):
        """fn() on every rank: (True, its value) if it succeeded on every rank, else (False, None),
        each failing rank's error printed by that rank (with its traceback) and recorded in row.
        RULE: fn calls no MPI collective (a rank that raised before it would be at this phase's
        allgather instead): the reductions (slowest, max, ...) come after a phase that succeeded.
        Inside fn only heap.barrier (bounded: it raises PeerTimeoutError past HEAP_TIMEOUT_S),
        symmetric allocations and frees, and NCCL calls (bounded by NCCL_TIMEOUT_S), each after a
        phase boundary where every rank agreed that its setup succeeded. NOTE: not bounded: an
        allocation's own allgather and NVSHMEM's collective alloc/free (a rank failing inside
        them hangs its peer), and an error outside any phase (main() then aborts the job)."""
        try:
            value, error = fn(), None
        except Exception as e:  # noqa: BLE001 - every failure is reported and the run goes on
            value, error = None, f"{type(e).__name__}: {e}"
            traceback.print_exc()
            print(f"# rank {self.rank}: {row.get('shape', '')}: {name} FAILED: {error}", flush=True)
        return self._agree(row, name, self.comm.allgather(error), value)

    def _agree(self, row: dict, name: str, errors: list, value):
        """(True, value) if no rank has an error, else (False, None) and the errors recorded in row
        (and the arrival barriers resynchronized: called by every rank with the same errors)."""
        if any(errors):
            row.setdefault("errors", []).append({"phase": name, "ranks": {str(r): e for r, e in enumerate(errors) if e}})
            self.resync_barriers()
            return False, None
        return True, value

    def resync_barriers(self) -> None:
        """Drop the arrival tokens a failed phase left in flight and agree on the barrier count
        (watchdog.resync_arrivals): a rank whose heap.barrier timed out (its peer had failed
        elsewhere) sent a token the peer never took, and counted a barrier the peer did not."""
        from mok_proto.symm.watchdog import resync_arrivals

        for p, stale in resync_arrivals(self.comm).items():
            if stale:
                print(f"# rank {self.rank}: dropped {stale} stale barrier arrival(s) of rank {p}", flush=True)

    def shared(self, row: dict, name: str, fn, root: int):
        """fn() on rank `root` only, its value (pickled) sent to every rank: (True, value) on every
        rank, or (False, None) with root's error recorded in row on every rank."""
        value = error = None
        if self.rank == root:
            try:
                value = fn()
            except Exception as e:  # noqa: BLE001 - reported on every rank, the run goes on
                error = f"{type(e).__name__}: {e}"
                traceback.print_exc()
                print(f"# rank {self.rank}: {row.get('shape', '')}: {name} FAILED: {error}", flush=True)
        value, error = self.comm.bcast((value, error), root=root)
        return self._agree(row, name, [error if r == root else None for r in range(self.num_ranks)], value)

    def release(self, row: dict, names) -> None:
        """Free the symmetric arrays of `names` (in alloc order) that a failed allocation, fill or
        free left in heap.arrays, collectively: those every rank holds are freed, in the same
        order on every rank; any left after that (held by some ranks only, or a free failed) are
        forgotten (their memory stays mapped; their names can be allocated again)."""
        arrays = self.heap.arrays
        everyone = self.comm.allgather([name for name in names if name in arrays])
        common = [name for name in everyone[0] if all(name in held for held in everyone)]
        if common:
            self.say(f"#   freeing {len(common)} symmetric arrays left by a failure")
            self.phase(row, "free what a failure left", lambda: [self.heap.free(arrays[name]) for name in common])
        lost = [name for name in names if name in arrays]
        for name in lost:
            del arrays[name]
        if lost:
            print(f"# rank {self.rank}: {len(lost)} symmetric arrays forgotten, not freed: {lost}", flush=True)

    def slowest(self, stats: dict) -> dict:
        from mok_proto.bench import slowest_rank

        return slowest_rank(stats, self.comm)

    def max(self, value):
        from mpi4py import MPI

        return self.comm.allreduce(value, op=MPI.MAX)

    def min(self, value):
        from mpi4py import MPI

        return self.comm.allreduce(value, op=MPI.MIN)

    def free_bytes(self) -> int:
        """The smallest free device memory over the ranks, CuPy's and torch's caches emptied."""
        import cupy
        import torch

        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
        return int(self.min(cupy.cuda.runtime.memGetInfo()[0]))


def gpu_sharing(bus_ids) -> int:
    """The most ranks on one GPU, from every rank's GPU (PCI bus id; an allgather): each of them
    allocates a layer there, and NCCL refuses a GPU shared by two ranks."""
    return max(list(bus_ids).count(b) for b in bus_ids)


def implied_no_torch(args, num_ranks: int, per_gpu: int):
    """Ranks sharing a GPU (NVSHMEM's MPG mode: a check of the whole flow, kernels of different
    processes time-slice) run as --no-torch, since NCCL refuses them: sets args.no_torch and
    returns the line to print, or None."""
    if per_gpu <= 1 or args.no_torch:
        return None
    args.no_torch = True
    return (f"# {num_ranks} ranks, up to {per_gpu} on one GPU: no torch + NCCL layer (NCCL refuses a shared GPU; "
            f"as --no-torch), and the timings are not those of {num_ranks} GPUs")


def require_mpi_stack() -> None:
    """Exit 2 with one line unless mpi4py and nvshmem4py import (after require_gpu)."""
    for module, what in (("mpi4py", "mpi4py (the ranks)"), ("nvshmem.core", "nvshmem4py (nvshmem4py-cu13)")):
        try:
            __import__(module)
        except Exception as e:  # noqa: BLE001 - any import failure means it is not usable here
            print(f"error: bench_layer_mpi.py needs {what}; import {module} failed ({type(e).__name__}: {e}); "
                  f"without them only --single R runs", file=sys.stderr)
            sys.exit(2)


def start_plans(problems, settings, num_sms: dict, workers: int, rank: int = 0, num_ranks: int = 1):
    """Helper processes (spawned; each may use every CPU) that build and prove this rank's share
    of the fused plans, in shape order: plan i of every (shape, pass, setting) is proved by rank
    i % num_ranks (its prover), which sends it to the others (Ranks.shared). Returns (pool,
    {(shape, pass, comm CTAs, minibatch rows): (prover, AsyncResult of the checked plan on the
    prover, None elsewhere)})."""
    import multiprocessing

    from mok_proto.bench import use_all_cpus
    from mok_proto.layer.gpu import fused_plan

    keys = [(prob, pass_, comm_blocks, minibatch)
            for prob in problems for pass_ in ("fwd", "bwd") for comm_blocks, minibatch in settings]
    roots = {(prob.name, *rest): i % num_ranks for i, (prob, *rest) in enumerate(keys)}
    jobs = {(prob.name, pass_, comm_blocks, minibatch): (pass_, prob.run, prob.capacity, dict(MOK_POLICY),
                                                         FusedKnobs(comm_blocks, minibatch), num_sms[pass_])
            for prob, pass_, comm_blocks, minibatch in keys if roots[prob.name, pass_, comm_blocks, minibatch] == rank}
    if not jobs:
        return None, {key: (root, None) for key, root in roots.items()}
    pool = multiprocessing.get_context("spawn").Pool(workers, initializer=use_all_cpus, maxtasksperchild=1)
    try:
        pool.apply_async(os.getpid).get(PROBE_TIMEOUT_S)  # the helpers start (import, unpickle) at all
    except Exception as e:  # noqa: BLE001 - then this process proves each plan when it needs it
        print(f"# rank {os.environ.get('OMPI_COMM_WORLD_RANK', '?')}: plan helper processes do not answer "
              f"({type(e).__name__}: {e}); the fused plans are proved inline (slower)", flush=True)
        pool.terminate()
        pool.join()
        return None, {key: (root, InlinePlan(jobs[key]) if key in jobs else None) for key, root in roots.items()}
    return pool, {key: (root, pool.apply_async(fused_plan, jobs[key], {"check": True}) if key in jobs else None)
                  for key, root in roots.items()}


class InlinePlan:
    """A fused plan built and proved in this process when asked for (AsyncResult's get)."""

    def __init__(self, args):
        self.args = args

    def get(self, timeout=None):
        from mok_proto.layer.gpu import fused_plan

        return fused_plan(*self.args, check=True)


def eager_step(layer, heap) -> None:
    """One forward and backward, every rank starting together (the first compiles the kernels
    and uploads their descriptors)."""
    heap.barrier()
    layer.enqueue_forward()
    layer.enqueue_backward()
    layer.check()


def graphs_of(layer, heap):
    """(forward graph, backward graph) of the layer's current plans, after one eager step."""
    eager_step(layer, heap)
    return layer.capture(backward=False), layer.capture(forward=False)


def time_graphs(ranks, layer, graphs, pass_: str, iters: int, warmup: int) -> dict:
    """Replays alternate (forward graph, backward graph); the events bracket `pass_` only; every
    iteration starts on all ranks together. This rank's stats (a phase body: the caller takes
    the slowest rank's after the phase)."""
    import cupy

    from mok_proto.bench import summarize, time_stages

    stream = cupy.cuda.Stream(non_blocking=True)

    def one(mark):
        ranks.heap.barrier()
        for name, graph in zip(("fwd", "bwd"), graphs):
            if name == pass_:
                mark("run")
            graph.launch(stream)
            if name == pass_:
                mark(None)

    with stream:
        samples = time_stages(one, iters, warmup)
        stream.synchronize()
    layer.check()
    return summarize(samples["run"])


def time_eager_stages(ranks, layer, iters: int, warmup: int) -> dict:
    """{pass: {stage: stats}} of the layer's eager passes under its policy: events at the stages
    of the timed pass, both passes every iteration, every iteration starting on all ranks
    together; this rank's (a phase body: the caller takes the slowest rank's after the phase)."""
    from mok_proto.bench import summarize, time_stages

    out = {}
    for pass_ in ("fwd", "bwd"):
        def one(mark, pass_=pass_):
            ranks.heap.barrier()
            layer.enqueue_forward(mark if pass_ == "fwd" else None)
            layer.enqueue_backward(mark if pass_ == "bwd" else None)

        samples = time_stages(one, iters, warmup)
        layer.check()
        out[pass_] = {stage: summarize(v) for stage, v in samples.items()}
    return out


def policies_to_time() -> dict:
    """{label: policy}: MoK's, then each transfer flipped (the others at MoK's choice)."""
    out = {"mok": dict(MOK_POLICY)}
    for op in OPERATORS:
        for direction in DIRECTIONS:
            if direction != MOK_POLICY[op]:
                out[f"{op}={direction}"] = {**MOK_POLICY, op: direction}
    return out


def push_pull(stages: dict, nbytes: int, link_gbs: float) -> dict:
    """{op: {direction: stage_ms, overhead_ms, pct_link, ...}} from the eager stages of each policy
    (overhead = the stage beyond moving `nbytes` at the link rate)."""
    wire_ms = nbytes / (link_gbs * 1e9) * 1e3 if link_gbs > 0 else 0.0  # nan (no link): False -> 0
    out = {}
    for op in OPERATORS:
        out[op] = {}
        for direction in DIRECTIONS:
            label = "mok" if MOK_POLICY[op] == direction else f"{op}={direction}"
            if label in stages:
                ms = stages[label][PASS_OF[op]][op]["median_ms"]
                out[op][direction] = {"stage_ms": ms, "overhead_ms": ms - wire_ms, "bytes": nbytes,
                                      "pct_link": 100 * wire_ms / ms if ms > 0 else float("nan"), "policy": label}
    return out


def run_sequential(ranks, prob, layer, args, row: dict) -> dict:
    """Our sequential layer: push/pull eager stages per policy, the passes as graph replays,
    digests; fills row. Returns the output and input gradient (float32 copies, for the torch
    comparison), {} if it failed before them."""
    from mok_proto.kernels import gemm

    rank, heap, say = ranks.rank, ranks.heap, ranks.say
    say("#   first step (the first shape compiles the kernels)")
    ok, _ = ranks.phase(row, "first step (compiles)", lambda: eager_step(layer, heap))
    if not ok:
        return {}
    # Push vs pull: eager stages of the sequential layer, one transfer flipped at a time.
    digests, stages, ours = {}, {}, {}
    for label, policy in policies_to_time().items():
        def timed(policy=policy):
            layer.policy = dict(policy)
            got = time_eager_stages(ranks, layer, args.iters, args.warmup)
            return got, result_digests(layer, rank)

        ok, got = ranks.phase(row, f"stages {label}", timed)
        if not ok:
            return ours
        got = ({pass_: ranks.slowest(by) for pass_, by in got[0].items()}, got[1])
        stages[label], digests[label] = got
        say(f"#   eager passes, {label}: fwd {got[0]['fwd']['total']['median_ms']:.3f} ms, bwd "
            f"{got[0]['bwd']['total']['median_ms']:.3f} ms")
        if label == "mok":
            ours = {"out": layer.output(rank), "dx": gemm.from_bf16(layer.result_views(rank)["x"])}
    layer.policy = dict(MOK_POLICY)
    row["stages_ms"] = {label: {p: {stage: st["median_ms"] for stage, st in by.items()} for p, by in got.items()}
                        for label, got in stages.items()}
    row["push_pull"] = push_pull(stages, prob.crossing_bytes, row["link"]["nvshmem_pull_gbs"])
    say("#   push/pull, eager stage ms (+ beyond the bytes at link rate): " + "; ".join(
        f"{op} " + ", ".join(f"{d} {v['stage_ms']:.3f} (+{v['overhead_ms']:.3f})" for d, v in by.items())
        for op, by in row["push_pull"].items()))
    # The passes as graph replays.
    ok, graphs = ranks.phase(row, "sequential graphs", lambda: graphs_of(layer, heap))
    if not ok:
        return ours
    seq = {}
    for pass_ in ("fwd", "bwd"):
        ok, st = ranks.phase(row, f"sequential {pass_}", lambda p=pass_: time_graphs(
            ranks, layer, graphs, p, args.iters, args.warmup))
        if not ok:
            return ours
        seq[pass_] = ranks.slowest({"run": st})["run"]
    digests["sequential graphs"] = result_digests(layer, rank)
    row["ours"] = {"sequential": seq, "fused": {"fwd": [], "bwd": []}}
    say(f"#   ours sequential (graphs): fwd {seq['fwd']['median_ms']:.3f} ms, bwd {seq['bwd']['median_ms']:.3f} ms")
    record_digests(ranks, row, digests)
    return ours


def record_digests(ranks, row: dict, digests: dict) -> None:
    """Every rank's {label: digests} into row["bitwise"] (each label against MoK's sequential
    layer, which row["digests"] keeps per rank)."""
    everyone = ranks.comm.allgather(digests)
    if "digests" not in row:
        row["digests"] = [d["mok"] for d in everyone]
    equal = {**row.get("bitwise", {}).get("equal_to_mok_sequential", {}),
             **{label: all(d[label] == mok for d, mok in zip(everyone, row["digests"])) for label in digests}}
    row["bitwise"] = {"equal_to_mok_sequential": equal, "all": all(equal.values())}


def run_fused(ranks, prob, layer, args, jobs, row: dict) -> None:
    """Each fused setting of each pass (the other pass sequential) as graph replays, its results
    against the sequential layer's (row["digests"]: the first part of this run, on another layer
    object with the same inputs); fills row["ours"]["fused"]."""
    rank, heap, say = ranks.rank, ranks.heap, ranks.say
    mok = row["digests"][rank]
    digests = {}
    ok, digests["sequential, second layer"] = ranks.phase(row, "first step (fused part)", lambda: (
        eager_step(layer, heap), result_digests(layer, rank))[1])
    if not ok:
        return
    settings = [(pass_, comm_blocks, minibatch) for pass_ in ("fwd", "bwd") for comm_blocks, minibatch in args.fused]
    for pass_, comm_blocks, minibatch in settings:
        if any(ranks.comm.allgather(layer.failed)):  # spent on some rank: every later step would only time out
            row.setdefault("errors", []).append({"phase": "fused settings after a layer error", "ranks": {}})
            break
        label = f"fused {pass_} {comm_blocks}:{minibatch}"
        waited = time.time()
        root, job = jobs[prob.name, pass_, comm_blocks, minibatch]
        ok, plan = ranks.shared(row, f"{label} plan (proved by rank {root})", lambda job=job: job.get(args.plan_timeout),
                                root)
        if not ok:
            continue
        waited = ranks.max(time.time() - waited)

        def fused(pass_=pass_, plan=plan):
            (layer.set_forward_plan if pass_ == "fwd" else layer.set_backward_plan)(plan)
            try:
                st = time_graphs(ranks, layer, graphs_of(layer, heap), pass_, args.iters, args.warmup)
                return st, result_digests(layer, rank)
            finally:
                layer.set_forward_plan(None)
                layer.set_backward_plan(None)

        ok, got = ranks.phase(row, label, fused)
        if not ok:
            continue
        st, digests[label] = ranks.slowest({"run": got[0]})["run"], got[1]
        same = all(ranks.comm.allgather(digests[label] == mok))
        row["ours"]["fused"][pass_].append({"comm_blocks": comm_blocks, "minibatch_rows": minibatch, **st,
                                            "plan_wait_s": waited, "plan_tasks": len(plan.tasks),
                                            "num_sms": plan.num_sms, "equal_to_sequential": same})
        say(f"#   ours {label}: {st['median_ms']:.3f} ms (sequential {row['ours']['sequential'][pass_]['median_ms']:.3f}),"
            f" results equal to the sequential layer's: {same} (waited {waited:.0f} s for its plan)")
    record_digests(ranks, row, digests)


def as_torch(a):
    """A CuPy array as a torch tensor on the same memory (DLPack); uint16 (our bf16 bits) as bfloat16."""
    import cupy
    import torch

    if a.dtype == np.uint16:
        return torch.from_dlpack(a.view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


def torch_bytes(prob, concat: bool) -> int:
    """Device memory the torch layer adds beside ours (it reads our weights, inputs and dout):
    weight gradients (bf16), the concatenated gate/up copy, activations (rough, generous)."""
    s = prob.shape
    el = s.num_experts // prob.num_ranks
    routed = el * s.hidden * s.ffn * 2  # one bf16 [El, H, I]
    received = int(np.bincount(prob.topk.reshape(-1) // el, minlength=prob.num_ranks).max())
    activations = (12 * received * (s.hidden + 2 * s.ffn) * 2 + 8 * s.num_tokens * s.top_k * s.hidden * 2
                   + 16 * s.num_tokens * (s.hidden + 2 * s.shared_ffn_size) * 4)
    return 3 * routed + (2 * routed if concat else 0) + 9 * s.hidden * s.shared_ffn_size * 2 + activations


def run_torch(ranks, prob, layer, ours: dict, iters: int, warmup: int, row: dict) -> None:
    """The torch + NCCL layer on our weights and inputs: its timings and its error against ours
    (row["torch"]). Two phases: its setup (local), then its passes (NCCL: entered only once every
    rank's setup succeeded) and the comparison; the reductions after both succeeded."""
    import torch

    from mok_proto.bench import summarize, time_stages

    rank, b = ranks.rank, layer.bufs
    free = ranks.free_bytes()
    concat = torch_bytes(prob, True) + MARGIN_BYTES <= free
    if not concat and torch_bytes(prob, False) + MARGIN_BYTES > free:  # the same verdict on every rank
        why = (f"MemoryError: the torch layer needs ~{torch_bytes(prob, False) / 1e9:.1f} GB beside ours, "
               f"{free / 1e9:.1f} GB are free")
        ranks.say(f"#   torch: {why}")
        row.setdefault("errors", []).append({"phase": "torch", "ranks": {"all": why}})
        return

    def setup():
        from bench_nccl_baseline import TorchNcclLayer

        shared = tuple(as_torch(b[key].instance(rank))[0] for key in ("shared_gate", "shared_up", "shared_down")) \
            if layer.has_shared else None
        model = TorchNcclLayer(ranks.num_ranks, rank, *(as_torch(b[key].instance(rank))
                                                        for key in ("w_gate", "w_up", "w_down")),
                               shared=shared, concat=concat)
        x = as_torch(b["x"].instance(rank)).detach().requires_grad_()
        idx = torch.as_tensor(prob.topk[rank], device="cuda").long()
        w = torch.as_tensor(prob.topk_w[rank], device="cuda").requires_grad_()
        return model, x, idx, w, as_torch(b["dout"].instance(rank))

    ok, inputs = ranks.phase(row, "torch setup", setup)
    if not ok:
        return

    def passes(model, x, idx, w, dout):
        leaves = model.parameters() + [x, w]

        def fwd(mark):
            ranks.heap.barrier()
            with torch.no_grad():
                model.forward(x, idx, w, mark)
            mark(None)

        def fwd_bwd(mark):
            ranks.heap.barrier()
            for leaf in leaves:  # fresh gradients every iteration (no accumulation)
                leaf.grad = None
            mark("fwd")
            out = model.forward(x, idx, w)
            mark("bwd")
            torch.autograd.backward(out, dout)
            mark(None)

        stages = time_stages(fwd, iters, warmup, api="torch")
        both = time_stages(fwd_bwd, iters, warmup, api="torch")
        fwd_bwd(lambda stage: None)  # once more untimed: x.grad for the comparison
        with torch.no_grad():
            out = model.forward(x, idx, w)
        torch.cuda.synchronize()

        def rel_err(mine, ref):
            ref = ref.float()
            return float((as_torch(mine) - ref).abs().max() / ref.abs().max().clamp_min(1e-30))

        return (stages, both, float(np.median(both["total"]) - np.median(stages["total"])),
                {"out": rel_err(ours["out"], out), "x": rel_err(ours["dx"], x.grad)})

    ok, got = ranks.phase(row, "torch", lambda: passes(*inputs))
    inputs = None
    if not ok:
        return
    stages, both, bwd_ms, errors = got
    fwd_stats = ranks.slowest({stage: summarize(v) for stage, v in stages.items()})
    both_stats = ranks.slowest({"total": summarize(both["total"])})
    row["torch"] = {"fwd": fwd_stats["total"], "fwd_stages": {k: v for k, v in fwd_stats.items() if k != "total"},
                    "fwd_bwd": both_stats["total"], "bwd_median_ms": ranks.max(bwd_ms),
                    "bwd_definition": "t(fwd+bwd) - t(fwd, no_grad), the slowest rank's",
                    "gate_up": "concatenated" if concat else "separate (the concatenated copy did not fit)",
                    "max_rel_err_vs_ours": {key: ranks.max(err) for key, err in errors.items()}}


def judge(row: dict, bars: bool = True) -> list:
    """What of the bars and checks this shape misses (and row gets its speedups and 'met').
    bars=False (no torch layer ran): the speed bars are not judged (row['bars_judged'] says so)."""
    row["bars_judged"] = bars
    if "skipped" in row:
        return [f"skipped ({row['skipped']})"]
    missed = [f"{err['phase']} failed" for err in row.get("errors", [])]
    ours, torch_row = row.get("ours", {}), row.get("torch", {})
    torch_ms = {"fwd": torch_row.get("fwd", {}).get("median_ms"), "bwd": torch_row.get("bwd_median_ms")}
    row["speedup"] = {}
    for pass_, bar in BARS.items():
        runs = ours.get("fused", {}).get(pass_, [])
        if not runs or (bars and torch_ms[pass_] is None):
            missed.append(f"fused {pass_} vs torch not measured" if bars else f"fused {pass_} not measured")
            continue
        best = min(runs, key=lambda r: r["median_ms"])
        seq = ours["sequential"][pass_]["median_ms"]
        row["speedup"][f"fused_{pass_}_vs_sequential"] = seq / best["median_ms"]
        if not bars:
            continue
        speedup = row["speedup"][f"fused_{pass_}_vs_torch"] = torch_ms[pass_] / best["median_ms"]
        row["speedup"][f"sequential_{pass_}_vs_torch"] = torch_ms[pass_] / seq
        if speedup < bar:
            missed.append(f"fused {pass_} {speedup:.2f}x torch < {bar}x")
    bitwise = row.get("bitwise")
    if bitwise and not bitwise["all"]:
        missed.append("not bitwise equal to MoK's sequential: " + ", ".join(
            label for label, same in bitwise["equal_to_mok_sequential"].items() if not same))
    vs_single = row.get("bitwise_vs_single")
    if vs_single is not None and vs_single["equal"] is False:
        missed.append("differs from the single-process run")
    if vs_single is not None and vs_single["equal"] is None and not vs_single.get("skipped"):
        missed.append(f"not compared with the single-process run ({vs_single['why']})")
    errors = (row.get("torch") or {}).get("max_rel_err_vs_ours") or {}
    if any(err > TORCH_REL_ERR for err in errors.values()):  # a wrong baseline would make any speed-up
        missed.append(f"the torch layer differs from ours: {errors} (bound {TORCH_REL_ERR})")
    row["met"] = not missed
    return missed


def main_mpi(args) -> int:
    from mok_proto.bench import require_gpu

    require_gpu("bench_layer_mpi.py", need_torch=True)
    require_mpi_stack()
    import cupy
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    num_ranks, lead, start = comm.size, comm.rank == 0, time.time()
    out_dir = results_dir(args, num_ranks)
    digests_path = Path(args.digests_out) if args.digests_out else out_dir / "digests_mpi.json"
    problems, rows, failed = [], [], []
    for name in args.shapes:
        try:
            problems.append(Problem(name, args.tokens, num_ranks, args.seed))
        except ValueError as e:
            rows.append({"shape": name, "ranks": num_ranks, "skipped": str(e)})
            failed.append(f"{name}: skipped ({e})")
    need = max([p.layer_bytes for p in problems], default=0) + (1 << 30)  # + the link ceiling's buffer
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", f"{-(-int(need * 1.1) // (1 << 20))}M")
    count = cupy.cuda.runtime.getDeviceCount()
    device = comm.rank % count
    cupy.cuda.Device(device).use()
    # Ranks per GPU, the same answer on every rank (by PCI address: per-rank CUDA_VISIBLE_DEVICES too).
    per_gpu = gpu_sharing(comm.allgather(cupy.cuda.Device(device).pci_bus_id))
    note = implied_no_torch(args, num_ranks, per_gpu)
    if note and lead:
        print(note, flush=True)
    # Preflight (collective): every GPU of this host must map every other's memory (NVLink / P2P),
    # or each symmetric allocation would fail only after minutes of setup.
    no_peer = [p for p in range(count) if p != device and not cupy.cuda.runtime.deviceCanAccessPeer(device, p)]
    everyone = comm.allgather(no_peer)
    if any(everyone):
        if lead:
            print("bench_layer_mpi.py: GPUs without peer access: " + "; ".join(
                f"rank {r} (GPU {r % count}) cannot reach GPU(s) {bad}" for r, bad in enumerate(everyone) if bad),
                file=sys.stderr, flush=True)
        return 2
    free_at_start = cupy.cuda.runtime.memGetInfo()[0]

    from bench_nccl_baseline import init_distributed, link_ceiling_gbs
    from mok_proto.bench import peer_pull_gbs
    from mok_proto.kernels.fused import default_num_sms
    from mok_proto.symm.nvshmem import NvshmemHeap

    heap = NvshmemHeap(comm, timeout_s=HEAP_TIMEOUT_S)
    ranks = Ranks(comm, heap, per_gpu)
    # Memory the heap holds that free memory does not show (a static heap's reservation; a
    # dynamic heap may keep what it mapped after a free): usable by our next layer only.
    heap_held = max(0, int(ranks.max(free_at_start - cupy.cuda.runtime.memGetInfo()[0])))
    if not args.no_torch:
        init_distributed(NCCL_TIMEOUT_S)  # torch.distributed (NCCL), after the heap
    import torch

    ranks.say(f"# bench_layer_mpi: R={num_ranks} processes on {torch.cuda.get_device_name()}, iters {args.iters} "
              f"warmup {args.warmup}, seed {args.seed}, NVSHMEM_SYMMETRIC_SIZE={os.environ['NVSHMEM_SYMMETRIC_SIZE']}, "
              f"git {git_sha()}")
    for row in rows:
        ranks.say(f"# {row['shape']}: skipped: {row['skipped']}")
    pool = None
    link = {"nvshmem_pull_gbs": float("nan"), "nccl_a2a_gbs": None if args.no_torch else float("nan")}
    try:
        setup = {"shape": "setup"}
        ranks.say("# compiling the fused kernels (their occupancy sizes the plans)")
        ok, num_sms = ranks.phase(setup, "fused kernels (compile, occupancy)",
                                  lambda: {pass_: default_num_sms(1, pass_) for pass_ in ("fwd", "bwd")})
        if not ok:
            failed.append(f"setup: {setup['errors']}: no fused pass is timed")
            args.fused = []
        pool, jobs = start_plans(problems, args.fused, num_sms, args.plan_workers, comm.rank, num_ranks)
        if num_ranks > 1:
            before = ranks.free_bytes()
            ok, gbs = ranks.phase(setup, "link: NVSHMEM peer pull", lambda: peer_pull_gbs(heap))
            link["nvshmem_pull_gbs"] = ranks.min(gbs) if ok else float("nan")
            ranks.release(setup, ["link-ceiling"])  # peer_pull_gbs's buffer, if it failed before freeing it
            heap_held += max(0, before - ranks.free_bytes())
            if not args.no_torch:
                ok, gbs = ranks.phase(setup, "link: NCCL all_to_all", lambda: link_ceiling_gbs(num_ranks))
                link["nccl_a2a_gbs"] = ranks.min(gbs) if ok else float("nan")
            torch.cuda.empty_cache()
        nccl = "not run" if link["nccl_a2a_gbs"] is None else f"{link['nccl_a2a_gbs']:.0f} GB/s per GPU"
        ranks.say(f"# link: NVSHMEM peer pull {link['nvshmem_pull_gbs']:.0f} GB/s per GPU, NCCL all_to_all "
                  f"{nccl} (slowest rank); {len(jobs)} fused plans being proved, split over "
                  f"the ranks, by {args.plan_workers} helper processes per rank; {time.time() - start:.0f} s so far")
        digests, done = {}, {}
        # Part 1, every shape: our sequential layer and the torch layer (kernels run before).
        for prob in problems:
            row, heap_held = run_shape(ranks, prob, args, heap_held, link, "sequential", {},
                                       lambda layer, row, prob=prob: sequential_part(ranks, prob, layer, args, row))
            rows.append(row)
            done[prob.name] = row
            # Recorded as soon as the shape is done: a run stopped later keeps it.
            digests[prob.name] = {"config": {k: row.get(k) for k in ("shape", "ranks", "tokens_per_rank", "seed",
                                                                     "capacity")}}
            if "digests" in row:
                digests[prob.name]["per_rank"] = {str(r): d for r, d in enumerate(row["digests"])}
            else:
                digests[prob.name]["skipped"] = row.get("skipped", "no digests (failed before them)")
            if args.compare:
                row["bitwise_vs_single"] = compare_digests({prob.name: digests[prob.name]}, args.compare,
                                                           "mpi")[prob.name]
                ranks.say(f"#   bitwise vs the single process ({args.compare}): "
                          f"{describe_comparison(row['bitwise_vs_single'])}")
            if lead:
                append_result("bench_layer_mpi", {"mode": "mpi", "record": "partial (no fused pass yet)", **row,
                                                  "iters": args.iters, "warmup": args.warmup}, out_dir)
                write_digests(digests_path, "mpi", num_ranks, digests)
        # Part 2, every shape: the fused passes (never run over NVSHMEM processes before: a device
        # error there must not cost the shapes above their measurements).
        for prob in problems:
            row = done[prob.name]
            if "digests" in row and args.fused:
                row, heap_held = run_shape(ranks, prob, args, heap_held, link, "fused", row,
                                           lambda layer, row, prob=prob: run_fused(ranks, prob, layer, args, jobs, row))
            missed = judge(row, bars=not args.no_torch)
            failed += [f"{prob.name}: {'; '.join(missed)}"] if missed else []
            if lead:
                append_result("bench_layer_mpi", {"mode": "mpi", "record": "complete", **row, "iters": args.iters,
                                                  "warmup": args.warmup, "bars": BARS, "missed": missed}, out_dir)
        if lead:
            print_table(rows, link, digests_path, args.compare, bars=not args.no_torch)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        heap.close()
    unjudged = " (no torch layer: bars not judged)" if args.no_torch else ""
    if failed:
        ranks.say(f"FAIL ({time.time() - start:.0f} s): " + " | ".join(failed) + unjudged)
        return 1
    ranks.say(f"all {'checks' if args.no_torch else 'bars and checks'} met ({time.time() - start:.0f} s){unjudged}")
    return 0


def sequential_part(ranks, prob, layer, args, row: dict) -> None:
    """Part 1 of a shape: our sequential layer, then the torch layer on the same weights."""
    ours = run_sequential(ranks, prob, layer, args, row)
    if ours and not args.no_torch:
        run_torch(ranks, prob, layer, ours, args.iters, args.warmup, row)
    if "torch" in row:
        t = row["torch"]
        ranks.say(f"#   torch + NCCL: fwd {t['fwd']['median_ms']:.3f} ms, bwd {t['bwd_median_ms']:.3f} ms "
                  f"(gate/up {t['gate_up'].split(' ')[0]}); max rel err vs ours: out "
                  f"{t['max_rel_err_vs_ours']['out']:.1e}, dx {t['max_rel_err_vs_ours']['x']:.1e}")


def run_shape(ranks, prob, args, heap_held: int, link: dict, part: str, row: dict, work):
    """One part of one shape on a fresh layer (allocated and filled if it fits, freed after):
    work(layer, row). Returns (row, heap_held after it); row starts as the shape's config."""
    import cupy

    start = time.time()
    row = row or {**prob.config(), "link": link}
    ranks.say(f"# {prob.name} ({part}): N={prob.shape.num_tokens} H={prob.shape.hidden} I={prob.shape.ffn} "
              f"E={prob.shape.num_experts} (El={prob.shape.num_experts // prob.num_ranks}) K={prob.shape.top_k}, "
              f"capacity {prob.capacity} rows, our layer {prob.layer_bytes / 1e9:.1f} GB per rank")
    free = ranks.free_bytes()
    # Ranks sharing a GPU each allocate a layer there: an allocation NVSHMEM cannot back fails
    # inside its heap and ends the job, so never try one. (heap_held is read off the GPU's free
    # memory: with ranks sharing the GPU it is what all their heaps hold.)
    share = ranks.per_gpu
    if (prob.layer_bytes + MARGIN_BYTES) * share > free + heap_held:
        why = (f"our layer needs {prob.layer_bytes / 1e9:.1f} GB per rank (+ {MARGIN_BYTES >> 30} GiB margin)"
               + (f" x {share} ranks on one GPU" if share > 1 else "")
               + f", {free / 1e9:.1f} GB free + {heap_held / 1e9:.1f} GB held by the heap" + ("s" if share > 1 else ""))
        if part == "sequential":
            row["skipped"] = why
        else:
            row.setdefault("errors", []).append({"phase": "fused part: allocate", "ranks": {"all": why}})
        ranks.say(f"# {prob.name} ({part}): skipped: {why}")
        return row, heap_held
    ok, layer = ranks.phase(row, f"allocate and fill ({part})", lambda: new_layer(ranks, prob, args.seed))
    if ok:
        try:
            work(layer, row)
        finally:
            ranks.phase(row, f"free ({part})", layer.close)
    # What a failed allocation, fill or free left (on any rank) goes too: the next layer of this
    # name must be allocatable (collective, on every path).
    ranks.release(row, prob.array_names())
    layer = None  # (the torch tensors on its buffers went with run_torch's frame)
    cupy.get_default_memory_pool().free_all_blocks()
    # What the heap kept of this layer (free memory that did not come back) stays usable by the next.
    heap_held += max(0, free - ranks.free_bytes())
    row[f"elapsed_{part}_s"] = time.time() - start
    ranks.say(f"# {prob.name} ({part}): done in {row[f'elapsed_{part}_s']:.1f} s")
    return row, heap_held


def new_layer(ranks, prob, seed: int):
    """Our layer for this shape on the heap, with this rank's weights and inputs."""
    from mok_proto.layer.gpu import GpuMoELayer

    layer = GpuMoELayer(ranks.heap, prob.run, capacity=prob.capacity, name=prob.name)
    fill_layer(layer, ranks.rank, prob.topk, prob.topk_w, seed)
    return layer


def print_table(rows, link, digests_path, compare, bars: bool = True) -> None:
    def num(value, fmt=".3f"):
        return format(value, fmt) if isinstance(value, float) else "-"

    print(f"\n{'shape':<16}{'torch_fwd':>10}{'seq_fwd':>9}{'fused_fwd':>10}{'x torch':>8}{'x seq':>6}{'torch_bwd':>10}"
          f"{'seq_bwd':>9}{'fused_bwd':>10}{'x torch':>8}{'x seq':>6}  {'bitwise policies':<18}bitwise vs single")
    for row in rows:
        if "skipped" in row:
            print(f"{row['shape']:<16}skipped: {row['skipped']}")
            continue
        ours, t, speedup = row.get("ours", {}), row.get("torch", {}), row.get("speedup", {})
        seq, fused = ours.get("sequential", {}), ours.get("fused", {})
        best = {p: min((r["median_ms"] for r in fused.get(p, [])), default=None) for p in ("fwd", "bwd")}
        bitwise = row.get("bitwise", {}).get("all")
        cells = [num(t.get("fwd", {}).get("median_ms")), num(seq.get("fwd", {}).get("median_ms")), num(best["fwd"]),
                 num(speedup.get("fused_fwd_vs_torch"), ".2f"), num(speedup.get("fused_fwd_vs_sequential"), ".2f"),
                 num(t.get("bwd_median_ms")), num(seq.get("bwd", {}).get("median_ms")), num(best["bwd"]),
                 num(speedup.get("fused_bwd_vs_torch"), ".2f"), num(speedup.get("fused_bwd_vs_sequential"), ".2f")]
        widths = (10, 9, 10, 8, 6, 10, 9, 10, 8, 6)
        print(f"{row['shape']:<16}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths))
              + f"  {'yes' if bitwise else 'NO' if bitwise is False else '-':<18}"
              + describe_comparison(row.get("bitwise_vs_single")))
    judged = (f"bars: fused fwd >= {BARS['fwd']}x, fused bwd >= {BARS['bwd']}x the torch layer" if bars
              else "bars not judged (no torch layer)")
    print(f"# {judged}; ms, median of the slowest rank; digests: {digests_path}"
          + ("" if compare else " (no --compare: bitwise vs single not checked)"))
    print(f"# push vs pull per transfer: sequential layer, eager stage ms / ms beyond the bytes at the link rate / % of "
          f"the NVSHMEM link ({link['nvshmem_pull_gbs']:.0f} GB/s):")
    for row in rows:
        for op, by in row.get("push_pull", {}).items():
            print(f"#   {row['shape']:<16}{op:<13}" + "   ".join(
                f"{d} {v['stage_ms']:.3f} / {v['overhead_ms']:.3f} / {v['pct_link']:.0f}%" for d, v in by.items()))
    sys.stdout.flush()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.single is not None:
        return main_single(args)
    try:
        return main_mpi(args)
    except Exception:  # noqa: BLE001 (SystemExit, a refusal up front with its exit status, passes)
        # NOTE: an error outside a phase (e.g. a sticky CUDA error on one rank) leaves the other rank
        # in a collective, and MPI_Finalize at exit would wait for it: end the whole job instead.
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
        raise


if __name__ == "__main__":
    sys.exit(main())
