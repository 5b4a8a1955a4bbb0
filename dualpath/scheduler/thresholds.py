"""alpha and beta: the paper's two time budgets, turned into bytes and tokens by profiling.

Only the 3 s / 5 s windows are the paper's defaults; the rates they multiply are measured on the
hardware at hand (SNIC read bandwidth, prefill throughput), so nothing here is a hard constant.
"""
from __future__ import annotations

from dataclasses import dataclass

PAPER_ALPHA_S = 3.0  # "3 seconds worth of token reads"
PAPER_BETA_S = 5.0  # "5 seconds worth of GPU processing"


@dataclass(frozen=True, slots=True)
class Profile:
    """Profiled hardware numbers the scheduler needs."""

    snic_bytes_per_s: float  # one node's storage read bandwidth
    prefill_tokens_per_s: float  # one engine's prefill throughput
    kv_bytes_per_token: int  # all layers; turns hit tokens into read bytes
    block_tokens: int = 64  # tokens per Full Block (the split mode divides blocks)

    def __post_init__(self) -> None:
        for name in ("snic_bytes_per_s", "prefill_tokens_per_s", "kv_bytes_per_token", "block_tokens"):
            if not getattr(self, name) > 0:
                raise ValueError(f"profile {name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class Thresholds:
    alpha_bytes: float  # node read queue at or below this is "short" (C2)
    beta_tokens: float  # engine tok_e above this is overloaded (C1)

    @classmethod
    def from_profile(
        cls, profile: Profile, alpha_s: float = PAPER_ALPHA_S, beta_s: float = PAPER_BETA_S
    ) -> "Thresholds":
        if alpha_s <= 0 or beta_s <= 0:
            raise ValueError("alpha_s and beta_s must be > 0")
        return cls(
            alpha_bytes=alpha_s * profile.snic_bytes_per_s,
            beta_tokens=beta_s * profile.prefill_tokens_per_s,
        )
