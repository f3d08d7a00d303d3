"""Numerics of the grouped expert GEMMs (cuda/gemm.cuh) against a float64 reference computed from
the same bf16-rounded inputs. Ragged experts: 0, 1, 129, 300 and 64 rows, with gaps between
segments that must stay untouched (NaN sentinels)."""

import numpy as np
import pytest

from mok_proto import abi
from mok_proto.errors import KernelTimeoutError
from mok_proto.kernels.errors import ErrorRecord

pytestmark = pytest.mark.gpu

BF16_TOL = 2.0 ** -7  # 2x bf16's relative rounding step, against max |ref| of the array
FP32_TOL = 1e-4
COUNTS = [0, 1, 129, 300, 64]
GAP = 3  # rows between expert segments


def _setup(hidden, ffn, seed=0, counts=COUNTS):
    import cupy
    from mok_proto.kernels.gemm import from_bf16, to_bf16

    rng = np.random.default_rng(seed)
    counts = np.array(counts, np.int32)
    offsets = (np.concatenate([[0], np.cumsum(counts[:-1])]) + GAP * np.arange(len(counts))).astype(np.int32)
    rows = int(offsets[-1] + counts[-1] + GAP)
    e = len(counts)

    def bf(*shape, scale=1.0):
        b = to_bf16(rng.standard_normal(shape).astype(np.float32) * scale)
        return cupy.asarray(b), from_bf16(b).astype(np.float64)

    d = dict(counts=counts, offsets=offsets, rows=rows,
             d_counts=cupy.asarray(counts), d_offsets=cupy.asarray(offsets))
    for name, shape, scale in [("x", (rows, hidden), 1.0), ("w_gate", (e, hidden, ffn), hidden ** -0.5),
                               ("w_up", (e, hidden, ffn), hidden ** -0.5), ("w_down", (e, ffn, hidden), ffn ** -0.5),
                               ("dy", (rows, hidden), 1.0), ("g", (rows, ffn), 1.0), ("u", (rows, ffn), 1.0),
                               ("h", (rows, ffn), 1.0), ("dg", (rows, ffn), 1.0), ("du", (rows, ffn), 1.0)]:
        d[name], d[name + "_ref"] = bf(*shape, scale=scale)
    return d


def _segments(d):
    for e, (off, cnt) in enumerate(zip(d["offsets"], d["counts"])):
        yield e, slice(int(off), int(off + cnt))


def _nan_bf16(rows, cols):
    import cupy

    return cupy.full((rows, cols), 0x7FC0, dtype=np.uint16)  # bf16 NaN


def _assert_rows(name, got_bits, want, d, tol=BF16_TOL):
    from mok_proto.kernels.gemm import from_bf16

    got = from_bf16(got_bits).get().astype(np.float64)
    inside = np.zeros(d["rows"], bool)
    for _, rows in _segments(d):
        inside[rows] = True
    assert np.isnan(got[~inside]).all(), f"{name}: rows outside every expert were written"
    scale = max(np.abs(want[inside]).max(), 1e-30)
    err = np.abs(got[inside] - want[inside]).max() / scale
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.1e}"


def _silu(g):
    return g / (1.0 + np.exp(-g))


@pytest.fixture(params=[(256, 256), (768, 512)], ids=lambda s: f"H{s[0]}-I{s[1]}")
def data(request):
    return _setup(*request.param)


@pytest.fixture(autouse=True, params=[None, 1], ids=["all-clusters", "one-cluster"])
def cluster_cap(request, monkeypatch):
    """Every test twice: on the whole GPU, and on one cluster, which then runs every tile in turn
    (ring wrap-around, aux stages followed by the next tile, duplicate tiles followed by real ones)."""
    from mok_proto.kernels import gemm

    monkeypatch.setattr(gemm, "MAX_CLUSTERS", request.param)
    return request.param


def _run(launch, *args):
    from mok_proto.kernels import gemm

    record = ErrorRecord()
    assert launch(*args, error=record) is record
    record.check()


