"""Digests of results too large to copy to the host, for bitwise comparisons across runs."""

from __future__ import annotations

import hashlib

import numpy as np

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
