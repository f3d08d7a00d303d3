"""docs/results.md and the README's status table are generated from results/ and current
(`python -m mok_proto.results --write` rewrites both), and the generator picks the newest run of
each benchmark on each GPU."""

import json

import pytest

from mok_proto.results import report


def test_docs_results_is_current():
    assert report.DOCS_FILE.read_text() == report.markdown(), \
        "docs/results.md is not what results/ gives: run python -m mok_proto.results --write"


def test_readme_status_table_is_current():
    readme = report.README_FILE.read_text()
    assert report.readme_with_table(readme, report.status_table()) == readme, \
        "README.md's status table is not what results/ gives: run python -m mok_proto.results --write"


def _write(folder, name, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _gemm(time, git, gpu, ratio, **extra):
    return {"time": time, "git": git, "gpu": gpu, "shape": "kimi-k2.7", "routing": "uniform", "problem": "down",
            "rows": 16384, "tflops": {"ours": 700.0, "torch": 720.0, "dense": 780.0}, "ratio": ratio, **extra}


def _comm(direction, shape, ms, pct, **extra):
    return {"time": "2026-12-01T10:00:00+00:00", "git": "abc", "gpu": "NVIDIA H200", "backend": "nvshmem",
            "shape": shape, "ep": 2, "dispatch": direction, "combine": direction,
            "stages": {"schedule": {"median_ms": 0.3}, "dispatch": {"median_ms": ms}, "combine": {"median_ms": ms}},
            "dispatch_gbs": 1.0, "combine_gbs": 1.0, "pct_of_ceiling": {"dispatch": pct, "combine": pct},
            "bit_exact": True, **extra}


def test_newest_run_per_gpu(tmp_path):
    _write(tmp_path, "bench_gemm", [
        _gemm("2026-12-01T10:00:00+00:00", "old", "NVIDIA H200", 0.80),
        _gemm("2026-12-02T10:00:00+00:00", "new", "NVIDIA H200", 0.90, command="python scripts/bench_gemm.py --x",
              fraction_of_dense=0.875),
        _gemm("2026-12-01T12:00:00+00:00", "h100", "NVIDIA H100 80GB HBM3", 0.85)])
    text = report.markdown(tmp_path)
    # one section per GPU, each its newest run only; the recorded command, or the usual one said as such
    assert text.count("## bench_gemm (one GPU, ") == 2
    assert "Commit `new`" in text and "Commit `h100`" in text and "Commit `old`" not in text
    assert "`python scripts/bench_gemm.py --x`" in text
    assert "command not recorded (the benchmark's usual one: `python scripts/bench_gemm.py`)" in text
    assert "| 0.90 |" in text and "| 0.85 |" in text and "| 0.80 |" not in text
    table = report.status_table(tmp_path)
    # the status table: the newest run of all (a row with fraction_of_dense, the dense 8192^3 matmul
    # of its run, shows it)
    assert "| GEMMs (H200, `new`, 2026-12-02) | down | 700 TFLOP/s | 0.90 x `torch._grouped_mm` | | 0.88 |" in table
    assert "`h100`" not in table and "`old`" not in table


def test_machines_and_their_baselines(tmp_path):
    x2 = tmp_path / "x2"
    _write(x2, "bench_comm", [_comm("push", "kimi-k2.7", 0.5, 96.0), _comm("push", "glm-5.2", 0.4, 90.0),
                              _comm("pull", "kimi-k2.7", 0.6, 84.0)])
    nccl = {"time": "2026-12-01T10:00:00+00:00", "git": "abc", "gpu": "NVIDIA H200", "shape": "kimi-k2.7",
            "ranks": 2, "stages": {"dispatch": {"median_ms": 1.0}, "combine": {"median_ms": 1.2},
                                   "layout": {"median_ms": 0.7}},
            "pct_of_link": {"dispatch": 60.0, "combine": 55.0}, "bit_exact": True}
    _write(x2, "bench_nccl_baseline", [nccl])
    assert report.machines(tmp_path) == [("", "one GPU"), ("x2", "2 GPUs, one process each")]
    table = report.status_table(tmp_path)
    # push: both shapes' range; x NCCL only where NCCL ran the shape (kimi: 1.0 / 0.5)
    assert "| dispatch push, 2 shapes | 0.400-0.500 ms, 90-96% of link | 2.00 x NCCL | | |" in table
    assert "| combine pull, 1 shape | 0.600 ms, 84% of link | 2.00 x NCCL | | |" in table
    assert "## bench_comm (2 GPUs, one process each, NVIDIA H200)" in report.markdown(tmp_path)


def test_link_check_rows_have_their_own_table(tmp_path):
    check = {"time": "2026-12-03T10:00:00+00:00", "git": "abc", "gpu": "NVIDIA H200", "backend": "virtual",
             "shape": "kimi-k2.7", "ep": 2, "stage": "dispatch", "direction": "pull", "median_ms": 0.70,
             "link_gbps": 368, "x2_measured_ms": 0.75, "error_vs_x2": 0.70 / 0.75 - 1, "bit_exact": True}
    _write(tmp_path, "bench_comm", [_comm("push", "kimi-k2.7", 0.5, 96.0, backend="virtual"), check])
    text = report.markdown(tmp_path)
    assert "## bench_comm, emulated link (one GPU, NVIDIA H200)" in text
    assert "| kimi-k2.7 | 2 | dispatch | pull | 368 | 0.700 | 0.750 | -6.7% | yes |" in text
    assert text.count("| kimi-k2.7 | 2 |") == 2  # the round's row in one table, the check's in the other


def test_readme_block_is_required():
    with pytest.raises(ValueError, match="status-table block"):
        report.readme_with_table("# no block here\n", "| table |\n")
    text = f"a\n{report.README_BEGIN}\nold\n{report.README_END}\nb\n"
    assert report.readme_with_table(text, "new\n") == f"a\n{report.README_BEGIN}\nnew\n{report.README_END}\nb\n"


def test_layer_rows_at_link_speed_have_their_own_table(tmp_path):
    row = {"time": "2026-12-03T10:00:00+00:00", "git": "abc", "gpu": "NVIDIA H200", "shape": "kimi-k2.7",
           "pass": "fwd", "schedule": "fused", "comm_blocks": 0, "minibatch_tokens": 2048, "claim_pairs": 3872,
           "link_gbps": 368, "median_ms": 3.0, "no_link_median_ms": 2.8, "speedup_vs_sequential": 1.3,
           "overlap_efficiency": 0.85, "equal_to_no_link": True}
    _write(tmp_path, "bench_layer_link", [row])
    text = report.markdown(tmp_path)
    assert "## bench_layer_link (one GPU, NVIDIA H200)" in text
    assert "| kimi-k2.7 | fwd | fused | comm 0, minibatch 2048, claim 3872 | 368 | 3.000 | 2.800 | 1.30 | 0.85 |  | yes |" \
        in text


def test_fraction_of_dense():
    from mok_proto.bench.ceilings import of_dense

    row = of_dense({"shape": "kimi-k2.7", "tflops": 600.0}, 600.0, 800.0)
    assert row == {"shape": "kimi-k2.7", "tflops": 600.0, "dense_tflops": 800.0, "fraction_of_dense": 0.75}
    assert of_dense({"schedule": "x"}, None, 800.0)["fraction_of_dense"] is None  # a row without TFLOP/s


def test_skewed_routing_rows_have_their_own_table_and_leave_the_status_table(tmp_path):
    """A bench_layer run under a skewed routing (its rows' `routing`) gets its own table; the layer's
    table and the README's status line stay the newest uniform run's (rows without `routing` are)."""
    def layer(time, git, schedule, ms, **extra):
        return {"time": time, "git": git, "gpu": "NVIDIA H200", "shape": "kimi-k2.7", "pass": "fwd",
                "schedule": schedule, "median_ms": ms, "link_gbps": None, "speedup_vs_torch": 3.0 / ms, **extra}

    uniform = [layer("2026-12-03T10:00:00+00:00", "uni", s, ms) for s, ms in (("torch", 3.0), ("sequential", 2.0))]
    uniform.append(layer("2026-12-03T10:00:00+00:00", "uni", "fused", 1.8, best_of_run=True,
                         speedup_vs_sequential=1.1, comm_blocks=0, minibatch_tokens=2048))
    hot = [dict(r, time="2026-12-04T10:00:00+00:00", git="hot", routing="hot:0.25", received_rows=46000,
                emulation="5 virtual ranks, rank 0 timed", median_ms=r["median_ms"] * 3, macrobatch_rows=11520,
                memory_bytes=75.36e9, **({"replay_ms": 1.25} if r["schedule"] == "sequential" else {}))
           for r in uniform]
    _write(tmp_path, "bench_layer", uniform + hot)
    table = report.status_table(tmp_path)
    assert "| layer fwd (H200, `uni`, 2026-12-03) | kimi-k2.7 | 1.800 ms (sequential 2.000) |" in table
    assert "`hot`" not in table
    text = report.markdown(tmp_path)
    assert "## bench_layer (one GPU, NVIDIA H200)" in text and "## bench_layer, skewed routing (one GPU, NVIDIA H200)" in text
    assert "| kimi-k2.7 | hot:0.25 | 5 virtual ranks, rank 0 timed | 46000 | 11520 | - | 75.4 | fwd | fused |" in text
    assert "| 46000 | 11520 | 1.250 | 75.4 | fwd | sequential |" in text  # the replay, the EP=64 rank's memory
    assert text.count("| kimi-k2.7 | fwd |") == 3  # the uniform run's three rows, in the layer's table


def test_the_layer_line_compares_the_fused_row_with_the_torch_and_sequential_rows_timed_beside_it(tmp_path):
    """One run (one tree, minutes apart) may hold two commands' rows of a shape; the status line takes
    torch and sequential from the chosen fused row's own command (its `time`), not the other's."""
    def layer(time, schedule, ms, **extra):
        return {"time": time, "git": "abc", "gpu": "NVIDIA H100 80GB HBM3", "shape": "kimi-k2.7", "pass": "fwd",
                "schedule": schedule, "median_ms": ms, "link_gbps": None, **extra}

    first = [layer("2026-12-06T07:02:00+00:00", "torch", 3.5), layer("2026-12-06T07:02:00+00:00", "sequential", 3.0),
             layer("2026-12-06T07:02:00+00:00", "fused", 3.2, speedup_vs_sequential=0.94, comm_blocks=0,
                   minibatch_tokens=2048)]
    second = [layer("2026-12-06T07:06:00+00:00", "torch", 3.9), layer("2026-12-06T07:06:00+00:00", "sequential", 2.9),
              layer("2026-12-06T07:06:00+00:00", "fused", 2.8, speedup_vs_sequential=1.04, comm_blocks=0,
                    minibatch_tokens=2048)]
    _write(tmp_path, "bench_layer", first + second)
    table = report.status_table(tmp_path)
    assert "| kimi-k2.7 | 2.800 ms (sequential 2.900) | 1.39 x torch (3.900 ms) | 1.04 |" in table


def test_the_layer_line_shows_the_sequential_time_its_ratio_is_against(tmp_path):
    """The fused row's x sequential is against the sequential pass timed interleaved with it (and
    again with the retimed best setting): that time is the one shown, not the sequential row's."""
    def layer(schedule, ms, **extra):
        return {"time": "2026-12-07T09:40:00+00:00", "git": "abc", "gpu": "NVIDIA H100 80GB HBM3", "shape": "kimi-k2.7",
                "pass": "fwd", "schedule": schedule, "median_ms": ms, "link_gbps": None, **extra}

    fused = dict(speedup_vs_sequential=0.97, sequential_median_ms=2.96, comm_blocks=0, minibatch_tokens=2048)
    rows = [layer("torch", 3.5), layer("sequential", 2.98), layer("fused", 3.04, **fused)]
    _write(tmp_path, "bench_layer", rows)
    assert "| kimi-k2.7 | 3.040 ms (sequential 2.960) | 1.15 x torch (3.500 ms) | 0.97 |" in report.status_table(tmp_path)
    rows[-1].update(best_of_run=True, retimed_median_ms=2.79, retimed_sequential_median_ms=2.84,
                    retimed_speedup_vs_sequential=1.02)
    _write(tmp_path, "bench_layer", rows)
    assert "| kimi-k2.7 | 2.790 ms (sequential 2.840) | 1.25 x torch (3.500 ms) | 1.02 |" in report.status_table(tmp_path)


def test_fp8_rows_have_their_own_tables_and_status_lines(tmp_path):
    """bench_layer rows of FP8 routed experts (`precision`) leave the BF16 layer's table and line for
    their own; bench_gemm --precision fp8 rows give one status line per problem."""
    def layer(schedule, ms, **extra):
        return {"time": "2026-12-06T08:00:00+00:00", "git": "f8", "gpu": "NVIDIA H200", "shape": "kimi-k2.7",
                "pass": "fwd", "schedule": schedule, "median_ms": ms, "link_gbps": None, "precision": "fp8",
                "dispatch_dtype": "bf16", "speedup_vs_torch": 3.0 / ms, **extra}

    bf16 = [{"time": "2026-12-05T08:00:00+00:00", "git": "b16", "gpu": "NVIDIA H200", "shape": "kimi-k2.7",
             "pass": "fwd", "schedule": s, "median_ms": ms, "link_gbps": None, "speedup_vs_torch": 3.0 / ms,
             **({"best_of_run": True, "speedup_vs_sequential": 1.1} if s == "fused" else {})}
            for s, ms in (("torch", 3.0), ("sequential", 2.2), ("fused", 2.0))]
    fp8 = [layer("torch", 3.0), layer("sequential", 2.0, speedup_vs_torch_fp8=2.25, err_rel_rms=0.0241,
                                      err_max=0.0248, bitwise_repeat=True, fraction_of_dense=0.7),
           layer("sequential", 4.0, routing="hot:0.25"),  # skewed: its own section, not the status line
           layer("sequential", 1.875, dispatch_dtype="fp8"),  # tokens moved in FP8: a line of its own
           layer("sequential", 1.75, wgrad_precision="bf16"),  # bf16 weight gradients: a line of its own
           layer("fused", 1.5, best_of_run=True, retimed_median_ms=1.4, speedup_vs_torch_fp8=3.0, comm_blocks=0,
                 minibatch_tokens=2048, claim_pairs=264)]  # the fused forward: judged as timed again
    _write(tmp_path, "bench_layer", bf16 + fp8)
    _write(tmp_path, "bench_gemm_fp8", [
        {"time": "2026-12-06T09:00:00+00:00", "git": "f8", "gpu": "NVIDIA H200", "shape": s, "routing": "uniform",
         "problem": "gate_up", "rows": 16384, "tflops": {"fp8": t, "bf16": 760.0, "torch_fp8": 1100.0},
         "ratio_vs_bf16": t / 760.0, "ratio_vs_torch_fp8": t / 1100.0, "fraction_of_dense": t / 764.0}
        for s, t in (("kimi-k2.7", 1087.0), ("glm-5.2", 1000.0))])
    table = report.status_table(tmp_path)
    # the BF16 line compares the BF16 run's fused row (2.000 ms) with its own sequential (2.200), not FP8's
    assert "| layer fwd (H200, `b16`, 2026-12-05) | kimi-k2.7 | 2.000 ms (sequential 2.200) |" in table
    assert ("| layer fwd, FP8 experts, bf16 dispatch, sequential (H200, `f8`, 2026-12-06) | 1 shape | 2.000 ms | "
            "1.50 x torch, 2.25 x torch FP8 | | 0.70 |") in table
    assert "| layer fwd, FP8 experts, fp8 dispatch, sequential (H200, `f8`, 2026-12-06) | 1 shape | 1.875 ms | 1.60 x torch |" in table
    assert ("| layer fwd, FP8 experts, bf16 dispatch, bf16 weight gradients, sequential (H200, `f8`, 2026-12-06) | "
            "1 shape | 1.750 ms | 1.71 x torch |") in table
    assert ("| layer fwd, FP8 experts, bf16 dispatch, fused (H200, `f8`, 2026-12-06) | 1 shape | 1.400 ms | 2.14 x torch, "
            "3.21 x torch FP8 | | - |") in table
    assert ("| FP8 GEMMs (H200, `f8`, 2026-12-06) | gate_up | 1000-1087 TFLOP/s | 1.32-1.43 x our BF16, "
            "0.91-0.99 x `torch._scaled_grouped_mm` | | 1.31-1.42 |") in table
    text = report.markdown(tmp_path)
    assert "## bench_layer, FP8 routed experts (one GPU, NVIDIA H200)" in text
    assert "| kimi-k2.7 | fwd | sequential |  | bf16 | fp8 | 2.000 | 1.50 | 2.25 | 0.0241 | 0.0248 | 0.70 | yes |" in text
    assert "routing hot:0.25:" in text and "| kimi-k2.7 | fwd | sequential |  | bf16 | fp8 | 4.000 | 0.75 |" in text
    assert "| kimi-k2.7 | fwd | fused | comm 0, minibatch 2048, claim 264 | bf16 | fp8 | 1.500 | 2.00 | 3.00 |" in text
    assert "| kimi-k2.7 | fwd | sequential |  | bf16 | bf16 | 1.750 |" in text
    assert text.count("| kimi-k2.7 | fwd |") == 9  # BF16: torch, sequential, fused; FP8: torch, sequential x 3, fused, skewed