def test_gate_up(data):
    from mok_proto.kernels import gemm

    d, ffn = data, data["w_gate"].shape[2]
    h, g, u = (_nan_bf16(d["rows"], ffn) for _ in range(3))
    _run(gemm.gate_up, d["x"], d["w_gate"], d["w_up"], d["d_offsets"], d["d_counts"], h, g, u)
    want = {k: np.full((d["rows"], ffn), np.nan) for k in "hgu"}
    for e, rows in _segments(d):
        want["g"][rows] = d["x_ref"][rows] @ d["w_gate_ref"][e]
        want["u"][rows] = d["x_ref"][rows] @ d["w_up_ref"][e]
        want["h"][rows] = _silu(want["g"][rows]) * want["u"][rows]
    for name, got in (("h", h), ("g", g), ("u", u)):
        _assert_rows(name, got, want[name], d)
    h_only = _nan_bf16(d["rows"], ffn)  # without g, u outputs: the same h, bit for bit
    _run(gemm.gate_up, d["x"], d["w_gate"], d["w_up"], d["d_offsets"], d["d_counts"], h_only)
    assert h_only.tobytes() == h.tobytes(), "h differs when g and u are not written"


def test_down_with_and_without_row_scale(data):
    import cupy
    from mok_proto.kernels import gemm

    d, hidden = data, data["w_down"].shape[2]
    scale = np.random.default_rng(1).uniform(0.5, 1.5, d["rows"]).astype(np.float32)
    for row_scale in (scale, None):
        y = _nan_bf16(d["rows"], hidden)
        _run(gemm.down, d["h"], d["w_down"], d["d_offsets"], d["d_counts"], y,
             None if row_scale is None else cupy.asarray(row_scale))
        want = np.full((d["rows"], hidden), np.nan)
        for e, rows in _segments(d):
            want[rows] = (1.0 if row_scale is None else row_scale[rows, None]) * (d["h_ref"][rows] @ d["w_down_ref"][e])
        _assert_rows("y" if row_scale is None else "y (row scale)", y, want, d)


def test_down_bwd_fuses_swiglu_backward(data):
    from mok_proto.kernels import gemm

    d, ffn = data, data["w_down"].shape[1]
    dg, du = _nan_bf16(d["rows"], ffn), _nan_bf16(d["rows"], ffn)
    _run(gemm.down_bwd, d["dy"], d["w_down"], d["g"], d["u"], d["d_offsets"], d["d_counts"], dg, du)
    want_dg, want_du = np.full((d["rows"], ffn), np.nan), np.full((d["rows"], ffn), np.nan)
    for e, rows in _segments(d):
        dh = d["dy_ref"][rows] @ d["w_down_ref"][e].T
        g, u = d["g_ref"][rows], d["u_ref"][rows]
        sig = 1.0 / (1.0 + np.exp(-g))
        want_du[rows] = dh * g * sig
        want_dg[rows] = dh * u * sig * (1.0 + g * (1.0 - sig))
    _assert_rows("dg", dg, want_dg, d)
    _assert_rows("du", du, want_du, d)


def test_gate_up_bwd(data):
    from mok_proto.kernels import gemm

    d, hidden = data, data["w_gate"].shape[1]
    dx = _nan_bf16(d["rows"], hidden)
    _run(gemm.gate_up_bwd, d["dg"], d["du"], d["w_gate"], d["w_up"], d["d_offsets"], d["d_counts"], dx)
    want = np.full((d["rows"], hidden), np.nan)
    for e, rows in _segments(d):
        want[rows] = d["dg_ref"][rows] @ d["w_gate_ref"][e].T + d["du_ref"][rows] @ d["w_up_ref"][e].T
    _assert_rows("dx", dx, want, d)


