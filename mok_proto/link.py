"""An emulated link between ranks on one GPU: the movers pay NVLink time for the rows they move.

With virtual ranks (or several processes on one GPU) a transfer between two ranks is an HBM copy,
far faster than the NVLink it stands for. `LinkModel` (a setting of `RunConfig.link`) makes the
layer's transfer kernels and the fused kernel's movers pay the link instead: the kernels are then
built with MOK_LINK (cuda/common.cuh `linked_rows`, `link_signal`); without a link they are the
plain kernels, instruction for instruction.

The model, per rank and direction (into the rank: what it pulls; out of it: what it pushes):
  * one clock, the link busy until then; every warp that moves the rank's rows in that direction
    reserves their bytes on it: its rows are done at max(now, clock) + bytes / rate (one budget
    shared by every mover: a lone mover sees the whole link, many movers share it);
  * a pull also waits at least one round trip (`latency_us`) per batch of loads its warp has in
    flight (the kernel's own batch: 32 lanes x its access width x its unroll: 512 bytes x unroll
    with 16-byte accesses, 64 bytes for rows copied 2 bytes at a time, whose pulls are slow);
  * a push pays one round trip at its flush, the signal after it; every signal (flag, remote
    counter) pays one round trip;
  * which rows pay: rows between two different ranks, or (every_row) every row a rank moves, for
    a rank that stands for remote peers (the EP=64 share that scripts/bench_layer.py emulates
    with 2 virtual ranks, where half the timed rank's rows come from itself only because of the
    emulation).
Rows are delayed, never changed: a run with the link is bitwise equal to one without.

This module is the host side (the CommParams fields) and the arithmetic of the model, in the
same integer units as the device (femtoseconds per byte, nanoseconds), for the tests (the
simulator does not use it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The round trip of one batch of loads: the only parameter fitted to the real link, on the 2 x H200
# pull stages (results/x2/) with the standalone pull kernel's launch of a rank that has its GPU to
# itself (how, and the fit per stage: docs/LOG.md).
DEFAULT_LATENCY_US = 3.4
NS_PER_S = 1e9
FS_PER_NS = 1_000_000
LOAD_BATCH_BYTES = 32 * 16  # one warp's 16-byte loads, one per lane (kernels multiply by their unroll)
# link_reserve multiplies a reservation's bytes by the rate in int64: 2**38 bytes (more than a GPU
# holds) at the slowest rate must not overflow (it would sleep for centuries, not time out).
MAX_FS_PER_BYTE = (2**63 - FS_PER_NS) // 2**38  # (with the rounding's half nanosecond)


@dataclass(frozen=True)
class LinkModel:
    """gbps: GB/s (1e9 bytes/s) per GPU per direction; latency_us: one round trip; every_row:
    every row a rank moves pays (else only rows between two ranks)."""

    gbps: float
    latency_us: float = DEFAULT_LATENCY_US
    every_row: bool = False

    def __post_init__(self):
        if not (isinstance(self.gbps, (int, float)) and math.isfinite(self.gbps) and self.gbps > 0):
            raise ValueError(f"link gbps must be a finite number > 0, got {self.gbps!r}")
        if not (isinstance(self.latency_us, (int, float)) and math.isfinite(self.latency_us) and self.latency_us >= 0):
            raise ValueError(f"link latency_us must be a finite number >= 0, got {self.latency_us!r}")
        if self.fs_per_byte < 1:
            raise ValueError(f"link gbps {self.gbps} is too fast to emulate (under 1 fs per byte)")
        if self.fs_per_byte > MAX_FS_PER_BYTE:
            raise ValueError(f"link gbps {self.gbps} is too slow to emulate (at least "
                             f"{FS_PER_NS / MAX_FS_PER_BYTE:.3g} GB/s: the device's femtoseconds are int64)")

    @property
    def fs_per_byte(self) -> int:
        """The rate as the device holds it: femtoseconds per byte, rounded to the nearest."""
        return round(FS_PER_NS * NS_PER_S / 1e9 / self.gbps)

    @property
    def latency_ns(self) -> int:
        return round(self.latency_us * 1000)

    def comm_fields(self) -> dict:
        """The CommParams fields of this link (link_clock is the round's buffer)."""
        return dict(link_fs_per_byte=self.fs_per_byte, link_latency_ns=self.latency_ns,
                    link_every_row=int(self.every_row))

    def transfer_ns(self, nbytes: int) -> int:
        """What a reservation of nbytes lasts (cuda/common.cuh link_reserve: rounded to the nearest ns)."""
        return (int(nbytes) * self.fs_per_byte + FS_PER_NS // 2) // FS_PER_NS

    def pays(self, rank: int, peer: int) -> bool:
        """Whether a row moved by `rank` to or from `peer` (-1: no row) crosses the link."""
        return peer >= 0 and (self.every_row or peer != rank)

    def describe(self) -> dict:
        """Fields for results rows."""
        return {"link_gbps": self.gbps, "link_latency_us": self.latency_us, "link_every_row": self.every_row}


NO_LINK_FIELDS = dict(link_fs_per_byte=0, link_latency_ns=0, link_every_row=0)


def comm_fields(link: LinkModel | None) -> dict:
    """CommParams link fields for a link, or for none (the plain kernels never read them)."""
    return NO_LINK_FIELDS if link is None else link.comm_fields()


class LinkClock:
    """One rank's clock of one direction, as the device keeps it (cuda/common.cuh link_reserve,
    linked_rows): for the CPU tests."""

    def __init__(self, link: LinkModel):
        self.link, self.busy_until = link, 0

    def reserve(self, nbytes: int, now: int) -> int:
        """Reserve nbytes from max(now, clock): the end of the reservation (ns)."""
        self.busy_until = max(self.busy_until, int(now)) + self.link.transfer_ns(nbytes)
        return self.busy_until

    def warp_rows(self, rows: int, row_bytes: int, now: int, pull: bool, batch_bytes: int) -> int:
        """When a warp's `rows` paying rows started at `now` are done (linked_rows): the end of
        their reservation, and for a pull at least one round trip per batch of loads. `now` if
        none pays."""
        if rows <= 0:
            return int(now)
        done = self.reserve(rows * row_bytes, now)
        if pull:
            done = max(done, int(now) + rows * -(-row_bytes // batch_bytes) * self.link.latency_ns)
        return done
