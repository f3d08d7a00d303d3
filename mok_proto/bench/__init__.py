"""Benchmark harness: timing (warm-ups, one CUDA event pair per stage and iteration, median with
p20/p80, the slowest rank), ceilings measured in the same run, digests for bitwise comparisons,
power sampling, and JSON-lines results rows. The names callers used from mok_proto.bench are
re-exported here."""

from mok_proto.bench.ceilings import copy_ceiling_gbs, peer_pull_gbs
from mok_proto.bench.device import gpu_name, require_gpu, use_all_cpus
from mok_proto.bench.digests import DIGEST_ROW_WORDS, digest
from mok_proto.bench.power import (SMI_PERIOD_MS, SMI_POWER_CAP, SMI_QUERY, SMI_SETTLE_S, phase_power, smi_command,
                                   smi_samples)
from mok_proto.bench.rows import RESULTS_DIR, append_result, git_sha
from mok_proto.bench.timing import paired_ratio, rotating, slowest_rank, summarize, time_stages

__all__ = ["DIGEST_ROW_WORDS", "RESULTS_DIR", "SMI_PERIOD_MS", "SMI_POWER_CAP", "SMI_QUERY", "SMI_SETTLE_S",
           "append_result", "copy_ceiling_gbs", "digest", "git_sha", "gpu_name", "paired_ratio", "peer_pull_gbs",
           "phase_power", "require_gpu", "rotating", "slowest_rank", "smi_command", "smi_samples", "summarize",
           "time_stages", "use_all_cpus"]
