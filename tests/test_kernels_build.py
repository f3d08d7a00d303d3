"""CPU checks of the kernel layer: every registered kernel compiles with NVRTC (as on the GPU path)
for each architecture its module is written for, and ptxas assembles it (the ABI itself:
tests/test_abi.py)."""

import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from mok_proto import abi
from mok_proto.kernels import build, comm, features, fp8, fused, gemm, gemm_fp8, token  # noqa: F401 - registers the modules
import kernel_ptx
import kernel_sass
from kernel_ptx import GROUP, compile_module, ptxas_report

NVCC = shutil.which("nvcc")
SPILL_FREE = ("gemm.cuh", "gemm_fp8.cuh")  # the standalone GEMM tiles: ptxas -v must show no spills
# Bytes of spill loads a fused kernel may have (its shared storage addressed in 32 bits: hopper.cuh
# aligned_shared; a 64-bit storage base is spilled, and reloaded in the GEMM k-loops).
FUSED_SPILL_LOADS = 2048
# Local-memory accesses a GEMM k-loop may hold, by kernel (default 0): fused_forward reloads a
# spilled word on the path that fills the fault record after a timed-out wait, never taken otherwise.
KLOOP_LOCAL = {"fused_forward": 1}


def _modules():
    return sorted(build.MODULES)


def _targets(variants: bool = True):
    """(module key, arch) pairs; variants=False: the plain modules only (a variant differs by a macro)."""
    return [(key, arch) for key in _modules() for arch in build.MODULES[key].archs
            if variants or not build.MODULES[key].defines]


@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("header,arch", _targets(variants=False))
def test_every_kernel_assembles_without_loss(header, arch):
    """NVRTC's ptxas assembles each plain module without a warning of lost performance, the
    standalone GEMM tiles without spills, and the fused kernels within FUSED_SPILL_LOADS."""
    out = ptxas_report(header, arch)
    assert "Used" in out  # ptxas reported registers for the kernels
    # e.g. C7515: wgmma serialized because non-wgmma instructions define its accumulators mid-pipeline
    assert "Potential Performance Loss" not in out, [l for l in out.splitlines() if "Loss" in l]
    if header in SPILL_FREE:  # their register budgets (setmaxnreg) are chosen so that nothing spills
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
        assert spills and all(s == ("0", "0") for s in spills), f"{header} spills registers: {spills}"
        # nor keeps an array in local memory (a register array indexed at run time: no spill, a stack frame)
        frames = re.findall(r"(\d+) bytes stack frame", out)
        assert frames and set(frames) == {"0"}, f"{header} has stack frames: {frames}"
    if header == "fused.cuh":
        loads = {name: int(n) for name, n in re.findall(r"entry function '(\w+)'.*?(\d+) bytes spill loads", out, re.S)
                 if "fused_" in name}
        assert len(loads) == 4 and max(loads.values()) <= FUSED_SPILL_LOADS, loads


@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("header", ("gemm.cuh", "gemm_fp8.cuh", "fused.cuh"))
def test_no_gemm_k_loop_touches_local_memory(header):
    """No k-loop of a GEMM tile, standalone or fused, loads or stores local memory (within
    KLOOP_LOCAL): a spilled register reloaded every k-block slows every tile, and ptxas -v counts a
    kernel's spills, not where they are."""
    sass = kernel_sass.functions(kernel_sass.module_sass(header, "sm_90a"))
    checked = 0
    for name, (instructions, labels) in sass.items():
        kernel = next((k for k in ("fused_forward_fp8", "fused_backward_fp8", "fused_forward", "fused_backward",
                                   "grouped_gemm") if k in name), None)
        if kernel is None:
            continue
        loops = kernel_sass.gemm_loops(instructions, labels)
        assert loops, f"{name}: no k-loop found (the listing's format changed?)"
        checked += 1
        worst = max(len(loop.local) for loop in loops)
        assert worst <= KLOOP_LOCAL.get(kernel, 0), (name, [(hex(l.start), l.local) for l in loops if l.local])
        assert not any(loop.calls for loop in loops), f"{name}: a k-loop calls code this check does not read"
    assert checked == {"gemm.cuh": 6, "gemm_fp8.cuh": 6, "fused.cuh": 4}[header]


