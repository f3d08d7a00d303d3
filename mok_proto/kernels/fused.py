"""Wrapper of cuda/fused.cuh: a fused pass of the MoE layer (forward or backward), one persistent
launch that executes a plan (mok_proto/plan/, `fused_forward` / `fused_backward`) on every
launch rank.

`FusedPass(plan, num_launch_ranks)` uploads the plan's tables once and owns the ready counters
(zeroed on the stream before each launch: a memset, graph-capturable) and the timeline buffer;
`launch(comm_params, gemm_params, error, timeout_ns, trace, token_params)` enqueues the kernel (the
first launch of a set of arguments uploads its params: do it once outside a graph capture). The grid is (plan.num_sms,
W) in 2-CTA clusters; every CTA must be resident at once (a CTA spins on counters raised by
others), so the constructor refuses a plan whose W * num_sms / 2 clusters exceed what the
driver says the GPU runs at once. The remote counters the kernel keeps (as peer flags:
cuda/fused_sync.cuh remote_flag) are SLOTS_ARRIVED and PUBLISHED (REMOTE_KINDS); a plan with another
remote counter, or two of one kind, is refused (check_remote_counters).
"""

from __future__ import annotations

import numpy as np

from mok_proto import abi
from mok_proto.kernels import gemm
from mok_proto.kernels.build import CudaModule
from mok_proto.plan import CounterKind

KERNELS = {"fwd": "mok::fused::fused_forward", "bwd": "mok::fused::fused_backward",  # *_fp8: FP8 routed experts
           "fwd_fp8": "mok::fused::fused_forward_fp8", "bwd_fp8": "mok::fused::fused_backward_fp8"}
SIZES = "mok::fused::export_sizes"
MODULE = CudaModule("fused.cuh", (*KERNELS.values(), SIZES), archs=("sm_90a",))
LINK_MODULE = MODULE.variant("MOK_LINK")  # its movers pay an emulated link (mok_proto/link.py)
RECORD_DTYPE = abi.TRACE_RECORD.dtype  # one TraceRecord (struct mok::fused::TraceRecord)
GEMMS_PER_RANK = len(abi.GEMM_SLOT)
# The remote counters cuda/fused_sync.cuh keeps as peer flags (remote_flag; abi.REMOTE_COUNTER_KINDS).
REMOTE_KINDS = frozenset(CounterKind(abi.COUNTER_KIND[name]) for name in abi.REMOTE_COUNTER_KINDS)


def check_remote_counters(plan) -> None:
    """ValueError unless the kernel can execute the plan's remote counters: each of a kind it keeps
    as peer flags (REMOTE_KINDS), at most one per kind (two would share one flag, and the first
    to complete would release the other's waiters), and a target of a whole share per rank (the
    kernel raises the flag at target / R of this rank's own signals)."""
    counters = plan.counters[plan.counters["remote"]]
    kinds = [CounterKind(int(k)) for k in counters["kind"]]
    if not set(kinds) <= REMOTE_KINDS:
        raise ValueError(f"the fused kernel keeps only {sorted(k.name for k in REMOTE_KINDS)} as remote counters, "
                         f"the plan has {sorted(k.name for k in set(kinds) - REMOTE_KINDS)}")
    if len(set(kinds)) < len(kinds):
        raise ValueError(f"the fused kernel keeps one remote counter per kind (one flag each), the plan has "
                         f"{sorted(k.name for k in kinds)}")
    if np.any(counters["target"] % plan.num_ranks):
        raise ValueError(f"a remote counter's target counts R = {plan.num_ranks} signals per task, got "
                         f"{counters['target'].tolist()}")


def gemm_timeout_ns(timeout_ns: int) -> int:
    """The fused kernel's GEMM pipeline waits (GemmParams.timeout_ns) for counter waits of
    `timeout_ns`: longer than its waits on its own counters (kFusedLocalTimeoutFactor x) and than
    the standalone GEMMs' (gemm.TIMEOUT_NS). A GEMM stage waits for a producer that waits for a
    counter (or a peer's rows): that wait, naming the counter or the peer, is what gets reported."""
    return max(gemm.TIMEOUT_NS, (abi.CONST["kFusedLocalTimeoutFactor"] + 1) * int(timeout_ns))


def with_gemm_timeout(words: np.ndarray, timeout_ns: int, struct=abi.GEMM_PARAMS) -> np.ndarray:
    """Packed GemmParams (or `struct`'s: Fp8GemmParams; host uint64 words, one struct after another)
    with every timeout_ns set."""
    records = np.ascontiguousarray(words, np.uint64).copy().view(struct.dtype)
    records["timeout_ns"] = timeout_ns
    return records.view(np.uint64)


