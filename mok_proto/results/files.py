"""Where results/ is, and its JSON-lines files: stored plain (`.jsonl`) or gzip-compressed
(`.jsonl.gz`); the same name is the same rows, and what reads or finds one here takes either spelling."""

from __future__ import annotations

import gzip
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parents[2] / "results"

# The two spellings of a JSON-lines file: plain, and gzip-compressed (the same rows).
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")


def open_text(path: Path | str):
    """A .jsonl file opened for reading text; a .jsonl.gz one gunzipped."""
    path = Path(path)
    return gzip.open(path, "rt") if path.suffix == ".gz" else path.open()


def read_text(path: Path | str) -> str:
    """The text of a .jsonl file; of a .jsonl.gz one, gunzipped."""
    with open_text(path) as f:
        return f.read()


def plain_name(path: Path | str) -> str:
    """A file's name as written, whichever way it is stored: `x.jsonl.gz` -> `x.jsonl`."""
    return Path(path).name.removesuffix(".gz")


def jsonl_files(directory: Path | str, pattern: str) -> list[Path]:
    """The files `<pattern>.jsonl` and `<pattern>.jsonl.gz` under directory (pattern: a Path.glob
    pattern without the suffix, e.g. "**/timeline_fused_*"), one per name (the plain .jsonl where
    both exist), sorted by their plain path."""
    found = {}
    for suffix in reversed(JSONL_SUFFIXES):  # the .gz first: a plain .jsonl of the same name replaces it
        for path in Path(directory).glob(pattern + suffix):
            found[path.with_name(plain_name(path))] = path
    return [found[plain] for plain in sorted(found)]