def test_the_build_without_epilogue_stores_nothing(data):
    """Inside gemm.without_epilogue() (bench_gemm.py --epilogue-share) every problem runs to the
    end (down_bwd's aux stages still pass through the ring) and leaves its outputs as they were;
    after it the wrappers launch the real kernels again."""
    import cupy
    from mok_proto.kernels import gemm

    d = data
    e, hidden, ffn = d["w_gate"].shape
    rows, offs, cnts = d["rows"], d["d_offsets"], d["d_counts"]
    out = {name: _nan_bf16(rows, cols) for name, cols in
           (("h", ffn), ("g", ffn), ("u", ffn), ("y", hidden), ("dg", ffn), ("du", ffn), ("dx", hidden))}
    out.update(dwd=cupy.full((e, ffn, hidden), np.nan, np.float32),
               dwg=cupy.full((e, hidden, ffn), np.nan, np.float32), dwu=cupy.full((e, hidden, ffn), np.nan, np.float32))
    before = {name: a.copy() for name, a in out.items()}
    with gemm.without_epilogue():
        _run(gemm.gate_up, d["x"], d["w_gate"], d["w_up"], offs, cnts, out["h"], out["g"], out["u"])
        _run(gemm.down, d["h"], d["w_down"], offs, cnts, out["y"])
        _run(gemm.down_bwd, d["dy"], d["w_down"], d["g"], d["u"], offs, cnts, out["dg"], out["du"])
        _run(gemm.gate_up_bwd, d["dg"], d["du"], d["w_gate"], d["w_up"], offs, cnts, out["dx"])
        _run(gemm.down_wgrad, d["h"], d["dy"], offs, cnts, out["dwd"])
        _run(gemm.gate_up_wgrad, d["x"], d["dg"], d["du"], offs, cnts, out["dwg"], out["dwu"])
    for name, a in out.items():
        assert a.tobytes() == before[name].tobytes(), f"{name}: written by the build without epilogue"
    _run(gemm.down, d["h"], d["w_down"], offs, cnts, out["y"])
    assert out["y"].tobytes() != before["y"].tobytes(), "after without_epilogue(): y not written"

# (H, I): the fixture's two shapes, plus odd M tile counts (the cluster's last pair has one real
# tile): dWd with I = 128 (1 tile), dWg/dWu with H = 384 (3 tiles; dWd is skipped there, H must be a
# multiple of 256 for it).
@pytest.mark.parametrize("shape", [(256, 256), (768, 512), (512, 128), (384, 128)], ids=lambda s: f"H{s[0]}-I{s[1]}")
def test_weight_grads_deterministic(shape):
    import cupy
    from mok_proto.kernels import gemm

    d = _setup(*shape)
    e, ffn, hidden = d["w_down"].shape
    with_dwd = hidden % 256 == 0
    results = []
    for _ in range(2):
        dwd = cupy.full((e, ffn, hidden), np.nan, np.float32)
        dwg, dwu = (cupy.full((e, hidden, ffn), np.nan, np.float32) for _ in range(2))
        if with_dwd:
            _run(gemm.down_wgrad, d["h"], d["dy"], d["d_offsets"], d["d_counts"], dwd)
        _run(gemm.gate_up_wgrad, d["x"], d["dg"], d["du"], d["d_offsets"], d["d_counts"], dwg, dwu)
        results.append([a.get() for a in (dwd, dwg, dwu)])
    for a, b in zip(*results):
        assert a.tobytes() == b.tobytes(), "weight gradients differ between two identical runs"
    dwd, dwg, dwu = results[0]
    checks = [("dWg", dwg, "x_ref", "dg_ref"), ("dWu", dwu, "x_ref", "du_ref")]
    if with_dwd:
        checks.append(("dWd", dwd, "h_ref", "dy_ref"))
    for ex, rows in _segments(d):
        for name, got_all, a, b in checks:
            got, want = got_all[ex], d[a][rows].T @ d[b][rows]
            if rows.stop == rows.start:
                assert not got.any(), f"{name}[{ex}]: an expert with no rows must get a zero gradient"
                continue
            err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
            assert err <= FP32_TOL, f"{name}[{ex}]: relative error {err:.2e}"


