"""mok_proto.bench.ncu_source on a hand-written export of ncu's source page (CSV, its layout)."""

import pytest

from mok_proto.bench import ncu_source

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_no_inst",'
          '"stall_wait","stall_no_inst (Not Issued)"')


def _kernel(name, rows):
    return [f'"Kernel Name","{name}",', HEADER] + [",".join(f'"{v}"' for v in r) for r in rows]


# k-loop (two blocks run 100 times), an epilogue run 4 times split by a block run once
LOOPS = [("0x10", "LDG", 1, 4, 0, 1, 0), ("0x20", "HGMMA", 30, 100, 0, 20, 0), ("0x30", "BRA", 10, 100, 0, 5, 0),
         ("0x40", "FFMA", 20, 4, 15, 2, 9), ("0x50", "BAR", 5, 1, 0, 5, 0), ("0x60", "FCHK", 34, 4, 30, 1, 9)]


@pytest.fixture
def export(tmp_path):
    again = [r[:2] + (r[2] + 1,) + r[3:] for r in LOOPS]  # a second launch of the same kernel
    lines = (_kernel("gemm<2>", LOOPS) + _kernel("gemm<2>", LOOPS)  # ncu prints a listing twice
             + _kernel("gemm<2>", again) + _kernel("other", LOOPS[:2]))
    path = tmp_path / "source.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_keeps_each_listing_once(export):
    kernels = ncu_source.load(export)
    assert [k.name for k in kernels] == ["gemm<2>", "gemm<2>", "other"]
    assert [r["Address"] for r in kernels[0].rows] == ["0x10", "0x20", "0x30", "0x40", "0x50", "0x60"]


def test_regions_by_run_and_by_count(export):
    kernel = ncu_source.load(export)[0]
    runs = ncu_source.regions(kernel)
    assert [(r.first, r.instructions, r.executed, r.samples) for r in runs] == [
        ("0x10", 1, 4, 1), ("0x20", 2, 100, 40), ("0x40", 1, 4, 20), ("0x50", 1, 1, 5), ("0x60", 1, 4, 34)]
    by_count = {r.executed: r for r in ncu_source.regions(kernel, by_count=True)}
    assert (by_count[4].instructions, by_count[4].samples) == (3, 55)  # 0x10, 0x40 and 0x60, apart
    assert by_count[4].stalls == {"no_inst": 45, "wait": 4}  # the (Not Issued) columns are not added in


def test_report_ranks_regions_and_names_their_stalls(export):
    text = ncu_source.report(ncu_source.load(export)[0], by_count=True, top=2)
    lines = text.splitlines()
    assert lines[0].startswith("gemm<2>: 6 instructions, 100 samples; stalls no_inst 45%, wait 34%")
    assert "55.0%  no_inst 82%, no reason 11%, wait 7%" in lines[2] and lines[2].split()[:3] == ["0x10", "3", "4"]
    assert "40.0%" in lines[3] and len(lines) == 4


def test_main_filters_kernels_and_refuses_an_unknown_one(export, capsys):
    assert ncu_source.main([str(export), "--kernel", "other"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[3] other:") and "gemm<2>" not in out
    with pytest.raises(SystemExit):
        ncu_source.main([str(export), "--kernel", "nothing"])
    assert "no kernel in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ncu_source.main([str(export) + ".missing"])
    (export.parent / "bare.csv").write_text('"Kernel Name","k",\n"Address","Source"\n"0x10","NOP"\n')
    with pytest.raises(SystemExit):
        ncu_source.main([str(export.parent / "bare.csv")])
    assert "SourceCounters" in capsys.readouterr().err
