"""The FP8 segment quantizers' wrappers on the CPU (mok_proto/kernels/fp8.py; no GPU, nothing
launches): their checks before any launch, the column quantizer's tensor map of x, and what each
packs into QuantParams (its bounded wait's record and timeout included)."""

import numpy as np
import pytest

from mok_proto import abi
from mok_proto.kernels import fp8 as kq
from mok_proto.kernels import gemm

from conftest import SiteRecord


def _segment_args(rows=512, cols=384, dtype=np.uint16):
    return (np.zeros((rows, cols), dtype), np.zeros(3, np.int32), np.zeros(3, np.int32))


def test_segment_quantizers_refuse_bad_arguments_before_any_launch(no_launch):
    x, off, cnt = _segment_args()
    codes, scales = np.zeros((512, 384), np.uint8), np.zeros((512, 3), np.float32)
    codes_t, scales_t = np.zeros((384, 512), np.uint8), np.zeros((384, 4), np.float32)
    kq.quantize_segment_rows(x, off, cnt, codes, scales)  # valid: no error
    kq.quantize_segment_columns(x, off, cnt, codes_t, scales_t)
    kq.quantize_segment_columns(codes, off, cnt, codes_t, scales_t, x_scales=scales)
    refused = [
        (kq.quantize_segment_rows, (np.zeros((512, 200), np.uint16), off, cnt, codes, scales), {},
         "K=200 must be a multiple of 128"),
        (kq.quantize_segment_rows, (x.astype(np.int64), off, cnt, codes, scales), {}, "expected fp32 or bf16"),
        (kq.quantize_segment_rows, (x, off, cnt, None, scales), {}, "codes: expected .* got None"),
        (kq.quantize_segment_rows, (x, off, cnt, codes, scales[:, :2]), {}, r"scales: expected .* \(512, 3\)"),
        (kq.quantize_segment_rows, (x, off.astype(np.int64), cnt, codes, scales), {}, "row_offsets: expected"),
        (kq.quantize_segment_rows, (x, off, cnt[:2], codes, scales), {}, "1 to 65535 segments"),
        (kq.quantize_segment_rows, (x[None], off, cnt, codes, scales), {}, "2-D"),
        (kq.quantize_segment_columns, (x[:200], off, cnt, codes_t, scales_t), {}, "rows=200 must be a multiple"),
        (kq.quantize_segment_columns, (x, off, cnt, codes, scales_t), {}, r"codes: expected .* \(384, 512\)"),
        (kq.quantize_segment_columns, (codes, off, cnt, codes_t, scales_t), {}, "x_scales: given exactly when"),
        (kq.quantize_segment_columns, (x, off, cnt, codes_t, scales_t), {"x_scales": scales}, "x_scales: given"),
        (kq.quantize_segment_columns, (codes, off, cnt, codes_t, scales_t), {"x_scales": scales[:, :2]},
         r"x_scales: expected .* \(512, 3\)"),
        (kq.quantize_segment_columns, (np.zeros(512 * 384 + 16, np.uint8)[1:1 + 512 * 384].reshape(512, 384), off,
                                       cnt, codes_t, scales_t), {"x_scales": scales}, "16-byte aligned"),
        (kq.quantize_segment_columns, (np.zeros((512, 300), np.uint16), off, cnt, np.zeros((300, 512), np.uint8),
                                       np.zeros((300, 4), np.float32)), {}, "C=300 at address"),  # 600-byte rows
        (kq.quantize_segment_columns, (np.zeros((512, 130), np.float32), off, cnt, np.zeros((130, 512), np.uint8),
                                       np.zeros((130, 4), np.float32)), {}, "C=130 at address"),  # 520-byte rows
        (kq.quantize_segment_columns, (np.zeros((0, 300), np.uint16), off, cnt, np.zeros((300, 0), np.uint8),
                                       np.zeros((300, 0), np.float32)), {}, "C=300 at address"),  # empty: checked too
    ]
    for fn, args, kwargs, message in refused:
        with pytest.raises(ValueError, match=message):
            fn(*args, **kwargs)


