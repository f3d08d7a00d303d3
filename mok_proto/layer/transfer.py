"""The four row movements of the layer, each as a one-sided push or pull over symmetric memory.

Legend: N tokens/rank, H hidden, K top-k, R ranks, C receive capacity (rows).
Two shapes of movement, read off one PullSchedule (mok_proto.schedule):

  to_experts   token side -> expert side receive rows      forward dispatch, backward reverse-combine
  to_tokens    expert side -> token side slot buffer [N*K]   forward combine,  backward reverse-dispatch

Directions, and who must wait for whom (MoK insight 1):
  to_experts pull : the expert owner loads its rows; waits only for its own loads.
  to_experts push : token owners store rows + raise a flag; the expert owner waits for all R flags.
  to_tokens  push : expert owners store rows + raise a flag; the token owner waits for all R flags.
  to_tokens  pull : expert owners raise "results ready" flags; the token owner waits for each, then loads.
A to_experts pull reads a round INPUT (x or dy) that the round-start flags already published, so
it needs no flag of its own; a to_tokens pull reads rows produced inside the round, so it does.

NOTE (buffer reuse across rounds): every round starts with a flag from every rank (routing
all-gather in forward, "dy ready" in backward), raised only after that rank finished its previous
round, and every round ends with each rank having heard from all R peers. So once a rank is past
a round's start flags, no peer still reads or writes any buffer of the previous round.
"""

from __future__ import annotations

import numpy as np

# Flag kinds: row of the [kinds, R] signal table.
ROUND_START, TO_EXPERTS, TO_TOKENS = 0, 1, 2
NUM_FLAG_KINDS = 3


def to_experts(mode, sched, src, dst, signals, epoch, timeout_s, op, token_rows):
    """Receive slot i of dst <- row of src on rank src_rank[i]: src_slot[i] // K if token_rows
    (src is x [N,H]) else src_slot[i] (src is a slot buffer [N*K,H])."""
    rank, num_ranks, top_k = sched.rank, sched.num_ranks, sched.top_k
    if mode == "pull":
        for peer in _peers_from(rank, num_ranks):
            recv_slots = np.flatnonzero(sched.src_rank == peer)
            rows = sched.src_slot[recv_slots] // top_k if token_rows else sched.src_slot[recv_slots]
            dst.local[recv_slots] = src.get_rows(peer, rows)
        return
    for peer in _peers_from(rank, num_ranks):
        my_slots = np.flatnonzero(sched.dst_rank == peer)
        rows = my_slots // top_k if token_rows else my_slots
        dst.put_rows(peer, sched.recv_row[my_slots], src.local[rows])
        signals.signal(peer, TO_EXPERTS, epoch)
    for peer in range(num_ranks):
        signals.wait(TO_EXPERTS, peer, epoch, timeout_s, op)


def to_tokens(mode, sched, src, dst, signals, epoch, timeout_s, op):
    """Slot s of dst (token side, [N*K,H]) <- receive row recv_row[s] of src on rank dst_rank[s]."""
    rank, num_ranks = sched.rank, sched.num_ranks
    if mode == "push":
        for peer in _peers_from(rank, num_ranks):
            recv_slots = np.flatnonzero(sched.src_rank == peer)
            dst.put_rows(peer, sched.src_slot[recv_slots], src.local[recv_slots])
            signals.signal(peer, TO_TOKENS, epoch)
        for peer in range(num_ranks):
            signals.wait(TO_TOKENS, peer, epoch, timeout_s, op)
        return
    src.publish()  # NOTE: my results must be visible before any peer is told they are ready
    for peer in _peers_from(rank, num_ranks):
        signals.signal(peer, TO_TOKENS, epoch)
    for peer in _peers_from(rank, num_ranks):
        signals.wait(TO_TOKENS, peer, epoch, timeout_s, op)
        my_slots = np.flatnonzero(sched.dst_rank == peer)
        dst.local[my_slots] = src.get_rows(peer, sched.recv_row[my_slots])


def round_start(signals, rank, num_ranks, epoch, timeout_s, op, before_wait=None):
    """Raise my round-start flag on every rank, run `before_wait` (overlap), wait for all R."""
    for peer in _peers_from(rank, num_ranks):
        signals.signal(peer, ROUND_START, epoch)
    result = before_wait() if before_wait is not None else None
    for peer in range(num_ranks):
        signals.wait(ROUND_START, peer, epoch, timeout_s, op)
    return result


def _peers_from(rank, num_ranks):
    """Peers in the order rank+1, rank+2, ..., rank: staggered so ranks do not all hit rank 0."""
    return [(rank + d) % num_ranks for d in range(1, num_ranks + 1)]