@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("header", ("gemm.cuh", "gemm_fp8.cuh"))
def test_the_build_without_epilogue_keeps_every_mma(header):
    """bench_gemm.py --epilogue-share times the build without epilogue as the same main loops: each
    GEMM kernel's k-loops issue the default build's wgmma instructions (ptxas drops the MMAs of
    accumulators that nothing reads), and the kernel is shorter (the header knows the macro)."""
    def kernels(key):
        return {name: listing for name, listing in kernel_sass.functions(kernel_sass.module_sass(key, "sm_90a")).items()
                if "grouped_gemm" in name}

    default, bare = kernels(header), kernels(f"{header} -D{gemm.NO_EPILOGUE}")
    assert len(default) == 6 and default.keys() == bare.keys()
    for name, listing in default.items():
        loops = [loop.mmas for loop in kernel_sass.gemm_loops(*listing)]
        assert loops and [loop.mmas for loop in kernel_sass.gemm_loops(*bare[name])] == loops, name
        assert len(bare[name][0]) < len(listing[0]), f"{name}: the build without epilogue is not shorter"


@pytest.mark.xdist_group(GROUP)
def test_fp8_down_bwd_stays_near_the_bf16_kernels_size():
    """FP8 down_bwd's epilogue (the SwiGLU backward, then dg, du quantized) once had its warps
    stalled on instruction fetch, its kernel grown by inlined IEEE divisions and four unrolled
    passes (docs/LOG.md 2026-12-07). With fp8::Divisor and the rolled passes it stays within 1.5x
    the BF16 down_bwd's SASS (the FP8 k-loop's promotions and scale loads are most of the rest)."""
    def size(key):
        tag = f"grouped_gemmILi{gemm.PROBLEMS.index('down_bwd')}E"
        listing = kernel_sass.functions(kernel_sass.module_sass(key, "sm_90a"))
        (instructions,) = [body for name, (body, _) in listing.items() if tag in name]
        return len(instructions)

    fp8_size, bf16_size = size("gemm_fp8.cuh"), size("gemm.cuh")
    assert fp8_size <= 1.5 * bf16_size, (fp8_size, bf16_size)


def test_gemm_loops_are_the_innermost_loops_with_a_wgmma():
    # a listing of nvdisasm's shape: an outer loop holding a k-loop (wgmma, a `continue` back to its
    # start, one spill reload after it) and a loop without wgmma (a spill store): only the k-loop
    # counts, up to its last branch back, with its reload
    listing = """//--------------------- .text.kernel --------------------------
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
.L_x_2:
        /*0020*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0030*/              @P3 BRA `(.L_x_2) ;
        /*0040*/                   LDL.64 R4, [R1] ;
        /*0050*/              @P0 BRA `(.L_x_2) ;
.L_x_3:
        /*0060*/                   STL [R1+0x8], R6 ;
        /*0070*/              @P1 BRA `(.L_x_3) ;
        /*0080*/              @P2 BRA `(.L_x_1) ;
        /*0090*/                   EXIT ;
"""
    instructions, labels = kernel_sass.functions(listing)["kernel"]
    assert labels == {".L_x_1": 0x10, ".L_x_2": 0x20, ".L_x_3": 0x60}
    loops = kernel_sass.gemm_loops(instructions, labels)
    assert [(loop.start, loop.end, len(loop.local)) for loop in loops] == [(0x20, 0x50, 1)]
    assert "LDL.64 R4, [R1]" in loops[0].local[0] and loops[0].mmas == ("HGMMA.64x256x16.F32.BF16",)
    assert loops[0].calls == ()


