"""Digests of results too large to copy to the host, for bitwise comparisons across runs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from mok_proto.bench.rows import git_sha
from mok_proto.routing import UNIFORM

DIGEST_ROW_WORDS = 4096  # 32-bit words per fingerprint row of `digest`
# odd 64-bit multipliers, one per word of a row (fixed: digests compare across runs and machines)
_DIGEST_MULTIPLIERS = (np.random.default_rng(0x6D6F6B).integers(0, 2 ** 63, DIGEST_ROW_WORDS, dtype=np.uint64)
                       * np.uint64(2) + np.uint64(1))


def digest(arrays: dict, chunk_rows: int = 1 << 14) -> str:
    """SHA-256 (hex) of named arrays (NumPy or CuPy), for bitwise comparisons of results too large
    to copy to the host (a layer's fp32 weight gradients: tens of GB). Each array's name, dtype and
    shape are hashed with fingerprints of its bytes computed where the array lives: the bytes as
    32-bit words w (zero-padded), in rows of DIGEST_ROW_WORDS, each row's sum of w[i] * m[i] mod
    2^64 with fixed odd multipliers m. Equal arrays give equal digests; a row that differs in one
    word always changes its fingerprint (m[i] odd, |w - w'| < 2^32), and rows that differ in
    several words collide with probability about 2^-64."""
    from mok_proto.validate import array_module

    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        xp = array_module(a)
        h.update(f"{name}:{a.dtype.str}:{tuple(a.shape)};".encode())
        flat = xp.ascontiguousarray(a).reshape(-1).view(xp.uint8)
        words = xp.concatenate([flat, xp.zeros(-flat.size % 4, xp.uint8)]).view(xp.uint32) if flat.size % 4 \
            else flat.view(xp.uint32)
        mult = xp.asarray(_DIGEST_MULTIPLIERS)
        step = chunk_rows * DIGEST_ROW_WORDS
        for start in range(0, words.size, step):
            part = words[start:start + step]
            if part.size % DIGEST_ROW_WORDS:
                part = xp.concatenate([part, xp.zeros(-part.size % DIGEST_ROW_WORDS, xp.uint32)])
            rows = part.reshape(-1, DIGEST_ROW_WORDS).astype(xp.uint64) * mult  # wraps mod 2^64
            sums = rows.sum(axis=1, dtype=xp.uint64)
            h.update((sums.get() if xp is not np else sums).astype("<u8").tobytes())
    return h.hexdigest()


def result_digests(layer, rank: int) -> dict:
    """{"out": digest of the output, "grads": of every gradient} of `rank` (no host copy)."""
    views = layer.result_views(rank)
    out = views.pop("out")
    return {"out": digest({"out": out}), "grads": digest(views)}


def write_digests(path: Path, mode: str, num_ranks: int, shapes: dict) -> None:
    """shapes: {name: {"config": {...}, "per_rank": {rank: {"out", "grads"}}} or {"config", "skipped"}}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"mode": mode, "ranks": num_ranks, "git": git_sha(), "shapes": shapes}, indent=1))


def compare_digests(mine: dict, path, mode: str) -> dict:
    """{shape: True (every rank equal) | False | None (not comparable: reason in 'why')} against the
    digests file of the other mode. Same problem = same shape, R, tokens per rank, seed, routing (a
    file without it: uniform), capacity."""
    other = json.loads(Path(path).read_text())
    out = {}
    for name, got in mine.items():
        theirs = other.get("shapes", {}).get(name)
        keys = ("ranks", "tokens_per_rank", "seed", "routing", "capacity")
        if other.get("mode") == mode:
            out[name] = {"equal": None, "why": f"{path} holds digests of the same mode ({mode})"}
        elif theirs is None:
            out[name] = {"equal": None, "why": f"{name} not in {path}"}
        elif "per_rank" not in theirs or "per_rank" not in got:
            # a shape skipped by a documented choice (e.g. --single: R ranks do not fit one GPU) is
            # not a failure; any other missing comparison is (judge)
            skipped = all("skipped" in entry for entry in (got, theirs) if "per_rank" not in entry)
            out[name] = {"equal": None, "skipped": skipped, "why": "no digests: " + "; ".join(
                f"{who}: {entry.get('skipped') or entry.get('error') or '?'}" for who, entry in (("this run", got),
                                                                                              (str(path), theirs))
                if "per_rank" not in entry)}
        elif any(_config(theirs, k) != _config(got, k) for k in keys):
            out[name] = {"equal": None, "why": "a different problem: " + ", ".join(
                f"{k} {_config(got, k)} vs {_config(theirs, k)}" for k in keys)}
        else:
            ranks = {r: got["per_rank"][r] == theirs["per_rank"].get(r) for r in got["per_rank"]}
            out[name] = {"equal": all(ranks.values()), "ranks": ranks, "other": str(path)}
    return out


def _config(entry: dict, key: str):
    """A digests entry's config value; a file written before configs held the routing: uniform."""
    return entry["config"].get(key, str(UNIFORM) if key == "routing" else None)


def describe_comparison(result) -> str:
    if result is None:
        return "n/a"
    if result["equal"] is None:
        return f"not compared ({result['why']})"
    if result["equal"]:
        return "equal"
    return "DIFFERS on ranks " + ",".join(r for r, ok in result["ranks"].items() if not ok)
