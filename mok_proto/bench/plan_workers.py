"""The plan helper processes of the R-process benchmark: each rank's share of the fused plans
built and proved beside the GPU work, or in the rank itself when the helpers do not answer."""

from __future__ import annotations

import multiprocessing
import os

from mok_proto.bench.device import use_all_cpus
from mok_proto.config import MOK_POLICY
from mok_proto.plan import FusedKnobs, fused_plan

PROBE_TIMEOUT_S = 120.0  # a plan helper process must answer within this (else plans are proved inline)


def start_plans(problems, settings, num_sms: dict, workers: int, rank: int = 0, num_ranks: int = 1):
    """Helper processes (spawned; each may use every CPU) that build and prove this rank's share
    of the fused plans, in shape order: plan i of every (shape, pass, setting) is proved by rank
    i % num_ranks (its prover), which sends it to the others (Ranks.shared). Returns (pool,
    {(shape, pass, comm CTAs, minibatch rows): (prover, AsyncResult of the checked plan on the
    prover, None elsewhere)})."""
    keys = [(prob, pass_, comm_blocks, minibatch)
            for prob in problems for pass_ in ("fwd", "bwd") for comm_blocks, minibatch in settings]
    roots = {(prob.name, *rest): i % num_ranks for i, (prob, *rest) in enumerate(keys)}
    jobs = {(prob.name, pass_, comm_blocks, minibatch): (pass_, prob.run, prob.capacity, dict(MOK_POLICY),
                                                         FusedKnobs(comm_blocks, minibatch), num_sms[pass_])
            for prob, pass_, comm_blocks, minibatch in keys if roots[prob.name, pass_, comm_blocks, minibatch] == rank}
    if not jobs:
        return None, {key: (root, None) for key, root in roots.items()}
    pool = multiprocessing.get_context("spawn").Pool(workers, initializer=use_all_cpus, maxtasksperchild=1)
    try:
        pool.apply_async(os.getpid).get(PROBE_TIMEOUT_S)  # the helpers start (import, unpickle) at all
    except Exception as e:  # noqa: BLE001 - then this process proves each plan when it needs it
        print(f"# rank {os.environ.get('OMPI_COMM_WORLD_RANK', '?')}: plan helper processes do not answer "
              f"({type(e).__name__}: {e}); the fused plans are proved inline (slower)", flush=True)
        pool.terminate()
        pool.join()
        return None, {key: (root, InlinePlan(jobs[key]) if key in jobs else None) for key, root in roots.items()}
    return pool, {key: (root, pool.apply_async(fused_plan, jobs[key], {"check": True}) if key in jobs else None)
                  for key, root in roots.items()}


class InlinePlan:
    """A fused plan built and proved in this process when asked for (AsyncResult's get)."""

    def __init__(self, args):
        self.args = args

    def get(self, timeout=None):
        return fused_plan(*self.args, check=True)
