"""Shapes and run configuration.

Legend used across the project: N tokens/rank, H hidden, I expert FFN, E routed experts,
K top-k, R ranks (EP degree), El = E/R local experts, Is shared-expert FFN.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mok_proto.link import LinkModel
from mok_proto.validate import check_int

OPERATORS = ("dispatch", "combine", "rev_combine", "rev_dispatch")
DIRECTIONS = ("push", "pull")
# MoK's choice: the expert owner pulls tokens in and pushes results out; backward mirrors it.
MOK_POLICY = {"dispatch": "pull", "combine": "push", "rev_combine": "pull", "rev_dispatch": "push"}
DTYPES = ("float32", "float64")
PRECISIONS = ("bf16", "fp8")  # of the experts' GEMMs: bf16, or block-scaled e4m3 (mok_proto/reference_fp8.py)


def _positive(obj, *names):
    for name in names:
        check_int(getattr(obj, name), name, minimum=1)


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer: E routed SwiGLU experts (top-K) plus optional shared experts."""

    name: str
    hidden: int  # H
    ffn: int  # I, per routed expert
    num_experts: int  # E
    top_k: int  # K
    num_tokens: int  # N, per rank
    num_shared: int = 1  # shared experts (0 or 1); each sees every token
    shared_ffn: int | None = None  # Is; defaults to I

    def __post_init__(self):
        _positive(self, "hidden", "ffn", "num_experts", "top_k", "num_tokens")
        if isinstance(self.num_shared, bool) or self.num_shared not in (0, 1):
            raise ValueError(f"num_shared must be 0 or 1, got {self.num_shared!r}")
        if self.shared_ffn is not None:
            _positive(self, "shared_ffn")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k must be <= num_experts ({self.num_experts}), got {self.top_k}")

    @property
    def shared_ffn_size(self) -> int:
        return self.shared_ffn if self.shared_ffn is not None else self.ffn

    def with_tokens(self, num_tokens: int) -> "MoEShape":
        return dataclasses.replace(self, num_tokens=num_tokens)

    def forward_flops(self) -> int:
        """MoK's count per rank: 6 * (N + N*K) * H * I (shared + routed, 3 GEMMs each); with a
        shared FFN size Is != I the shared part counts 6 * N * H * Is."""
        routed = self.num_tokens * self.top_k * self.ffn
        shared = self.num_tokens * self.num_shared * self.shared_ffn_size
        return 6 * self.hidden * (routed + shared)

    def describe(self) -> str:
        return (f"{self.name}: N={self.num_tokens} H={self.hidden} I={self.ffn} E={self.num_experts} "
                f"K={self.top_k} shared={self.num_shared}")


PRESETS = {
    # The paper's four shapes (one shared expert each), 2048 tokens per GPU.
    "kimi-k2.7": MoEShape("kimi-k2.7", hidden=7168, ffn=2048, num_experts=384, top_k=8, num_tokens=2048),
    "glm-5.2": MoEShape("glm-5.2", hidden=6144, ffn=2048, num_experts=256, top_k=8, num_tokens=2048),
    "qwen3.5-397b": MoEShape("qwen3.5-397b", hidden=4096, ffn=1024, num_experts=512, top_k=10, num_tokens=2048),
    "deepseek-v4-pro": MoEShape("deepseek-v4-pro", hidden=7168, ffn=3072, num_experts=384, top_k=6, num_tokens=2048),
    # Small shapes for tests and the demo.
    "tiny": MoEShape("tiny", hidden=16, ffn=8, num_experts=12, top_k=2, num_tokens=6),
    "small": MoEShape("small", hidden=64, ffn=32, num_experts=24, top_k=4, num_tokens=32),
    "medium": MoEShape("medium", hidden=256, ffn=128, num_experts=48, top_k=4, num_tokens=256),
    # The smallest layer the GPU's GEMM tiles take (H, I multiples of 256): the demo's GPU default.
    "tile": MoEShape("tile", hidden=256, ffn=256, num_experts=48, top_k=4, num_tokens=64),
}
PAPER_SHAPES = ("kimi-k2.7", "glm-5.2", "qwen3.5-397b", "deepseek-v4-pro")


