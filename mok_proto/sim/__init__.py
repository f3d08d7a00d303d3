"""Scale-up-domain simulator: one MoE layer pass on R GPUs, executing the same `Plan` objects
as the megakernel (`mok_proto.plan`), with GPU parameter sets calibrated on our measurements
(`h200`, `h100`) or taken from public specifications (`gb300-nvl72`).

    from mok_proto import plan, sim
    gpu = sim.get_params("gb300-nvl72")
    p = plan.fixed_split(shape, 64, comm_blocks=40, minibatch_rows=2048, policy=MOK_POLICY, num_sms=gpu.num_sms)
    result = sim.simulate(p, gpu)          # result.time_ns, result.records() -> trace.plot_timeline
    # plan.fused_forward plans too: result.kernel_ns (its tasks) vs result.time_ns (+ the launches around it)
"""

from mok_proto.sim.model import Load, SimResult, load_from_topk, route, routed_load, simulate
from mok_proto.sim.params import GpuParams, gb300_nvl72, get_params, grouped_gemm_ns, h100, h200, nccl_links

__all__ = ["GpuParams", "Load", "SimResult", "gb300_nvl72", "get_params", "grouped_gemm_ns", "h100", "h200",
           "load_from_topk", "nccl_links", "route", "routed_load", "simulate"]