def test_source_digest_covers_the_header_and_its_includes(tmp_path, monkeypatch):
    (tmp_path / "a.cuh").write_text('#include "b.cuh"\n// a\n')
    (tmp_path / "b.cuh").write_text('#include "c.cuh"\n#include <cstdint>\n')
    (tmp_path / "c.cuh").write_text("// c\n")
    (tmp_path / "d.cuh").write_text("// d\n")
    monkeypatch.setattr(build, "CUDA_DIR", tmp_path)
    assert [p.name for p in build.includes("a.cuh")] == ["a.cuh", "b.cuh", "c.cuh"]
    before = {h: build.source_digest(h) for h in ("a.cuh", "c.cuh", "d.cuh")}
    (tmp_path / "c.cuh").write_text("// c changed\n")  # a includes c through b: its digest moves too
    after = {h: build.source_digest(h) for h in before}
    assert after["a.cuh"] != before["a.cuh"] and after["c.cuh"] != before["c.cuh"] and after["d.cuh"] == before["d.cuh"]
    (tmp_path / "d.cuh").write_text('#include "c.cuh"\n// d now includes c\n')
    assert build.source_digest("d.cuh") != after["d.cuh"] and build.includes("d.cuh")[0].name == "c.cuh"


def test_editing_a_header_recompiles_only_the_modules_that_include_it(tmp_path, monkeypatch):
    copy = tmp_path / "cuda"
    shutil.copytree(build.CUDA_DIR, copy)
    monkeypatch.setattr(build, "CUDA_DIR", copy)
    headers = sorted({m.header for m in build.MODULES.values()})
    before = {h: build.source_digest(h) for h in headers}
    with (copy / "fused.cuh").open("a") as f:
        f.write("// a comment\n")
    changed = {h for h in headers if build.source_digest(h) != before[h]}
    assert changed == {"fused.cuh"}
    with (copy / "common.cuh").open("a") as f:  # every kernel module includes common.cuh
        f.write("// a comment\n")
    assert {h for h in headers if build.source_digest(h) != before[h]} == set(headers)


def test_unregistered_name_is_refused():
    with pytest.raises(KeyError, match="not registered"):
        comm.MODULE.function("mok::no_such_kernel")


@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("header,arch", _targets())
def test_every_kernel_compiles_with_nvrtc(header, arch):
    """The GPU path compiles with NVRTC (CuPy RawModule), not nvcc: no standard headers, no
    offsetof builtin, name expressions. Same options and name expressions as build._compile; a plain
    module to SASS (sm_XX: the build the test above reads), a variant to PTX (compute_XX, a faster
    compile): it differs by a macro."""
    compiled = compile_module(header, arch if not build.MODULES[header].defines else arch.replace("sm_", "compute_"))
    assert compiled.ok, compiled.log[-4000:]
    assert ".entry" in compiled.ptx
    missing = [name for name in build.MODULES[header].names if not compiled.lowered[name]]
    assert not missing, missing


