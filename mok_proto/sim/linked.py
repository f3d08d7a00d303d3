"""The emulated link (mok_proto.link, cuda/common.cuh linked_rows) as the simulator prices it, for
bench_layer's emulation: the rows stay in one GPU's memory, so a transfer is still its HBM copy (a
floor), and the rows that pay (LinkModel.pays) also take the link's time:

* one budget per rank and direction: a mover reserves its paying bytes on its rank's clock of its
  direction (pull: into the rank; push: out of it) from max(its start, the clock) at the link's
  rate, so a lone mover sees the whole link and movers that overlap share it (model.simulate
  visits the steps in the order of their start when a link is set, as the device's movers reserve);
* a pull waits at least one round trip per batch of loads one of its warps has in flight (32 lanes
  x 16 bytes x the kernel's unroll), for the rows of its busiest warp;
* a signal pays one round trip: a standalone push kernel's flag (its last block), raise_flag, the
  schedule's flags, and in the fused kernel a remote counter's flag (model.simulate).

Shape legend: n tasks, R ranks.
"""

from __future__ import annotations

import numpy as np

from mok_proto.abi import CONST
from mok_proto.kernels.comm import Launch
from mok_proto.link import FS_PER_NS, LOAD_BATCH_BYTES, LinkModel

IN, OUT = 0, 1  # a rank's two clocks (cuda/common.cuh LinkDirection): what it pulls, what it pushes
# The fused kernel's movers (cuda/fused.cuh mover_task): (warps of one task, bytes of loads one warp
# has in flight, linked_rows<32 * 16 * kUnroll>): a communicating CTA's every warp (kCommWarps,
# kCommUnroll), a compute CTA's spare warps (kSideWarps, kSideUnroll).
COMM_CTA_MOVERS = (CONST["kThreads"] // 32, 8 * LOAD_BATCH_BYTES)
SPARE_MOVERS = (3, 16 * LOAD_BATCH_BYTES)
# The standalone transfer kernels (cuda/comm.cuh, 16-byte accesses: linked_rows<32 * kVec>): a warp's
# loads in flight, and warps per block.
STANDALONE_BATCH = LOAD_BATCH_BYTES
STANDALONE_WARPS_PER_BLOCK = CONST["kCommThreads"] // 32


def paying_fraction(link: LinkModel, local_fraction: np.ndarray) -> np.ndarray:
    """[R] the share of a rank's rows that pay: every row (every_row), else those from other ranks."""
    return np.ones_like(local_fraction) if link.every_row else 1.0 - local_fraction


def round_trips_ns(link: LinkModel, warp_rows, row_bytes: int, batch_bytes: int):
    """A pull's least time (LinkClock.warp_rows): one round trip per batch of loads for each paying
    row of its busiest warp (warp_rows)."""
    return warp_rows * -(-row_bytes // batch_bytes) * link.latency_ns


def standalone_warps(rows: int, num_sms: int) -> int:
    """Warps of a standalone transfer kernel driving one rank (kernels.comm.Launch's default grid;
    rows: the larger of the slot and receive buffers)."""
    return Launch.default_blocks_per_rank(rows, num_sms, 1) * STANDALONE_WARPS_PER_BLOCK


def busiest_warp_rows(starts: np.ndarray, counts: np.ndarray, warps: int) -> np.ndarray:
    """[R] the most rows one warp gets when warp w of `warps` moves rows w, w + warps, ... (a
    standalone kernel, grid_warps) and the rows each rank moves are the segments [starts, starts +
    counts) (each [R, segments]: a receive buffer's experts)."""
    out = np.zeros(len(starts), np.int64)
    for r, (a, c) in enumerate(zip(starts, counts)):
        rows = np.concatenate([np.arange(s, s + n) for s, n in zip(a.tolist(), c.tolist())] + [np.zeros(0, np.int64)])
        out[r] = np.bincount(rows % warps, minlength=1).max()
    return out


def standalone_ns(link: LinkModel, pays, floor, round_trips, signal: float = 0.0):
    """A transfer kernel on its own (no other mover of the rank busy: the whole link): its floor, or
    its paying bytes at the link's rate or its round trips where longer, then its signal."""
    return np.maximum(floor, np.maximum(pays * link.fs_per_byte / FS_PER_NS, round_trips)) + signal


class LinkedMovers:
    """The transfer tasks of a simulated plan under a link, per task (n) and rank (R): paying bytes
    (pays), clock (IN or OUT), floor (the task without the link: its fixed part and its copy),
    fixed part, least time of a pull's round trips, signal after it; and every rank's two clocks."""

    def __init__(self, link: LinkModel, num_tasks: int, num_ranks: int):
        self.link = link
        self.moves = np.zeros(num_tasks, bool)
        self.clock_of = np.zeros(num_tasks, np.int64)
        self.pays, self.floor, self.round_trips, self.fixed = (np.zeros((num_tasks, num_ranks)) for _ in range(4))
        self.signal = np.zeros(num_tasks)
        self.clock = np.zeros((2, num_ranks))  # [IN, OUT] per rank: the link busy until (ns)

    def add(self, sel, pull: bool, pays, floor, round_trips=0.0, fixed=0.0, signal: float = 0.0) -> None:
        """Tasks sel (of one direction) move rows: their paying bytes and pricing ([n, R] or less)."""
        self.moves[sel], self.clock_of[sel] = True, IN if pull else OUT
        self.pays[sel], self.floor[sel], self.round_trips[sel] = pays, floor, round_trips
        self.fixed[sel], self.signal[sel] = fixed, signal

    def duration(self, i: int, start: np.ndarray) -> np.ndarray:
        """[R] task i's duration when it starts at `start` [R]: its paying bytes reserved now (in
        the order of the tasks' starts: the caller's), as cuda/common.cuh linked_rows does."""
        pays, clock = self.pays[i], self.clock[self.clock_of[i]]
        paying = pays > 0
        busy = np.maximum(clock, start) + pays * self.link.fs_per_byte / FS_PER_NS
        clock[paying] = busy[paying]
        link = np.where(paying, np.maximum(busy - start, self.round_trips[i]), 0.0)
        return np.maximum(self.floor[i], self.fixed[i] + link) + self.signal[i]

    def one_rank(self):
        """`duration` of rank 0 alone, with Python floats (the same operations on the same values:
        for a simulation whose ranks all run alike); its clock is its own."""
        pays, trips, floor, fixed = (a[:, 0].tolist() for a in (self.pays, self.round_trips, self.floor, self.fixed))
        signal, clock_of, clock = self.signal.tolist(), self.clock_of.tolist(), self.clock[:, 0].tolist()
        fs_per_byte = self.link.fs_per_byte

        def duration(i: int, start: float) -> float:
            c = clock_of[i]
            busy = max(clock[c], start) + pays[i] * fs_per_byte / FS_PER_NS
            link = 0.0
            if pays[i] > 0:
                clock[c] = busy
                link = max(busy - start, trips[i])
            return max(floor[i], fixed[i] + link) + signal[i]
        return duration
