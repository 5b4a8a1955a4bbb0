"""What a pass or a decode batch keeps in HBM, in the target's bytes (DESIGN.md section 3a).

A forward pass holds, besides the weights and a reserve (neither counted here: they are taken
off the budget before it gets here), the KV it attends to and the KV it builds:
  * Basic (Full Blocks into HBM before the pass): every layer of each request's past;
  * Layerwise and every DualPath mode (Layer Blocks): a few layers of the batch's past at a
    time, one being computed on and the next one landing;
  * both: every layer of the new tokens' KV, built during the pass and sent after it.
A decode batch holds every layer of every batched request's KV.

This module knows nothing about GPUs or models: `emulators.gpu.memory` turns a target into these
numbers. Everything is in target bytes, so the testbed's small model binds where the target would.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


class NeverFits(ValueError):
    """A request whose KV exceeds an engine's HBM budget on its own, in any pass."""


@dataclass(frozen=True, slots=True)
class HbmLimit:
    """The HBM one prefill pass may fill with KV, and what each token keeps resident."""

    budget_bytes: float  # the engine's HBM for KV: capacity less weights less reserve
    past_bytes_per_token: float  # a cached token during a pass: all its layers (Basic) or a few
    new_bytes_per_token: float  # a token computed in the pass: every layer of its KV

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"HBM limit: {k} must be finite and > 0, got {v!r}")

    def resident_bytes(self, cached: int, new: int) -> float:
        """Bytes one request keeps in HBM during a pass that computes `new` tokens after `cached`."""
        return cached * self.past_bytes_per_token + new * self.new_bytes_per_token

    def largest_new(self, used_bytes: float, cached: int, new: int) -> int:
        """Largest k in [0, new] with used_bytes + resident_bytes(cached, k) <= budget."""
        room = self.budget_bytes - used_bytes - cached * self.past_bytes_per_token
        if room < self.new_bytes_per_token:
            return 0
        return min(new, int(room // self.new_bytes_per_token))

    def check_request(self, request_id: str, n_prompt: int) -> None:
        """Raise NeverFits when even the request's smallest last pass (its whole prompt but one
        token as past, one new token) exceeds the budget on an empty engine."""
        need = self.resident_bytes(n_prompt - 1, 1)
        if need > self.budget_bytes:
            raise NeverFits(f"request {request_id}: its {n_prompt}-token prompt needs {need / 1e9:.2f} GB of the "
                            f"prefill engine's HBM in one pass, more than its KV budget of "
                            f"{self.budget_bytes / 1e9:.2f} GB (target bytes)")

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in asdict(self).items()}


@dataclass(frozen=True, slots=True)
class DecodeHbm:
    """A decode engine's HBM for KV, in tokens of the target's KV (every layer)."""

    budget_bytes: float
    kv_bytes_per_token: float
    cap_tokens: int | None = None  # what the testbed's own HBM buffer holds, when it holds fewer

    @property
    def target_tokens(self) -> int:
        return int(self.budget_bytes // self.kv_bytes_per_token)

    @property
    def tokens(self) -> int:
        return self.target_tokens if self.cap_tokens is None else min(self.target_tokens, self.cap_tokens)

    def check_request(self, request_id: str, n_tokens: int) -> None:
        """Raise NeverFits when `n_tokens` of KV (prompt plus output) exceed the budget alone."""
        if n_tokens <= self.tokens:
            return
        held = (f"its KV budget of {self.budget_bytes / 1e9:.2f} GB ({self.tokens} tokens, target bytes)"
                if self.tokens == self.target_tokens else
                f"the {self.tokens} tokens the testbed's own HBM buffer holds (hbm_gib_per_engine)")
        raise NeverFits(f"request {request_id}: its {n_tokens} tokens of KV need "
                        f"{n_tokens * self.kv_bytes_per_token / 1e9:.2f} GB of a decode engine's HBM, more than {held}")

    def batch_record(self, batch_tokens: int, n: int) -> dict[str, int | bool]:
        """A decode step's HBM fields: the batch's KV in target bytes, and whether the batch is
        full (one more request of the batch's mean length would not fit)."""
        mean = batch_tokens / n if n else 0
        return {"batch_tokens": batch_tokens, "hbm_peak_bytes": int(batch_tokens * self.kv_bytes_per_token),
                "hbm_limited": bool(n) and batch_tokens + mean > self.tokens}


@dataclass(frozen=True, slots=True)
class HbmPlan:
    """An engine's HBM under each connector: what the testbed and the simulator batch against."""

    whole_past: HbmLimit  # the basic connector: Full Blocks, every layer of the past resident
    layer_blocks: HbmLimit  # layerwise, every DualPath mode and oracle: Layer Blocks
    decode: DecodeHbm

    def prefill(self, connector: str) -> HbmLimit:
        return self.whole_past if connector == "basic" else self.layer_blocks

    def check_request(self, request_id: str, n_prompt: int, gen_len: int, connector: str) -> None:
        """Raise NeverFits for a request no pass or no decode batch could ever hold."""
        self.prefill(connector).check_request(request_id, n_prompt)
        self.decode.check_request(request_id, n_prompt + gen_len)

    def to_dict(self) -> dict:
        return {"basic_pass": self.whole_past.to_dict(), "layer_block_pass": self.layer_blocks.to_dict(),
                "decode_tokens": self.decode.tokens}
