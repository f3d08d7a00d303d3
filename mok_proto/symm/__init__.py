"""Symmetric memory backends behind one interface (see base.py)."""

from mok_proto.symm.base import (CapacityError, Signals, SymmetricArray, SymmetricHeap,  # noqa: F401
                                 SymmTimeoutError)
