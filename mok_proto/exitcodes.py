"""How a run of the demo ends: the exit status of every rank and of mpiexec.

One table for the code and the README. MPICH's mpiexec returns the code a rank passed to
MPI_Abort, so codes 3 and 4 reach the shell unchanged.
"""

EXIT_PASS = 0  # every rank matches the reference
EXIT_MISMATCH = 1  # a rank differs from the reference by more than the tolerance
EXIT_BAD_ARGUMENT = 2  # a bad option, or a run refused up front (it cannot fit in memory)
EXIT_PROTOCOL = 3  # the protocol failed: a buffer would overflow, or an unexpected error on one rank
EXIT_PEER = 4  # a peer is stopped, dead or never arrived: a bounded wait or collective expired
