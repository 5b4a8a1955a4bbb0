"""The target's HBM: what each engine has for KV once its weights and a reserve are in (DESIGN.md 3a).

    budget = capacity * (1 - RESERVE_SHARE)  -  the weights one GPU holds

* Capacity: the GPU's datasheet HBM (specs.py).
* Weights: `TargetModel.weight_bytes()`, the same bytes the cost model streams per pass, under the
  deployment models.py states per model: DS 660B's routed experts split over EP 16 (its 2P prefill
  group) on a prefill GPU and EP 32 (its 4D decode group) on a decode GPU, DS 27B's over EP 8
  (1P1D) on both, Qwen2.5-32B a full BF16 copy per GPU (the paper serves it data parallel, "DP
  only").
* Length scale: a workload whose lengths are the target's / L (the paper presets at
  --length-scale 32) keeps L times fewer KV bytes per request, so the budget is divided by L too
  (the topology's target.hbm_length_scale): an engine then holds as many requests as the target
  would at the unscaled lengths. Without it, lengths / 32 leave 32 times the target's room.
* Reserve: RESERVE_SHARE of the capacity for activations, the allocator and CUDA graphs. 10 % is
  vLLM's default (`gpu_memory_utilization` 0.9), the field's common setting; the paper states none.
* What a pass keeps resident (dualpath/scheduler/hbm.py): Basic every layer of its past; the
  Layer-Block modes LAYERS_IN_FLIGHT layers of it (the one computed on, the next one landing, as
  the paper overlaps them); every mode every layer of the new tokens' KV.

A target whose weights leave nothing is an error naming it. Qwen2.5-32B on an 80 GB GPU is the
tight case: 65.5 GB of BF16 weights leave 6.5 GB, about 24,700 tokens of its 256 KiB/token KV, so
one 64K-token context cannot decode there; the testbed's contexts (2,048 tokens at the paper's
length scale of 32) fit about 12 per engine.
"""
from __future__ import annotations

from dataclasses import dataclass

from dualpath.scheduler.hbm import DecodeHbm, HbmLimit, HbmPlan

from .cost import Target

RESERVE_SHARE = 0.10
LAYERS_IN_FLIGHT = 2


@dataclass(frozen=True, slots=True)
class HbmBudget:
    """One engine's HBM on the target, in bytes."""

    target: str
    capacity_bytes: float
    weight_bytes: float
    reserve_bytes: float
    kv_bytes_per_token: int  # every layer, main KV plus DSA's indexer key
    n_layers: int
    decode_weight_bytes: float  # a decode GPU's weights (its group may be larger than prefill's)
    length_scale: float = 1.0  # the workload's lengths are the target's / this: so is the budget

    def _room(self, weights: float) -> float:
        """What a GPU holding `weights` has for KV, over the length scale."""
        return (self.capacity_bytes - self.reserve_bytes - weights) / self.length_scale

    @property
    def budget_bytes(self) -> float:
        """A prefill engine's room for KV."""
        return self._room(self.weight_bytes)

    @property
    def decode_budget_bytes(self) -> float:
        return self._room(self.decode_weight_bytes)

    def prefill(self, whole_past: bool) -> HbmLimit:
        """A pass's limit: the whole past resident (Basic) or LAYERS_IN_FLIGHT layers of it."""
        layers = self.n_layers if whole_past else min(LAYERS_IN_FLIGHT, self.n_layers)
        return HbmLimit(self.budget_bytes, self.kv_bytes_per_token * layers / self.n_layers, self.kv_bytes_per_token)

    def decode(self, cap_tokens: int | None = None) -> DecodeHbm:
        """`cap_tokens`: what the testbed's own HBM buffer holds (the smaller of the two binds)."""
        return DecodeHbm(self.decode_budget_bytes, self.kv_bytes_per_token, cap_tokens)

    def plan(self, decode_cap_tokens: int | None = None) -> HbmPlan:
        return HbmPlan(self.prefill(True), self.prefill(False), self.decode(decode_cap_tokens))

    def largest_batch_requests(self, context: int, whole_past: bool) -> int:
        """How many requests with `context` cached tokens and one new token each fit one pass."""
        lim = self.prefill(whole_past)
        return int(lim.budget_bytes // lim.resident_bytes(context, 1))

    def largest_batch_tokens(self, context: int, whole_past: bool) -> int:
        """Tokens of the largest prefill batch of such requests (whole requests, as many as fit)."""
        return self.largest_batch_requests(context, whole_past) * (context + 1)


def hbm_budget(target: Target, length_scale: float = 1.0) -> HbmBudget:
    """One engine's HBM budget on `target`, divided by the workload's `length_scale`; an error
    names a target whose weights leave no room."""
    g, m = target.gpu, target.model
    b = HbmBudget(target.name, g.hbm_bytes, m.weight_bytes(), g.hbm_bytes * RESERVE_SHARE,
                  m.kv_bytes_per_token + m.indexer_key_bytes_per_token, m.n_layers,
                  m.weight_bytes(m.decode_ep), length_scale)
    if min(b.budget_bytes, b.decode_budget_bytes) < b.kv_bytes_per_token:
        raise ValueError(f"target {target.name}: its weights ({b.weight_bytes / 1e9:.1f} GB per GPU) and the "
                         f"{RESERVE_SHARE:.0%} reserve leave no HBM for KV on a {g.hbm_bytes / 1e9:.0f} GB GPU"
                         + (f" once divided by the length scale {length_scale:g}" if length_scale != 1 else ""))
    return b