def smem_bytes(kernel: str = "fwd", link: bool = False) -> int:
    """Dynamic shared memory of a launch of KERNELS[kernel]: gemm.cuh's for the BF16 passes, the
    FP8 passes' (their stages' scales too) from the compiled header."""
    if not kernel.endswith("_fp8"):
        return gemm.smem_bytes()
    return (LINK_MODULE if link else MODULE).read_sizes(SIZES, 1)[0]


def _kernel(kernel: str = "fwd", link: bool = False):
    """The compiled KERNELS[kernel] (link: the MOK_LINK build), allowed its dynamic shared memory."""
    function = (LINK_MODULE if link else MODULE).function(KERNELS[kernel])
    smem = smem_bytes(kernel, link)
    if function.max_dynamic_shared_size_bytes < smem:
        function.max_dynamic_shared_size_bytes = smem
    return function


def resident_clusters(kernel: str = "fwd", link: bool = False) -> int:
    """Clusters of a fused kernel (KERNELS key) the GPU runs at once (the driver's occupancy answer)."""
    return gemm.resident_clusters(_kernel(kernel, link), strict=True, smem=smem_bytes(kernel, link))


def default_num_sms(num_launch_ranks: int, kernel: str = "fwd") -> int:
    """CTAs per launch rank so that every launch rank's clusters are resident together."""
    return 2 * max(1, resident_clusters(kernel) // num_launch_ranks)


class FusedPass:
    """One plan's device tables, counters and timeline for W launch ranks."""

    def __init__(self, plan, num_launch_ranks: int, link: bool = False, fp8: bool = False,
                 wgrads_inside: bool = False):
        """fp8: the FP8 passes' kernels; wgrads_inside: fused_backward_fp8 gets BF16 routed
        weight-gradient GEMMs (layer.gpu_fp8.wgrads_inside); it runs no FP8 ones."""
        from mok_proto.plan import FUSED_STRATEGIES, PAIR_ROWS

        if fp8 and not wgrads_inside and plan.pass_ == "bwd" and plan.routed_wgrads:
            raise ValueError("fused_backward_fp8 runs no FP8 routed weight-gradient tile: build the plan with "
                             "FusedKnobs(routed_wgrads=False) (they run after the kernel)")

        if plan.minibatch_rows % PAIR_ROWS:  # the kernel's ring shift and tile pairs assume whole pairs
            raise ValueError(f"minibatch_rows {plan.minibatch_rows}: the fused kernel runs whole tile pairs of a "
                             f"minibatch (a multiple of plan.PAIR_ROWS, {PAIR_ROWS})")
        import cupy

        plan.check()
        if plan.strategy != FUSED_STRATEGIES.get(plan.pass_):
            raise ValueError(f"FusedPass runs fused_forward / fused_backward plans, got strategy {plan.strategy!r}")
        self.plan, self.num_launch_ranks, self.link = plan, int(num_launch_ranks), bool(link)
        self.kernel = plan.pass_ + ("_fp8" if fp8 else "")  # a KERNELS key
        clusters, resident = plan.num_sms // 2 * self.num_launch_ranks, resident_clusters(self.kernel, self.link)
        if clusters > resident:
            raise ValueError(f"plan needs {plan.num_sms} CTAs x {self.num_launch_ranks} launch ranks = {clusters} "
                             f"clusters resident at once, the GPU runs {resident}: use num_sms <= "
                             f"{2 * (resident // self.num_launch_ranks)}")
        check_remote_counters(plan)
        self.tasks = cupy.asarray(plan.tasks.view(np.uint8))
        counters = plan.counters.view(np.uint8) if len(plan.counters) else np.zeros(1, np.uint8)
        self.counter_info = cupy.asarray(counters)  # the kernel reads a remote counter's kind and target
        begin = np.searchsorted(plan.tasks["block"], np.arange(plan.num_sms + 1)).astype(np.int32)
        self.task_begin = cupy.asarray(begin)
        self.counters = cupy.zeros((self.num_launch_ranks, max(1, len(plan.counters))), np.uint32)
        self.rest = self  # a layer's ring of several turns: what its turns after the first run (gpu_ring)
        self.fp8_words = None  # fp8: per turn of the layer's ring, its (Fp8GemmParams, QuantParams) words
        self.records = cupy.zeros((self.num_launch_ranks, max(1, len(plan.tasks)) * RECORD_DTYPE.itemsize), np.uint8)
        self._params: dict = {}

    def launch(self, comm_params, gemm_params: np.ndarray, error, timeout_ns: int, trace: bool = False,
               token_params=None, fp8_gemm_params: np.ndarray | None = None, quant_params: np.ndarray | None = None,
               dispatch_params: tuple | None = None):
        """Enqueue one fused pass. comm_params: the round's device CommParams; gemm_params: host
        uint64 words of W x kFusedGemms packed GemmParams (GemmSlot order per launch rank);
        token_params: the launch ranks' device TokenParams (needed by a plan with token_grads or scale).
        The FP8 passes (fp8=True): fp8_gemm_params, W x kFusedGemms packed Fp8GemmParams (their routed
        slots'), and quant_params, W packed QuantParams (each launch rank's rows the incoming transfer
        brings: forward recv -> xq, xq_s, backward recv_dy -> dyq, dyq_s) when that transfer runs
        inside the kernel (else None: the rows were quantized before it); dispatch_params (forward):
        with fp8 dispatch pulled inside, the device CommParams of its codes rows and of its scales rows
        (the movers copy both; quant_params None)."""
        import cupy

        plan = self.plan
        if (plan.token_grads or plan.scale) and token_params is None:
            raise ValueError("this plan runs token-side work (token_grads, scale) inside the kernel: pass token_params")
        fp8 = self.kernel.endswith("_fp8")
        if fp8 != (fp8_gemm_params is not None) or ((quant_params is not None or dispatch_params) and not fp8):
            raise ValueError("fp8_gemm_params: given exactly for the FP8 passes (FusedPass(..., fp8=True)); "
                             "quant_params and dispatch_params only with them")
        if dispatch_params and plan.pass_ != "fwd":
            raise ValueError("dispatch_params: the FP8 forward's (fp8 dispatch), not the backward's")
        if quant_params is not None and dispatch_params:
            raise ValueError("quant_params (bf16 rows quantized by the movers) or dispatch_params (fp8 rows), not both")
        codes, scales = (0, 0) if not dispatch_params else (int(d.data.ptr) for d in dispatch_params)
        token_ptr = 0 if token_params is None else int(token_params.data.ptr)
        gemm_words = np.ascontiguousarray(gemm_params, np.uint64)
        extra = [np.ascontiguousarray(w, np.uint64) for w in (fp8_gemm_params, quant_params) if w is not None]
        key = (int(comm_params.data.ptr), gemm_words.tobytes(), int(error.ptr), int(timeout_ns), bool(trace),
               token_ptr, quant_params is not None, codes, scales, *(w.tobytes() for w in extra))
        if key not in self._params:  # uploaded once per distinct launch (a captured graph never uploads)
            if cupy.cuda.get_current_stream().is_capturing():
                raise RuntimeError("this fused launch's params were never uploaded: run the pass once before "
                                   "capturing a graph of it (a capture cannot copy host data to the GPU)")
            gemms = cupy.asarray(gemm_words)
            fp8_gemms = None if fp8_gemm_params is None else cupy.asarray(extra[0])
            quants = None if quant_params is None else cupy.asarray(extra[-1])
            fields = dict(comm_ctas=plan.comm_blocks, num_tasks=len(plan.tasks),
                          num_counters=self.counters.shape[1], first_remote=plan.first_remote_counter,
                          claim_counter=plan.claim_counter,
                          minibatch_rows=plan.minibatch_rows,
                          ring_rows=plan.ring_minibatches * plan.minibatch_rows, record_trace=int(bool(trace)),
                          timeout_ns=timeout_ns, tasks=self.tasks, task_begin=self.task_begin, comm=comm_params,
                          gemm=gemms, counters=self.counters, counter_info=self.counter_info, token=token_ptr,
                          trace=self.records, error=error.ptr, fp8_gemm=0 if fp8_gemms is None else fp8_gemms,
                          quant=0 if quants is None else quants, dispatch_codes=codes, dispatch_scales=scales)
            self._params[key] = (cupy.asarray(abi.FUSED_PARAMS.pack(fields)), gemms, fp8_gemms, quants)
        params = self._params[key][0]
        self.counters.fill(0)
        if trace:
            self.records.fill(255)  # task = -1 until the task ran: a stale timeline cannot pass as this one
        _kernel(self.kernel, self.link)((plan.num_sms, self.num_launch_ranks), (abi.CONST["kThreads"],), (params,),
                                        shared_mem=smem_bytes(self.kernel, self.link))

    def timeline(self, launch_rank: int) -> np.ndarray:
        """The last traced launch's TraceRecord per task of one launch rank (host readback)."""
        return self.records[launch_rank].get().view(RECORD_DTYPE)[: len(self.plan.tasks)]