@pytest.mark.xdist_group(GROUP)
def test_linked_movers_of_two_ranks_fit_an_sm_together():
    """With the emulated link (MOK_LINK) two virtual ranks each launch 4 mover blocks of kCommThreads
    per SM: 8 blocks must be resident at once (at most 32 registers a thread), or the second rank's
    blocks wait for a second wave and every round trip is paid twice."""
    out = ptxas_report("comm.cuh -DMOK_LINK", "sm_90a")
    regs = {}
    for name, used in re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", out, re.S):
        regs[name] = int(used)
    movers = {n: r for n, r in regs.items() if re.search(r"(dispatch|combine)_(pull|push)", n)}
    assert len(movers) == 8 and max(movers.values()) <= 65536 // (8 * abi.CONST["kCommThreads"]), movers


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit needed to compile kernels)")
def test_the_quantizers_keep_subnormals_under_ftz(tmp_path):
    """CuPy compiles every module with -ftz=true after our options (a later -ftz wins), which turns
    C++ float operations into their flushing PTX forms; the quantization rule keeps float32
    subnormals. Compiled so, no instruction of a quantizer kernel (cuda/fp8.cuh) flushes."""
    src = tmp_path / "fp8.cu"
    src.write_text(build.MODULES["fp8.cuh"].instantiation_source())
    ptx = tmp_path / "fp8.ptx"
    proc = subprocess.run([NVCC, *build.CXX_OPTIONS, "-ftz=true", "-arch=sm_90a", f"-I{build.CUDA_DIR}", "-ptx",
                           str(src), "-o", str(ptx)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kernels = ptx.read_text().split(".entry ")[1:]
    assert len(kernels) >= 10  # the row, block and segment quantizers of each input type
    flushing = {k.split("(")[0]: sorted(set(re.findall(r"\b\w+(?:\.\w+)*\.ftz\b(?:\.\w+)*", k))) for k in kernels}
    assert not any(flushing.values()), {k: v for k, v in flushing.items() if v}


def test_rows_of_experimental_variants_stay_out_of_what_results_load(tmp_path):
    import json

    from mok_proto import results

    rows = [{"time": "2026-12-06T05:00:00+00:00", "git": "a", "problem": "down"},
            {"time": "2026-12-06T05:01:00+00:00", "git": "a", "problem": "down", "gemm_variant": 0},
            {"time": "2026-12-06T05:02:00+00:00", "git": "a", "problem": "down", "gemm_variant": 3},
            {"time": "2026-12-06T05:03:00+00:00", "git": "a", "problem": "down", "fused_variant": 2},
            {"time": "2026-12-06T05:04:00+00:00", "git": "a", "problem": "down", "fp8_mainloop": 1},
            # the variants the default kernels adopted (features.ADOPTED) measured today's kernels
            {"time": "2026-12-06T05:05:00+00:00", "git": "a", "problem": "down", "gemm_variant": 1},
            {"time": "2026-12-06T05:06:00+00:00", "git": "a", "problem": "down", "gemm_variant": 1, "fp8_mainloop": 3},
            {"time": "2026-12-06T05:07:00+00:00", "git": "a", "problem": "down", "gemm_variant": 1, "fused_variant": 4},
            {"time": "2026-12-06T05:08:00+00:00", "git": "a", "problem": "down", "fp8_variant": 1},
            # an adopted field recorded with the value it replaced: the old code, not today's
            {"time": "2026-12-06T05:09:00+00:00", "git": "a", "problem": "down", "fp8_mainloop": 0},
            {"time": "2026-12-06T05:10:00+00:00", "git": "a", "problem": "down", "fp8_mainloop": 3}]
    (tmp_path / "bench_gemm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["time"][11:16] for r in results.load("bench_gemm", tmp_path)] == ["05:00", "05:05", "05:06", "05:10"]
    assert len(results.load("bench_gemm", tmp_path, experimental=True)) == 11
    assert not set(features.VARIANT_FIELDS) & set(features.CURRENT)


def test_a_kept_compile_is_named_by_everything_it_depends_on(tmp_path, monkeypatch):
    """kernel_ptx keeps compiles on disk: the same header, includes, options and compiler give the
    same file, wherever the checkout is; an edited include, another option, other name expressions
    or another NVRTC give another."""
    lib = kernel_ptx.need_nvrtc()
    monkeypatch.setenv(kernel_ptx.CACHE_ENV, str(tmp_path / "kept"))
    module = build.MODULES["token.cuh"]
    here = kernel_ptx._cache_file(lib, module, [b"-std=c++17", b"--gpu-architecture=sm_90a", f"-I{build.CUDA_DIR}".encode()])
    copy = tmp_path / "cuda"
    shutil.copytree(build.CUDA_DIR, copy)
    monkeypatch.setattr(build, "CUDA_DIR", copy)
    options = [b"-std=c++17", b"--gpu-architecture=sm_90a", f"-I{copy}".encode()]
    first = kernel_ptx._cache_file(lib, module, options)
    assert first == here and first.parent == tmp_path / "kept"
    assert kernel_ptx._cache_file(lib, module, options[:1] + [b"--gpu-architecture=sm_100a"] + options[2:]) != first
    assert kernel_ptx._cache_file(lib, module, options + [b"-DMOK_LINK"]) != first

    class OtherNvrtc:  # another minor version of NVRTC
        @staticmethod
        def nvrtcVersion():
            return lib.nvrtcVersion()[0], 99, 0

    assert kernel_ptx._cache_file(OtherNvrtc, module, options) != first
    other_names = SimpleNamespace(header=module.header, names=module.names + ("mok::an_added_instantiation",))
    assert kernel_ptx._cache_file(lib, other_names, options) != first
    with (copy / "common.cuh").open("a") as f:  # token.cuh includes common.cuh
        f.write("// a comment\n")
    assert kernel_ptx._cache_file(lib, module, options) != first
    monkeypatch.setenv(kernel_ptx.CACHE_ENV, "0")
    assert kernel_ptx._cache_file(lib, module, options) is None


def test_a_kept_compile_is_the_compilers_answer(tmp_path, monkeypatch):
    """A compile read back from disk, without compiling, equals the compile; a damaged kept file is
    compiled again and replaced."""
    monkeypatch.setenv(kernel_ptx.CACHE_ENV, str(tmp_path))
    compile_once = kernel_ptx.compile_module.__wrapped__  # past the per-process cache
    fresh = compile_once("token.cuh", "compute_90a")
    (kept,) = tmp_path.glob("*.json.gz")
    compiler = kernel_ptx._compile

    def no_compile(*args):
        raise AssertionError("compiled although the compile is kept")

    monkeypatch.setattr(kernel_ptx, "_compile", no_compile)
    assert fresh.ok and compile_once("token.cuh", "compute_90a") == fresh
    monkeypatch.setattr(kernel_ptx, "_compile", compiler)
    data = bytearray(kept.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the deflate stream
    kept.write_bytes(bytes(data))
    assert compile_once("token.cuh", "compute_90a") == fresh
    assert kept.read_bytes() != bytes(data) and list(tmp_path.iterdir()) == [kept]  # replaced, no leftovers


def _offsetof_seen_by_nvrtc(text: str) -> list[int]:
    """Line numbers of `text` (a header) with an offsetof that NVRTC compiles: outside every
    #ifndef __CUDACC_RTC__ / #if !defined(__CUDACC_RTC__) block (an #else of one shows its lines)."""
    hidden = re.compile(r"#\s*(ifndef\s+__CUDACC_RTC__|if\s+!\s*defined\s*\(?\s*__CUDACC_RTC__\b)")
    stack, found = [], []  # one entry per open #if: whether it hides its lines from NVRTC
    for number, line in enumerate(text.splitlines(), 1):
        directive = re.sub(r"^#\s*", "#", line.strip())
        if directive.startswith("#if"):
            stack.append(bool(hidden.match(directive)))
        elif directive.startswith(("#else", "#elif")):
            stack[-1] = False
        elif directive.startswith("#endif"):
            stack.pop()
        elif "offsetof" in line and not line.lstrip().startswith("//") and not any(stack):
            found.append(number)
    return found


def test_no_offsetof_reaches_nvrtc():
    """The GPU machine's NVRTC has no offsetof (`__builtin_offsetof` is an undefined identifier
    there, though the CPU's NVRTC accepts it): a layout check using it compiles only outside NVRTC
    (`#ifndef __CUDACC_RTC__`, as abi.cuh's), or every kernel of its header fails to build on the GPU."""
    offenders = [f"{header.name}:{n}" for header in sorted(build.CUDA_DIR.glob("*.cuh"))
                 for n in _offsetof_seen_by_nvrtc(header.read_text())]
    assert not offenders, offenders


def test_the_offsetof_check_reads_the_guards_spellings():
    check = "static_assert(offsetof(S, b) % 16 == 0);"
    for guard in ("#ifndef __CUDACC_RTC__", "# ifndef  __CUDACC_RTC__", "#if !defined(__CUDACC_RTC__)",
                  "#  if !defined __CUDACC_RTC__"):
        assert _offsetof_seen_by_nvrtc(f"{guard}\n{check}\n#endif\n") == [], guard
        assert _offsetof_seen_by_nvrtc(f"{guard}\n#else\n{check}\n#endif\n") == [3], guard
    for guard in ("#ifdef __CUDACC_RTC__", "#if defined(__CUDACC_RTC__)", "#ifndef MOK_LINK"):
        assert _offsetof_seen_by_nvrtc(f"{guard}\n{check}\n#endif\n") == [2], guard
    assert _offsetof_seen_by_nvrtc(f"// {check}\n{check}\n") == [2]
