"""Wrappers of cuda/token.cuh: the token owner's arithmetic of the GPU layer (weighted sum,
scaled output-gradient slots, slot sum, router-weight gradient), one function per kernel.

Every kernel covers the launch ranks of `launch` (grid.y = W, rank = rank_base + blockIdx.y) and
takes a device TokenParams (`pack_params`); nothing is read back to the host.
"""

from __future__ import annotations

from mok_proto import abi
from mok_proto.kernels.build import CudaModule
from mok_proto.kernels.comm import THREADS, Launch

MODULE = CudaModule("token.cuh", ("mok::weighted_sum_bf16", "mok::scale_to_slots", "mok::slot_sum",
                                  "mok::topk_weight_grad"))


def pack_params(fields: dict):
    """{TokenParams field: value} -> the device struct (the kernels' `const TokenParams*`)."""
    import cupy

    if fields["hidden"] % 8:
        raise ValueError(f"hidden must be a multiple of 8 (rows move as 16-byte octets), got {fields['hidden']}")
    return cupy.asarray(abi.TOKEN_PARAMS.pack(fields))


def _go(name, params, launch: Launch):
    MODULE.function(name)((launch.blocks_per_rank, launch.num_launch_ranks), (THREADS,), (params,))


def weighted_sum(params, launch: Launch):
    """out[t] = base[t] + sum_j w[t,j] * y_slots[t*K+j] (fp32 in order, bf16 out). Also reports
    kErrCapacity (Op kOpWeightedSum) into params' error record if a slot got no expert result
    (recv_row < 0: its expert owner's receive buffer overflowed); the sum runs anyway."""
    _go("mok::weighted_sum_bf16", params, launch)


def scale_to_slots(params, launch: Launch):
    """dy_slots[t*K+j] = w[t,j] * dout[t] (bf16)."""
    _go("mok::scale_to_slots", params, launch)


def slot_sum(params, launch: Launch):
    """dx[t] = dx_base[t] + sum_j dx_slots[t*K+j] (fp32 in order, bf16 out)."""
    _go("mok::slot_sum", params, launch)


def topk_weight_grad(params, launch: Launch):
    """d_topk_w[t,j] = <dout[t], y_slots[t*K+j]> (fp32, fixed order)."""
    _go("mok::topk_weight_grad", params, launch)
