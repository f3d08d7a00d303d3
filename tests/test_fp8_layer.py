"""The CPU layer with FP8 routed experts (RunConfig.precision="fp8"): both dispatch dtypes give
the same bits, which are reference_fp8's (mpi, 2 and 4 ranks); the configuration's refusals; the
FP8 dispatch row format."""

from types import SimpleNamespace

import numpy as np
import pytest

from conftest import check_case, run_cases
from mok_proto import fp8
from mok_proto.config import MoEShape, RunConfig
from mok_proto.layer import cpu, transfer
from mok_proto.validate import InputError

SHAPE = MoEShape("fp8", hidden=256, ffn=256, num_experts=4, top_k=2, num_tokens=8)

# H,I,E,K,N,num_shared, routing, shared precision, R. one-expert: expert 0 gets every token's first
# choice, R N rows: several 128-row blocks of its weight gradients, split over the small ring's turns.
CASES = [("256,256,4,2,128,1", "one-expert", "fp8", 2),  # N a whole block: the shared gradient's blocks agree
         ("256,256,8,2,64,1", "one-expert", "bf16", 4),
         ("256,512,4,2,64,0", "random", "bf16", 2)]


@pytest.mark.mpi
@pytest.mark.parametrize("shape,routing,shared,num_ranks",
                         [pytest.param(*case, marks=pytest.mark.xdist_group(f"check_fp8_layer_R{case[-1]}"))
                          for case in CASES])
def test_fp8_layer_dispatch_dtypes_bitwise_equal_and_match_reference(shape, routing, shared, num_ranks):
    """Every case of one rank count in one job (the first of its tests starts it)."""
    proc = run_cases(num_ranks, "tests/mpi_programs/check_fp8_layer.py",
                     *[f"{s}:{r}:{sh}" for s, r, sh, n in CASES if n == num_ranks])
    check_case(proc, f"OK R={num_ranks} {shape} routing={routing} shared={shared}: bf16 and fp8 dispatch",
               f"case {shape} routing={routing} shared={shared} on {num_ranks} ranks", f"{shape}:{routing}:{shared}")


@pytest.mark.parametrize("fields,message", [
    ({"precision": "fp16"}, "precision must be one of bf16, fp8"),
    ({"dispatch_dtype": "fp8"}, "only with precision fp8"),
    ({"shared_precision": "fp8"}, "only with precision fp8"),
    ({"precision": "fp8", "dtype": "float64"}, "dtype must be float32"),
    ({"precision": "fp8", "dispatch_dtype": "e4m3"}, "dispatch_dtype must be one of"),
    ({"wgrad_precision": "fp8"}, "wgrad_precision may be fp8 only with precision fp8"),
    ({"precision": "fp8", "wgrad_precision": "fp16"}, "wgrad_precision must be None or one of bf16, fp8"),
])
def test_run_config_refuses_bad_precisions(fields, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(SHAPE, 1, **fields)


def test_fp8_wgrad_follows_precision_unless_set():
    assert not RunConfig(SHAPE, 1).fp8_wgrad and not RunConfig(SHAPE, 1, wgrad_precision="bf16").fp8_wgrad
    assert RunConfig(SHAPE, 1, precision="fp8").fp8_wgrad
    assert not RunConfig(SHAPE, 1, precision="fp8", wgrad_precision="bf16").fp8_wgrad


def _fake_heap():
    return SimpleNamespace(num_ranks=1, rank=0, signals=lambda name, kinds: None,
                           alloc=lambda name, shape, dtype: SimpleNamespace(local=np.zeros(shape, dtype)))


def _weights(shape):
    h, i, e = shape.hidden, shape.ffn, shape.num_experts
    return {"w_gate": np.zeros((e, h, i)), "w_up": np.zeros((e, h, i)), "w_down": np.zeros((e, i, h)),
            "shared_gate": np.zeros((h, i)), "shared_up": np.zeros((h, i)), "shared_down": np.zeros((i, h))}


@pytest.mark.parametrize("dispatch,row_bytes,dtype", [("bf16", 512, np.uint16), ("fp8", 264, np.uint8)])
def test_cpu_layer_dispatch_rows(dispatch, row_bytes, dtype):
    """What the token owner publishes for the dispatch: bf16 rows, or e4m3 codes + fp32 scales
    (H + H/32 bytes, about half); the float layer keeps its dtype."""
    run = RunConfig(SHAPE, 1, precision="fp8", dispatch_dtype=dispatch)
    layer = cpu.CpuMoELayer(_fake_heap(), run, _weights(SHAPE))
    assert layer.tokens.local.dtype == dtype and layer.tokens.local.nbytes == row_bytes * SHAPE.num_tokens
    assert layer.expert_in.local.dtype == dtype and layer.expert_in.local.shape[1:] == layer.tokens.local.shape[1:]
    plain = cpu.CpuMoELayer(_fake_heap(), RunConfig(SHAPE, 1), _weights(SHAPE))
    assert plain.tokens.local.dtype == np.float32 and not plain.fp8


def test_cpu_layer_refuses_fp8_shapes_and_alignments():
    run = RunConfig(SHAPE, 1, precision="fp8")
    with pytest.raises(InputError, match="align a multiple of 128"):
        cpu.CpuMoELayer(_fake_heap(), run, _weights(SHAPE), align=64)
    odd = MoEShape("odd", hidden=256, ffn=192, num_experts=4, top_k=2, num_tokens=8)
    with pytest.raises(InputError, match="I a multiple of 128"):
        cpu.CpuMoELayer(_fake_heap(), RunConfig(odd, 1, precision="fp8"), _weights(odd))
    odd_shared = MoEShape("odd", hidden=256, ffn=256, num_experts=4, top_k=2, num_tokens=8, shared_ffn=192)
    weights = {**_weights(odd_shared), "shared_gate": np.zeros((256, 192)), "shared_up": np.zeros((256, 192)),
               "shared_down": np.zeros((192, 256))}
    cpu.CpuMoELayer(_fake_heap(), RunConfig(odd_shared, 1, precision="fp8"), weights)  # a bf16 shared expert: any Is
    with pytest.raises(InputError, match="Is a multiple of 128"):
        cpu.CpuMoELayer(_fake_heap(), RunConfig(odd_shared, 1, precision="fp8", shared_precision="fp8"), weights)


def test_fp8_dispatch_rows_round_trip():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 384)).astype(np.float32)
    x[1, :128] = 0.0
    x[2, 7] = np.nan
    codes, scales = fp8.quantize_rows(x)
    rows = transfer.pack_fp8_rows(codes, scales)
    assert rows.dtype == np.uint8 and rows.shape == (5, transfer.fp8_row_bytes(384)) == (5, 384 + 12)
    got = transfer.unpack_fp8_rows(rows, 384)
    assert np.array_equal(got[0], codes) and got[1].dtype == np.float32
    assert np.array_equal(got[1].view(np.uint32), scales.view(np.uint32))
    empty = transfer.unpack_fp8_rows(transfer.pack_fp8_rows(codes[:0], scales[:0]), 384)
    assert empty[0].shape == (0, 384) and empty[1].shape == (0, 3)