def ep_share(name: str, ep: int = 64) -> MoEShape:
    """One EP rank's share of a paper shape, emulated with 2 ranks: E' = 2 E/ep experts, so each
    of the 2 ranks owns the E/ep experts of an EP=ep rank and receives the ~N K rows it would
    (scripts/bench_layer.py, the simulator's sequential-layer rows)."""
    paper = get_shape(name)
    if paper.num_experts % ep:
        raise ValueError(f"ep={ep} must divide E={paper.num_experts}")
    return dataclasses.replace(paper, name=f"{name}@ep{ep}", num_experts=2 * (paper.num_experts // ep))


def get_shape(name: str) -> MoEShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"shape: unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def parse_policy(text: str | None) -> dict:
    """'dispatch=pull,combine=push' -> full policy dict (unnamed operators keep MoK's choice)."""
    policy = dict(MOK_POLICY)
    if not text:
        return policy
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        op, sep, direction = item.partition("=")
        op, direction = op.strip(), direction.strip()
        if not sep:
            raise ValueError(f"policy: expected operator=direction, got {item!r}")
        if op not in OPERATORS:
            raise ValueError(f"policy: unknown operator {op!r}; operators are {', '.join(OPERATORS)}")
        if direction not in DIRECTIONS:
            raise ValueError(f"policy: {op} must be push or pull, got {direction!r}")
        policy[op] = direction
    return policy


def format_policy(policy: dict) -> str:
    return ",".join(f"{op}={policy[op]}" for op in OPERATORS)


@dataclass(frozen=True)
class RunConfig:
    """How one layer runs: EP degree, direction of each operator, minibatch, seed, dtype, the
    experts' precision and what the dispatch moves."""

    shape: MoEShape
    num_ranks: int = 1  # R
    policy: dict = field(default_factory=lambda: dict(MOK_POLICY))
    minibatch: int = 0  # tokens per minibatch (0 = whole batch): for the fused GPU layer; no layer uses it yet
    seed: int = 0
    dtype: str = "float32"
    timeout_s: float = 30.0  # every spin-wait gives up after this and reports who it waited for
    link: LinkModel | None = None  # the GPU layer's transfers pay this emulated link (mok_proto/link.py)
    precision: str = "bf16"  # the routed experts' (PRECISIONS); bf16 on the CPU: the layer's dtype throughout
    shared_precision: str = "bf16"  # the shared expert's; fp8 only with precision fp8
    dispatch_dtype: str = "bf16"  # with precision fp8, what dispatch moves: bf16 rows or e4m3 codes + fp32 scales
    # the routed weight gradients' (None: precision's); bf16 with precision fp8: from the bf16 rows the
    # expert owner holds, as Megatron's --no-fp8-wgrad (docs/design.md 5.7)
    wgrad_precision: str | None = None

    def __post_init__(self):
        _positive(self, "num_ranks")
        if self.shape.num_experts % self.num_ranks:
            raise ValueError(f"num_ranks: E={self.shape.num_experts} experts are not divisible by "
                             f"R={self.num_ranks} ranks")
        if set(self.policy) != set(OPERATORS):
            raise ValueError(f"policy: needs exactly the operators {', '.join(OPERATORS)}, "
                             f"got {', '.join(sorted(self.policy))}")
        for op, direction in self.policy.items():
            if direction not in DIRECTIONS:
                raise ValueError(f"policy: {op} must be push or pull, got {direction!r}")
        check_int(self.minibatch, "minibatch", minimum=0)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}")
        if self.link is not None and not isinstance(self.link, LinkModel):
            raise TypeError(f"link must be a mok_proto.link.LinkModel or None, got {type(self.link).__name__}")
        for name in ("precision", "shared_precision", "dispatch_dtype"):
            if getattr(self, name) not in PRECISIONS:
                raise ValueError(f"{name} must be one of {', '.join(PRECISIONS)}, got {getattr(self, name)!r}")
        if self.precision == "bf16" and (self.shared_precision, self.dispatch_dtype) != ("bf16", "bf16"):
            raise ValueError("shared_precision and dispatch_dtype may be fp8 only with precision fp8")
        if self.wgrad_precision is not None and self.wgrad_precision not in PRECISIONS:
            raise ValueError(f"wgrad_precision must be None or one of {', '.join(PRECISIONS)}, "
                             f"got {self.wgrad_precision!r}")
        if self.precision == "bf16" and self.wgrad_precision == "fp8":
            raise ValueError("wgrad_precision may be fp8 only with precision fp8")
        if self.precision == "fp8" and self.dtype != "float32":
            raise ValueError(f"precision fp8 stores bf16 and accumulates in fp32: dtype must be float32, got {self.dtype}")

    @property
    def fp8_wgrad(self) -> bool:
        """The routed weight gradients run in FP8 (transposed quantizations of their operands)."""
        return (self.wgrad_precision or self.precision) == "fp8"

    @property
    def num_local_experts(self) -> int:
        return self.shape.num_experts // self.num_ranks
