"""The shape of the repository (what a researcher who clones it relies on): no history in the code,
no code among the results, modules and scripts small enough to read in one sitting."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A commit reference: a word of 7 to 40 hex digits holding both letters and digits.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
MAX_MODULE_LINES = 700
MAX_SCRIPT_LINES = 400


def _tracked(*folders) -> list[Path]:
    """The files git tracks under `folders` (the checkout's: what a clone has), or every file when
    this is not a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *folders], cwd=ROOT, capture_output=True, check=True)
        return [ROOT / name for name in out.stdout.decode().split("\0") if name and (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [p for folder in folders for p in (ROOT / folder).rglob("*") if p.is_file()]


def test_no_commit_reference_in_code():
    found = []
    for path in _tracked("mok_proto", "cuda", "scripts"):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{number}: {m.group(0)}" for m in COMMIT.finditer(line)]
    assert not found, "commit references in code (history goes to docs/LOG.md):\n" + "\n".join(found)


def test_no_code_among_the_results():
    code = [str(p.relative_to(ROOT)) for p in _tracked("results") if p.suffix in (".py", ".sh", ".patch")]
    assert not code, f"code under results/ (studies go to experiments/): {code}"


@pytest.mark.parametrize("folder,limit", [("mok_proto", MAX_MODULE_LINES), ("scripts", MAX_SCRIPT_LINES)])
def test_files_fit_one_sitting(folder, limit):
    long = {str(p.relative_to(ROOT)): n for p in _tracked(folder) if p.suffix == ".py"
            if (n := len(p.read_text().splitlines())) > limit}
    assert not long, f"over {limit} lines: {long}"


def test_the_commit_pattern():
    # what the checks above would catch, and what they must not
    assert COMMIT.search("see 249b630") and COMMIT.search("tree 2c16682 ran")
    assert COMMIT.search("2c16682df00d" + "0" * 28)  # a full 40-digit hash
    assert not COMMIT.search("deadbeef") and not COMMIT.search("1234567")  # letters only, digits only
    assert not COMMIT.search("0x6D6F6B and 0x7fffffff")  # hex literals are not words of hex digits alone
    assert not COMMIT.search("abc1234x") and not COMMIT.search("abc123")  # not a whole word; too short


def test_experiment_patches_apply_to_the_tree():
    """Every patch under experiments/ still applies to the tree it is timed against (the scripts
    there apply them to a copy of this tree): a kernel edit that breaks one says so here."""
    patches = [p for p in _tracked("experiments") if p.suffix == ".patch"]
    if not patches:
        pytest.skip("no patches under experiments/")
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git is not installed, or this is not a git checkout")
    if Path(top).resolve() != ROOT:  # git apply would ignore the paths outside a subfolder: a vacuous pass
        pytest.skip("this tree is a folder of another git checkout")
    stale = []
    for patch in patches:
        check = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
        if check.returncode:
            stale.append(f"{patch.relative_to(ROOT)}: {check.stderr.strip()}")
    assert not stale, "experiment patches that no longer apply:\n" + "\n".join(stale)
