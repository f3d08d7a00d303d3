"""Run under mpiexec -n R: the demo, with one rank stopping itself (SIGSTOP) or dying (SIGKILL)
at one step of the run; the others must end the job by themselves and name it.

    mpiexec -n 4 python tests/mpi_programs/stop_rank.py --rank 2 --at forward --signal STOP -- --timeout 2
"""

import argparse
import os
import signal
import sys

from mok_proto import demo


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True, help="the rank that stops")
    p.add_argument("--at", required=True, choices=("startup", "setup", "forward", "backward", "cleanup", "finish"),
                   help="startup: before MPI starts; finish: after the last barrier, before MPI_Finalize")
    p.add_argument("--signal", default="STOP", choices=("STOP", "KILL"))
    p.add_argument("demo_args", nargs="*", help="options for the demo (after --)")
    args = p.parse_args()
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))

    def on_step(name):
        if rank == args.rank and name == args.at:
            print(f"stop_rank: rank {rank} (pid {os.getpid()}) gets SIG{args.signal} at {name}", file=sys.stderr,
                  flush=True)
            os.kill(os.getpid(), getattr(signal, f"SIG{args.signal}"))

    on_step("startup")
    return demo.main(args.demo_args, on_step=on_step)


if __name__ == "__main__":
    sys.exit(main())
