"""CPU checks of scripts/bench_layer.py's pure helpers (the GPU parts run on the device)."""

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("bench_layer", Path(__file__).resolve().parents[1] / "scripts" /
                                              "bench_layer.py")
bench_layer = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench_layer)


def test_overlap_ceiling_counts_gemm_and_outside_stages():
    # the backward: everything but the two transfers (1.0 + 0.5) and the gaps (0.5) stays
    bwd = {"scale": 0.5, "shared": 1.0, "rev_combine": 1.0, "experts": 4.0, "rev_dispatch": 0.5, "wgrad": 2.0,
           "token_grads": 0.5, "total": 10.0}
    assert bench_layer.overlap_ceiling(bwd, "bwd") == pytest.approx(10.0 / 8.0)
    fwd = {"schedule": 0.1, "shared": 0.3, "dispatch": 0.1, "experts": 2.2, "combine": 0.1, "weighted_sum": 0.1,
           "total": 3.0}
    assert bench_layer.overlap_ceiling(fwd, "fwd") == pytest.approx(3.0 / 2.7)
    with pytest.raises(KeyError):  # a stage the layer no longer marks: the bench fails loudly, not silently
        bench_layer.overlap_ceiling({k: v for k, v in fwd.items() if k != "weighted_sum"}, "fwd")