@pytest.mark.parametrize("split", [64, 128], ids=lambda s: f"split{s}")
def test_weight_grads_accumulate_over_split_rows_bitwise(split):
    """Every expert's rows in two launches, the second with accumulate=True from row `split` (a
    multiple of BK) on: the bits of one launch over all rows (the ring's later turns do this)."""
    import cupy
    from mok_proto.kernels import gemm

    d = _setup(768, 512)
    e, ffn, hidden = d["w_down"].shape
    first = np.minimum(d["counts"], split).astype(np.int32)
    parts = [(cupy.asarray(d["offsets"]), cupy.asarray(first), False),
             (cupy.asarray(d["offsets"] + first), cupy.asarray(d["counts"] - first), True)]

    def grads(launches):
        out = [cupy.full((e, ffn, hidden), np.nan, np.float32)] + \
              [cupy.full((e, hidden, ffn), np.nan, np.float32) for _ in range(2)]
        for offsets, counts, accumulate in launches:
            _run(lambda *a, **k: gemm.down_wgrad(*a, accumulate=accumulate, **k), d["h"], d["dy"], offsets, counts,
                 out[0])
            _run(lambda *a, **k: gemm.gate_up_wgrad(*a, accumulate=accumulate, **k), d["x"], d["dg"], d["du"],
                 offsets, counts, out[1], out[2])
        return [a.get() for a in out]

    whole = grads([(d["d_offsets"], d["d_counts"], False)])
    for name, a, b in zip(("dWd", "dWg", "dWu"), whole, grads(parts)):
        assert a.tobytes() == b.tobytes(), f"{name}: two accumulated launches differ from one"
    # the flag is what carries the first part: without it the second launch overwrites
    for a, b in zip(whole, grads([(o, c, False) for o, c, _ in parts])):
        assert a.tobytes() != b.tobytes()


@pytest.mark.parametrize("cluster_cap", [None], indirect=True)  # the test sets the cap itself
def test_tall_experts_run_every_tile_of_their_bands(monkeypatch, cluster_cap):
    """The standalone kernels walk an expert's tiles in bands of at most kBandPairs pair rows (cuda/
    gemm_tiles.cuh banded_tile): experts of 18 pair rows (three bands of 6) and 11 (bands of 6 and 5), and
    weight gradients of 11 pair rows (H = 2816), every tile computed once: a tile named twice leaves
    another unnamed, whose rows stay NaN. The outputs are the same bits whether one cluster runs
    every tile in turn or the whole GPU shares them, and two of them (down's y, gate_up_wgrad's dWg:
    wide and tall) match the float64 reference."""
    import cupy
    from mok_proto.kernels import gemm

    d = _setup(2816, 512, counts=[0, 1, 129, 4500, 700, 2600])
    e, ffn, hidden = d["w_down"].shape
    rows, off, cnt = d["rows"], d["d_offsets"], d["d_counts"]
    inside = np.zeros(rows, bool)
    for _, seg in _segments(d):
        inside[seg] = True

    def outputs(clusters):
        monkeypatch.setattr(gemm, "MAX_CLUSTERS", clusters)
        h, g, u, dg, du = (_nan_bf16(rows, ffn) for _ in range(5))
        y, dx = _nan_bf16(rows, hidden), _nan_bf16(rows, hidden)
        dwd = cupy.full((e, ffn, hidden), np.nan, np.float32)
        dwg, dwu = (cupy.full((e, hidden, ffn), np.nan, np.float32) for _ in range(2))
        _run(gemm.gate_up, d["x"], d["w_gate"], d["w_up"], off, cnt, h, g, u)
        _run(gemm.down, d["h"], d["w_down"], off, cnt, y)
        _run(gemm.down_bwd, d["dy"], d["w_down"], d["g"], d["u"], off, cnt, dg, du)
        _run(gemm.gate_up_bwd, d["dg"], d["du"], d["w_gate"], d["w_up"], off, cnt, dx)
        _run(gemm.down_wgrad, d["h"], d["dy"], off, cnt, dwd)
        _run(gemm.gate_up_wgrad, d["x"], d["dg"], d["du"], off, cnt, dwg, dwu)
        return {"h": h, "g": g, "u": u, "y": y, "dg": dg, "du": du, "dx": dx, "dWd": dwd, "dWg": dwg, "dWu": dwu}

    whole, one = outputs(None), outputs(1)
    for name, a in whole.items():
        values = gemm.from_bf16(a).get() if a.dtype == np.uint16 else a.get()
        covered = values[inside] if a.dtype == np.uint16 else values
        assert not np.isnan(covered).any(), f"{name}: a tile was never computed"
        assert a.tobytes() == one[name].tobytes(), f"{name}: one cluster and the whole GPU differ"
    want = np.full((rows, hidden), np.nan)
    for ex, seg in _segments(d):
        want[seg] = d["h_ref"][seg] @ d["w_down_ref"][ex]
    _assert_rows("y", whole["y"], want, d)
    dwg = whole["dWg"].get()
    for ex, seg in _segments(d):
        ref = d["x_ref"][seg].T @ d["dg_ref"][seg]
        err = np.abs(dwg[ex] - ref).max() / max(np.abs(ref).max(), 1e-30)
        assert err <= FP32_TOL, f"dWg[{ex}]: relative error {err:.2e}"