def test_column_quantizer_maps_x_as_the_kernel_stages_it(monkeypatch, own_records):
    """x_map: x as [rows, C] (inner C), boxes of 128 rows x kQuantColumnItemBytes bytes in x's
    element type (the kernel waits for exactly that many bytes a box); an empty x maps nothing
    (and still returns the record)."""
    got, fields = [], []
    monkeypatch.setattr(gemm, "tensor_map", lambda *args: got.append(args) or 7)
    monkeypatch.setattr(kq, "_launch_segments", lambda kernel, grid, f: fields.append(f))
    _, off, cnt = _segment_args()
    scales = np.zeros((512, 3), np.float32)
    codes_t, scales_t = np.zeros((384, 512), np.uint8), np.zeros((384, 4), np.float32)
    for x, kw in ((np.zeros((512, 384), np.float32), {}), (np.zeros((512, 384), np.uint16), {}),
                  (np.zeros((512, 384), np.uint8), {"x_scales": scales})):
        kq.quantize_segment_columns(x, off, cnt, codes_t, scales_t, **kw)
    item = abi.CONST["kQuantColumnItemBytes"]
    assert [args[1:] for args in got] == [(384, 512, item // 4, 128, "f32"), (384, 512, item // 2, 128, "bf16"),
                                          (384, 512, item, 128, "u8")]
    assert [f["x_map"] for f in fields] == [7, 7, 7]
    got.clear(), fields.clear()
    empty = [kq.quantize_segment_columns(np.zeros((0, 384), np.uint16), off, cnt, np.zeros((384, 0), np.uint8),
                                         np.zeros((384, 0), np.float32)),
             kq.quantize_segment_columns(np.zeros((512, 0), np.float32), off, cnt, np.zeros((0, 512), np.uint8),
                                         np.zeros((0, 4), np.float32))]
    assert got == [] and fields == [] and [r.site for r in empty] == ["quantize_segment_columns"] * 2


def test_segment_quantizers_pack_what_the_kernels_read(monkeypatch, own_records):
    got, maps = [], []
    monkeypatch.setattr(kq, "_launch_segments", lambda kernel, grid, fields: got.append((kernel, grid(132), fields)))
    monkeypatch.setattr(kq, "_column_map", lambda x, kind: maps.append((x.shape, x.dtype, kind)) or len(maps))
    x, off, cnt = _segment_args()
    codes, scales = np.zeros((512, 384), np.uint8), np.zeros((512, 3), np.float32)
    codes_t, scales_t = np.zeros((384, 512), np.uint8), np.zeros((384, 4), np.float32)
    given = SiteRecord("the caller's")
    assert kq.quantize_segment_rows(x, off, cnt, codes, scales, pow2=True) is None  # no wait: no record
    own = kq.quantize_segment_columns(np.zeros((512, 384), np.float32), off, cnt, codes_t, scales_t)
    assert kq.quantize_segment_columns(codes, off, cnt, codes_t, scales_t, x_scales=scales, error=given) is given
    assert own.site == "quantize_segment_columns"  # the wrapper's own record, returned to be checked
    # the column quantizer's waits are bounded and report into the record; the row quantizer has none
    assert [(f["error"], f["timeout_ns"]) for _, _, f in got[1:]] == [(own.ptr, gemm.TIMEOUT_NS),
                                                                        (given.ptr, gemm.TIMEOUT_NS)]
    assert "error" not in got[0][2] and gemm.TIMEOUT_NS > 0
    kernels = [k for k, _, _ in got]
    assert kernels == ["mok::fp8::quantize_segment_rows<unsigned short>",
                       "mok::fp8::quantize_segment_columns<float>", "mok::fp8::quantize_segment_columns<unsigned char>"]
    assert set(kernels) <= set(kq.MODULE.names)
    assert got[0][1] == (-(-kq.CTAS_PER_SM * 132 // 3), 3)  # CTAs of one segment per grid row
    assert got[1][1] == got[2][1] == (kq.COLUMN_CTAS_PER_SM * 132,)  # flat: the segments' items spread over the CTAs
    for _, _, fields in got:
        assert fields["num_groups"] == 3 and fields["row_offsets"] is off and fields["row_counts"] is cnt
        assert (fields["rows"], fields["cols"]) == (512, 384)
    assert got[0][2]["pow2"] == 1 and got[1][2]["pow2"] == 0
    assert got[1][2]["x_scales"] == 0 and got[2][2]["x_scales"] is scales
    assert maps == [((512, 384), np.float32, "f32"), ((512, 384), np.uint8, "e4m3")]  # the columns' TMA maps
    assert (got[1][2]["x_map"], got[2][2]["x_map"]) == (1, 2) and "x_map" not in got[0][2]
