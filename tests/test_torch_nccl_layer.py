"""mok_proto.bench.torch_baselines.TorchNcclLayer (the PyTorch layer bench_layer_mpi.py measures ours
against) computes the MoE layer: 2 ranks on the CPU (torch.distributed gloo), forward and
backward against the float64 NumPy reference on the same bf16-rounded inputs. Skips without torch."""

import importlib.util
import multiprocessing

import numpy as np
import pytest

from mok_proto.config import MoEShape
from mok_proto.problem import make_problem
from mok_proto.reference import from_bf16, to_bf16

SHAPE = MoEShape("torch-layer", hidden=64, ffn=32, num_experts=8, top_k=2, num_tokens=24)  # 16-byte rows (grouped_mm)
RANKS = 2
TOL = 3e-2  # bf16 activations and weights against float64


def _bf16(a):
    return from_bf16(to_bf16(np.asarray(a, np.float32)))


def _rank(rank: int, init_file: str, queue) -> None:
    """One rank: the layer's output and gradients, as float64 NumPy, onto the queue."""
    import torch
    import torch.distributed as dist

    from mok_proto.bench import torch_baselines as baseline

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS)
    try:
        prob = make_problem(SHAPE, RANKS, seed=5)
        el = SHAPE.num_experts // RANKS
        t = lambda a, dtype=torch.bfloat16: torch.tensor(np.asarray(a, np.float32)).to(dtype)  # noqa: E731
        w = prob.local_weights(rank)
        model = baseline.TorchNcclLayer(RANKS, rank, t(w["w_gate"]), t(w["w_up"]), t(w["w_down"]),
                                        shared=(t(w["shared_gate"]), t(w["shared_up"]), t(w["shared_down"])),
                                        concat=rank == 0)  # one rank each way
        x = t(prob.x[rank]).requires_grad_()
        weights = t(prob.topk_weights[rank], torch.float32).requires_grad_()
        stages = []
        out = model.forward(x, torch.tensor(prob.topk_idx[rank]).long(), weights, stages.append)
        torch.autograd.backward(out, t(prob.dout[rank]))
        w1 = model.w1.grad if model.w1 is not None else torch.cat([model.w_gate.grad, model.w_up.grad], dim=2)
        s1 = model.s1.grad
        got = {"out": out, "x": x.grad, "topk_weights": weights.grad, "w_gate": w1[..., :SHAPE.ffn],
               "w_up": w1[..., SHAPE.ffn:], "w_down": model.w2.grad, "shared_gate": s1[:, :SHAPE.shared_ffn_size],
               "shared_up": s1[:, SHAPE.shared_ffn_size:], "shared_down": model.s2.grad}
        queue.put((rank, stages, {k: v.detach().double().numpy() for k, v in got.items()}, el))
    finally:
        dist.destroy_process_group()


def test_torch_nccl_layer_is_the_moe_layer(tmp_path):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here (the bench extra)")
    import torch

    try:  # torch._grouped_mm on the CPU (newer torch has it)
        torch._grouped_mm(torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(2, 8, 8, dtype=torch.bfloat16),
                          offs=torch.tensor([2, 4], dtype=torch.int32))
    except Exception as e:  # noqa: BLE001 - any failure: this torch cannot run the layer on the CPU
        pytest.skip(f"this torch has no CPU torch._grouped_mm ({type(e).__name__}: {e})")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "init"), queue)) for r in range(RANKS)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(RANKS):
        rank, stages, got, el = queue.get(timeout=300)
        results[rank] = got
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert stages == ["layout", "shared", "dispatch", "experts", "combine", "weighted_sum"]
    prob = make_problem(SHAPE, RANKS, seed=5)
    ref = prob.reference_results(bf16=True)
    n = SHAPE.num_tokens
    for rank, got in results.items():
        want = {"out": ref["out"][rank * n:(rank + 1) * n], "x": ref["x"][rank * n:(rank + 1) * n],
                "topk_weights": ref["topk_weights"][rank * n:(rank + 1) * n],
                **{k: ref[k][rank * el:(rank + 1) * el] for k in ("w_gate", "w_up", "w_down")}}
        for key, value in want.items():
            err = np.abs(got[key] - value).max() / np.abs(value).max()
            assert err < TOL, (rank, key, err)
    for key in ("shared_gate", "shared_up", "shared_down"):  # per-rank partial sums: their sum is the gradient
        total = sum(got[key] for got in results.values())
        assert np.abs(total - ref[key]).max() / np.abs(ref[key]).max() < TOL, key