def test_launch_on_a_failed_error_record_does_nothing():
    from mok_proto.kernels import gemm

    d = _setup(256, 256)
    ffn = d["w_gate"].shape[2]
    h = _nan_bf16(d["rows"], ffn)
    import cupy

    record = ErrorRecord()
    fields = dict.fromkeys(abi.ERROR_RECORD.names, 0)
    fields.update(code=abi.ERROR_CODE["kErrTimeout"], op=abi.OP["kOpGemmMma"], detail=abi.GEMM_PROBLEM["kDown"])
    record.words[...] = cupy.asarray(abi.ERROR_RECORD.pack(fields))  # an earlier launch's timeout, say
    gemm.gate_up(d["x"], d["w_gate"], d["w_up"], d["d_offsets"], d["d_counts"], h, error=record)
    with pytest.raises(KernelTimeoutError, match="GEMM consumer .* of grouped GEMM down timed out"):
        record.check()
    assert np.isnan(gemm.from_bf16(h).get()).all(), "a launch on a failed error record must not run its tiles"


def test_default_error_record_is_returned_and_checked():
    from mok_proto.kernels import gemm

    d = _setup(256, 256)
    h = _nan_bf16(d["rows"], d["w_gate"].shape[2])
    record = gemm.gate_up(d["x"], d["w_gate"], d["w_up"], d["d_offsets"], d["d_counts"], h)
    assert record is gemm.site_record("gate_up")
    record.check()
    got = gemm.from_bf16(h).get()
    for _, rows in _segments(d):
        assert np.isfinite(got[rows]).all(), "every expert row is written under the default record"


def test_smem_size_comes_from_the_compiled_header():
    from mok_proto.kernels import gemm

    smem = gemm.smem_bytes()
    stages = abi.CONST["kStages"] * (abi.CONST["kBM"] + abi.CONST["kBN"]) * abi.CONST["kBK"] * 2
    assert stages < smem <= 227 * 1024, smem


def test_bad_shapes_are_refused():
    import cupy
    from mok_proto.kernels import gemm

    x = cupy.zeros((8, 100), np.uint16)  # H = 100 is not a multiple of BK = 64
    w = cupy.zeros((1, 100, 128), np.uint16)
    offs, cnts = cupy.zeros(1, np.int32), cupy.ones(1, np.int32)
    with pytest.raises(ValueError, match="multiple of 64"):
        gemm.gate_up(x, w, w, offs, cnts, cupy.zeros((8, 128), np.uint16))
    with pytest.raises(ValueError, match="expected bf16"):
        gemm.gate_up(x.astype(np.float32), w, w, offs, cnts, cupy.zeros((8, 128), np.uint16))
