"""The README and docs/ stay true: the demo output the README shows is what `./run demo` prints
(every column but the times), the README stays short, and no relative link in README.md or
docs/*.md points to a missing file."""

import re
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, mpiexec_cmd, rank_env

README = ROOT / "README.md"
MAX_README_LINES = 250
# The block between these lines is the demo's output, indented 4 spaces; the end line names the
# OpenBLAS kernel that printed it (the checksums depend on it: docs/LOG.md, 2026-12-05).
BLOCK_START = "<!-- demo output:"
BLOCK_END = re.compile(r"<!-- end demo output \(OpenBLAS kernel: (\w+)\) -->")
# What a CPU needs to run an OpenBLAS kernel forced by OPENBLAS_CORETYPE (x86-64 /proc/cpuinfo flags).
KERNEL_FLAGS = {"SkylakeX": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "Haswell": {"avx2", "fma"},
                "Zen": {"avx2", "fma"}, "Prescott": {"sse3"}}


def readme_demo_block() -> tuple[list[str], str]:
    """(the block's lines without their indent, the OpenBLAS kernel that printed them)."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(BLOCK_START))
    end = next(i for i in range(start, len(lines)) if BLOCK_END.match(lines[i]))
    block = lines[start + 1:end]
    assert block and all(line.startswith("    ") for line in block), block
    return [line[4:].rstrip() for line in block], BLOCK_END.match(lines[end]).group(1)


def cpu_flags() -> set:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@pytest.fixture(scope="module")
def demo_output():
    """What `./run demo` runs (mpiexec -n 4 python -m mok_proto.demo), on the CPU backend, with the
    OpenBLAS kernel the README's block names."""
    _, kernel = readme_demo_block()
    missing = KERNEL_FLAGS[kernel] - cpu_flags()
    if missing:
        pytest.skip(f"the README's demo output comes from OpenBLAS's {kernel} kernel; this CPU lacks {sorted(missing)}")
    env = dict(rank_env(), OPENBLAS_CORETYPE=kernel)
    proc = subprocess.run(mpiexec_cmd(4, "-m", "mok_proto.demo", "--backend", "cpu"), capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line.rstrip() for line in proc.stdout.splitlines()]


def without_times(lines: list[str]) -> list[str]:
    """A rank row loses its fwd_ms and bwd_ms columns; every other line stays as it is."""
    rows = []
    for line in lines:
        fields = line.split()
        if len(fields) == 7 and fields[0].isdigit():
            rows.append(" ".join([fields[0], *fields[3:]]))
        else:
            rows.append(line)
    return rows


@pytest.mark.mpi
def test_readme_demo_output_is_what_the_demo_prints(demo_output):
    """Headers, max_rel_err, the array, both checksums and the verdict; the times may differ."""
    block, _ = readme_demo_block()
    assert len(block) == len(demo_output) == 8, (block, demo_output)
    assert without_times(block) == without_times(demo_output)


def test_without_times_keeps_everything_but_the_times():
    row = "   0     6.02     3.30    4.54e-07 (topk_weights)  df239e9999a65f73  c5e4596109922c01"
    assert without_times([row, "# policy x"]) == ["0 4.54e-07 (topk_weights) df239e9999a65f73 c5e4596109922c01",
                                                   "# policy x"]
    assert without_times([row.replace("6.02", "9.99")]) == without_times([row])
    assert without_times([row.replace("df239e", "df239f")]) != without_times([row])


def test_readme_is_short():
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines, at most {MAX_README_LINES}"


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target), ![alt](target)
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)  # [name]: target


def relative_links(text: str) -> list[str]:
    """Link targets that name a file of the repository: not a URL, not a bare #anchor; code blocks,
    indented (4+ spaces) lines and `code spans` are not markdown links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = LINK.findall(text) + REFERENCE.findall(text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


def test_relative_links_finds_what_it_must():
    text = ("[a](docs/design.md) ![b](fig.png \"t\") [c](https://x.org) [d](#anchor) [e](LOG.md#x)\n"
            "`[f](code.md)`\n    [g](indented.md)\n[h]: ref.md\n```\n[i](fenced.md)\n```\n")
    assert relative_links(text) == ["docs/design.md", "fig.png", "LOG.md", "ref.md"]


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_points_to_a_file(doc):
    links = relative_links(doc.read_text())
    dead = [t for t in links if not (doc.parent / t).exists()]
    assert not dead, f"{doc.relative_to(ROOT)}: dead links {dead}"
    if doc == README:
        assert "docs/design.md" in links and "docs/LOG.md" in links  # the checker sees the README's links
