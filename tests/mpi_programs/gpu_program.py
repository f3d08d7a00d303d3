"""What the GPU check programs share: their common options and the heap they run on (virtual
ranks in this process, or NVSHMEM with one rank per process under mpirun)."""

import argparse


def parser(cases) -> argparse.ArgumentParser:
    """--backend, --ranks, --cases (of `cases`), --replays; a program adds its own options."""
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=("virtual", "nvshmem"), required=True)
    p.add_argument("--ranks", type=int, default=4, help="virtual ranks (virtual backend)")
    p.add_argument("--cases", default=",".join(cases))
    p.add_argument("--replays", type=int, default=20)
    return p


def open_heap(args):
    """(heap, MPI communicator or None): VirtualWorld(--ranks), or NvshmemHeap over COMM_WORLD."""
    if args.backend == "virtual":
        from mok_proto.symm.virtual import VirtualWorld
        return VirtualWorld(args.ranks), None
    from mpi4py import MPI

    from mok_proto.symm.nvshmem import NvshmemHeap
    return NvshmemHeap(), MPI.COMM_WORLD
