"""CPU checks of the FP8 GEMM wrappers (mok_proto/kernels/gemm_fp8.py): every argument check
refuses with one line before anything touches a GPU, and the Fp8GemmParams each wrapper packs
(problem sizes, scale strides, tensor-map views) are the ones cuda/gemm_fp8.cuh reads. The wrappers
run on NumPy arrays here, with the tensor-map encoder and the launch replaced by recorders. (The
kernels' numerics: tests/test_gemm_fp8.py, on a GPU; compiling them: tests/test_kernels_build.py.)"""

import numpy as np
import pytest

from mok_proto import abi
from mok_proto.kernels import gemm, gemm_fp8

E, H, I, ROWS = 3, 512, 256, 384  # experts, hidden, FFN, rows (a multiple of 128: the weight gradients)
B = gemm_fp8.BK


def _rows(r, k):
    return np.zeros((r, k), np.uint8), np.ones((r, k // B), np.float32)


def _blocks(n, k):
    return np.zeros((E, n, k), np.uint8), np.ones((E, n // B, k // B), np.float32)


def _bf16(r, c):
    return np.zeros((r, c), np.uint16)


def _groups():
    return np.array([0, 128, 256], np.int32), np.array([100, 0, 128], np.int32)


def _calls():
    """Each wrapper with valid arguments: {name: (function, args, kwargs)}."""
    offs, cnts = _groups()
    return {
        "gate_up": (gemm_fp8.gate_up, (_rows(ROWS, H), _blocks(I, H), _blocks(I, H), offs, cnts, _bf16(ROWS, I),
                                       _rows(ROWS, I)), {}),
        "down": (gemm_fp8.down, (_rows(ROWS, I), _blocks(H, I), offs, cnts, _bf16(ROWS, H)), {}),
        "down_bwd": (gemm_fp8.down_bwd, (_rows(ROWS, H), _blocks(I, H), _bf16(ROWS, I), _bf16(ROWS, I), offs, cnts,
                                         _bf16(ROWS, I), _bf16(ROWS, I)), {}),
        "gate_up_bwd": (gemm_fp8.gate_up_bwd, (_rows(ROWS, I), _rows(ROWS, I), _blocks(H, I), _blocks(H, I), offs,
                                               cnts, _bf16(ROWS, H)), {}),
        "down_wgrad": (gemm_fp8.down_wgrad, (_rows(I, ROWS), _rows(H, ROWS), offs, cnts,
                                             np.zeros((E, I, H), np.float32)), {}),
        "gate_up_wgrad": (gemm_fp8.gate_up_wgrad, (_rows(H, ROWS), _rows(I, ROWS), _rows(I, ROWS), offs, cnts,
                                                   np.zeros((E, H, I), np.float32), np.zeros((E, H, I), np.float32)),
                          {}),
    }


@pytest.fixture
def recorded(monkeypatch):
    """Replace the tensor-map encoder and the launch: the wrappers return (problem, fields)."""
    maps = []

    def tensor_map(array, inner, outer, box_inner, box_outer, dtype="bf16"):
        maps.append((inner, outer, box_inner, box_outer, dtype))
        return f"map{len(maps) - 1}"

    def launch(module, namespace, struct, problem, site, error, pack_only, fields):
        assert module is gemm_fp8.MODULE and namespace == "mok::gemm_fp8" and struct is abi.FP8_GEMM_PARAMS
        assert site == f"fp8 {problem}" and not set(fields) - set(struct.names)
        return problem, fields, list(maps)

    monkeypatch.setattr(gemm, "tensor_map", tensor_map)
    monkeypatch.setattr(gemm, "launch_grouped", launch)
    return maps


def _map(fields, maps, name):
    return maps[int(fields[name][3:])]


def test_row_problems_pack_their_sizes_and_scale_strides(recorded):
    calls = _calls()
    expect = {  # n, k, ldo, a_scale_stride, b_scale_stride, b_scale_group_stride
        "gate_up": (I, H, I, H // B, H // B, (I // B) * (H // B)),
        "down": (H, I, H, I // B, I // B, (H // B) * (I // B)),
        "down_bwd": (I, H, I, H // B, H // B, (I // B) * (H // B)),
        "gate_up_bwd": (H, 2 * I, H, I // B, I // B, (H // B) * (I // B)),
    }
    for name, want in expect.items():
        recorded.clear()
        fn, args, kwargs = calls[name]
        problem, f, maps = fn(*args, **kwargs)
        assert problem == name and f["num_groups"] == E
        got = tuple(f[k] for k in ("n", "k", "ldo", "a_scale_stride", "b_scale_stride", "b_scale_group_stride"))
        assert got == want, name
        k_a = H if name in ("gate_up", "down_bwd") else I  # A codes [rows, k_a], boxes of 128 rows x 128 bytes
        assert _map(f, maps, "tmap_a1") == (k_a, ROWS, B, 128, "u8"), name
        n_b = want[0]  # B codes [E * N, K]
        assert _map(f, maps, "tmap_b1") == (k_a, E * n_b, B, 128, "u8"), name
    _, f, maps = calls["gate_up_bwd"][0](*calls["gate_up_bwd"][1])
    assert f["k_split"] == I and f["scale_a2"] is not f["scale_a1"]
    _, f, maps = calls["down_bwd"][0](*calls["down_bwd"][1])
    assert _map(f, maps, "tmap_aux1") == (I, ROWS, 64, 128, "bf16")  # g, u through the ring as gemm.cuh's


def test_gate_up_packs_h_and_its_quantization(recorded):
    fn, args, _ = _calls()["gate_up"]
    x, wg, wu, offs, cnts, h, hq = args
    g, u = _bf16(ROWS, I), _bf16(ROWS, I)
    _, f, _ = fn(*args, g=g, u=u, pow2=True)
    assert f["out1"] is h and f["out2"] is g and f["out3"] is u and f["pow2"] == 1
    assert f["out_codes"] is hq[0] and f["out_scales"] is hq[1]
    assert f["scale_a1"] is x[1] and f["scale_b1"] is wg[1] and f["scale_b2"] is wu[1]
    _, f, _ = fn(*args)
    assert f["out2"] == 0 and f["out3"] == 0 and f["pow2"] == 0


def test_weight_gradients_pack_rows_as_k(recorded):
    calls = _calls()
    _, f, maps = calls["down_wgrad"][0](*calls["down_wgrad"][1], accumulate=True)
    assert (f["m"], f["n"], f["ldo"], f["o_group_stride"]) == (I, H, H, I * H) and f["accumulate"] == 1
    assert f["a_scale_stride"] == f["b_scale_stride"] == ROWS // B
    assert _map(f, maps, "tmap_a1") == (ROWS, I, B, 128, "u8") and _map(f, maps, "tmap_b1") == (ROWS, H, B, 128, "u8")
    recorded.clear()
    _, f, maps = calls["gate_up_wgrad"][0](*calls["gate_up_wgrad"][1])
    assert (f["m"], f["n"], f["ldo"], f["o_group_stride"]) == (H, I, I, H * I) and f["accumulate"] == 0
    assert _map(f, maps, "tmap_b2") == (ROWS, I, B, 128, "u8")


def _refused(call, match):
    fn, args, kwargs = call
    with pytest.raises(ValueError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)


def test_bad_arguments_are_refused_before_any_launch():
    """One line each, on NumPy arrays: nothing is imported from CuPy before the checks pass."""
    calls = _calls()

    def swap(name, i, value, **kwargs):
        fn, args, kw = calls[name]
        return fn, args[:i] + (value,) + args[i + 1:], {**kw, **kwargs}

    codes, scales = _rows(ROWS, H)
    _refused(swap("gate_up", 0, codes), "x: expected a pair")
    _refused(swap("gate_up", 0, (codes.astype(np.int8), scales)), r"x codes: expected u8")
    _refused(swap("gate_up", 0, (codes, scales[:, :1])), r"x scales: expected shape \(384, 4\)")
    _refused(swap("gate_up", 0, (codes[:, :200], scales)), "H=200 must be a multiple of 128")
    _refused(swap("gate_up", 1, _blocks(I, 256)), r"w_gate_t codes: expected shape \(3, 256, 512\)")
    _refused(swap("gate_up", 6, _rows(ROWS, 128)), r"hq codes: expected shape \(384, 256\)")
    _refused(swap("gate_up", 5, _bf16(ROWS, I).astype(np.float32)), "h: expected bf16")
    _refused(swap("gate_up", 5, _bf16(ROWS, I), g=_bf16(ROWS, 128)), r"g: expected shape")
    _refused(swap("down", 1, _blocks(128, I)), "H=128 must be a multiple of 256")
    _refused(swap("down", 4, _bf16(ROWS, H), row_scale=np.ones(ROWS, np.float64)), "row_scale: expected f32")
    _refused(swap("down_bwd", 2, _bf16(ROWS, 128)), r"g: expected shape \(384, 256\)")
    _refused(swap("gate_up_bwd", 1, _rows(ROWS, 128)), r"du codes: expected shape \(384, 256\)")
    _refused(swap("gate_up_bwd", 3, _blocks(H, 128)), r"w_up codes: expected shape")
    _refused(swap("down_wgrad", 0, _rows(I, 200)), "rows=200 must be a multiple of 128")
    _refused(swap("down_wgrad", 1, _rows(H, 256)), r"dy_t codes: expected shape \(512, 384\)")
    _refused(swap("gate_up_wgrad", 6, np.zeros((E, H, I), np.float64)), "dw_up: expected f32")
    _refused(swap("gate_up_wgrad", 3, np.zeros(3, np.int64)), "row_offsets: expected i32")
    too_many = np.zeros(gemm.MAX_GROUPS + 1, np.int32)
    _refused(swap("down", 2, too_many), "row_counts: expected shape")
    fn, args, _ = calls["down"]
    with pytest.raises(ValueError, match="1 to 1024 experts"):
        fn(*args[:2], too_many, too_many, *args[4:])


def test_smem_and_tiles_fit_the_abi():
    # every FP8 problem keeps gemm.cuh's tile: 128 rows x 256 columns, k-blocks of one scale block
    assert (gemm_fp8.BM, gemm_fp8.BN, gemm_fp8.BK) == (128, 256, abi.CONST["kQuantBlock"])
    assert abi.FP8_GEMM_PARAMS in abi.STRUCTS and abi.FP8_GEMM_PARAMS.namespace == "mok::gemm_fp8"
    shared = set(abi.GEMM_PARAMS.names) & set(abi.FP8_GEMM_PARAMS.names)
    # the fields gemm.cuh's reused building blocks read, under the same names
    assert {"num_groups", "m", "n", "k", "ldo", "o_group_stride", "k_split", "timeout_ns", "out1", "out2", "out3",
            "row_scale", "row_offsets", "row_counts", "error", "tmap_aux1", "tmap_aux2", "accumulate"} <= shared
