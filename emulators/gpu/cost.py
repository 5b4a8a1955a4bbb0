"""The target's time: a GPU spec and a target model turned into the scheduler's coefficient objects.

Every duration here is an ADDITIVE roofline of one pass on one GPU:

    weights streamed once from HBM  +  FLOPs at achieved FLOP/s  +  KV bytes moved at achieved HBM B/s

An additive roofline is an upper bound of the classic max(compute time, memory time) (at most 2x
it). It is chosen on purpose: a sum is linear in the batch, exactly the form of the paper's fitted
"compute to time" model (section 6.2) and of dualpath.scheduler.cost_model. So the function the
scheduler uses to pack a 300 ms compute quota and the function the engine uses to wait out its
emulated duration are one and the same; a max() would make the quota arithmetic and the emulated
clock disagree. All counts (bytes, FLOPs) come from emulators.gpu.models; nothing is fitted.
"""
from __future__ import annotations

from dataclasses import dataclass

from dualpath.scheduler.batching import DEFAULT_QUOTA_S, PrefillItem, pack_batch
from dualpath.scheduler.cost_model import AttentionCostModel, DecodeCostModel

from ._names import UnknownName, lookup
from .models import MODELS, TargetModel
from .specs import GPUS, GpuSpec

GB = 1e9  # bytes
PFLOP = 1e15  # FLOPs
TRACE_APPEND_TOKENS = 429  # mean tokens appended per turn, the paper's MaxLen-64K trace (table 2)


@dataclass(frozen=True, eq=False)
class Target:
    """One emulated GPU running one target model."""

    gpu: GpuSpec
    model: TargetModel

    @property
    def name(self) -> str:
        return f"{self.gpu.name}/{self.model.name}"

    # -- counts --------------------------------------------------------------------------------
    def flops_per_new_token(self, context: int) -> int:
        """Forward FLOPs of one new token that attends to `context` keys: linear layers plus
        attention (DSA: main attention over at most top-k keys, indexer over all)."""
        return self.model.flops_per_new_token(context)

    def cache_compute_ratio(self, context: int, append: int = TRACE_APPEND_TOKENS) -> float:
        """The paper's cache-compute ratio in GB/PFLOP (GB = 1e9 B, PFLOP = 1e15 FLOP), by the method
        shared/reference/dualpath-article-zh.txt section 1.1 re-derives for Table 1: the KV bytes
        of the `context` cached tokens (the turn's load) over the forward FLOPs of the `append`
        new tokens (the turn's compute), each new token counted as attending to `context` keys."""
        if context < 0 or append <= 0:
            raise ValueError("need context >= 0 and append > 0")
        load = context * self.model.kv_bytes_per_token
        compute = append * self.flops_per_new_token(context)
        return (load / GB) / (compute / PFLOP)

    # -- time ------------------------------------------------------------------------------------
    def _flop_s(self, flops: float) -> float:
        return flops / self.gpu.achieved_flops

    def _byte_s(self, nbytes: float) -> float:
        return nbytes / self.gpu.achieved_bytes_per_s

    @property
    def _kv_all_bytes(self) -> int:
        """Every KV byte one token has on the GPU: main KV plus DSA's indexer key."""
        return self.model.kv_bytes_per_token + self.model.indexer_key_bytes_per_token

    def prefill_cost(self) -> AttentionCostModel:
        """Emulated seconds of a prefill pass on this target, as the scheduler's coefficients.

        intercept       the pass's weights streamed once from HBM (however many tokens share them)
        per_new         a new token's linear FLOPs, plus writing its KV (and indexer key) to HBM
        per_pair        per causal (query, key) pair: dense main attention; under DSA the lightning
                        indexer, which scores every key
        per_capped_pair DSA only: main attention, which reads at most pair_cap = index_topk keys per
                        query (0 and cap 0 for dense models)
        per_cached      a cached token's KV (and indexer key) read from HBM once per pass (a batch's
                        queries share one sweep; under DSA the union of many queries' top-k covers
                        most of the context, so a full sweep is the bound)
        Additive roofline: see the module docstring for why a sum and not a max.
        """
        m = self.model
        kv = self._kv_all_bytes
        if m.is_dsa:
            per_pair = self._flop_s(m.indexer_flops_per_pair)
            per_capped, cap = self._flop_s(m.attention_flops_per_pair), m.attention_key_cap
        else:
            per_pair = self._flop_s(m.attention_flops_per_pair)
            per_capped, cap = 0.0, 0
        return AttentionCostModel(
            intercept=self._byte_s(m.streamed_weight_bytes()),
            per_new=self._flop_s(m.linear_flops_per_token) + self._byte_s(kv),
            per_pair=per_pair,
            per_cached=self._byte_s(kv),
            per_capped_pair=per_capped,
            pair_cap=cap,
        )

    def decode_cost(self) -> DecodeCostModel:
        """Emulated seconds of one decode step (one token per sequence) on this target.

        intercept          the weights streamed once per step
        per_request        a token's linear FLOPs, plus writing its KV (and indexer key)
        per_context        per key the token attends to: dense, the main attention FLOPs plus
                           reading that key's KV; DSA, the indexer's FLOPs plus reading its key
        per_capped_context DSA only: main attention FLOPs plus reading the KV of each of at most
                           context_cap = index_topk selected keys
        Decode reads each sequence's KV once per step (its single query has nothing to share), so
        the per-key read is counted per sequence here, unlike prefill's once-per-pass sweep.
        The weights are counted at the model's decode_ep, the paper's decode group (DS 660B's is
        4 nodes, twice its prefill group, so a decode GPU streams half the expert bytes).
        """
        m = self.model
        if m.is_dsa:
            per_ctx = self._flop_s(m.indexer_flops_per_pair) + self._byte_s(m.indexer_key_bytes_per_token)
            per_capped = self._flop_s(m.attention_flops_per_pair) + self._byte_s(m.kv_bytes_per_token)
            cap = m.attention_key_cap
        else:
            per_ctx = self._flop_s(m.attention_flops_per_pair) + self._byte_s(m.kv_bytes_per_token)
            per_capped, cap = 0.0, 0
        return DecodeCostModel(
            intercept=self._byte_s(m.streamed_weight_bytes(m.decode_ep)),
            per_request=self._flop_s(m.linear_flops_per_token) + self._byte_s(self._kv_all_bytes),
            per_context=per_ctx,
            per_capped_context=per_capped,
            context_cap=cap,
        )

    def prefill_tokens_per_s(self, context: int, append: int = TRACE_APPEND_TOKENS,
                             quota_s: float = DEFAULT_QUOTA_S) -> float:
        """New tokens per emulated second of one prefill pass filled to `quota_s`, every request
        having `context` cached tokens and `append` new ones (the last one chunked to fit), packed
        by the scheduler's own pack_batch. This is the engine's prefill rate the scheduler's beta
        (seconds of prefill work an engine may queue) converts to tokens."""
        if context < 0 or append <= 0:
            raise ValueError("need context >= 0 and append > 0")
        cm = self.prefill_cost()
        one = cm.request_cost(context, append)
        if one <= 0:
            raise ValueError(f"target {self.name}: a request costs no time, so no rate exists")
        n = int(quota_s / one) + 2  # enough whole requests to overflow the quota
        queue = [PrefillItem(f"r{i}", context, append) for i in range(n)]
        batch = pack_batch(queue, cm, quota_s)
        tokens = sum(e.new for e in batch.entries)
        return tokens / batch.predicted_s


def dilation(testbed_kv_bytes_per_token: int, target_kv_bytes_per_token: int, link_scale: float) -> float:
    """The testbed's one time dilation k = (testbed / target KV bytes per token) / link_scale.

    link_scale = testbed link rate / target link rate. A request with L cached tokens loads its KV
    in L * b_testbed / R_testbed seconds on the testbed and in L * b_target / R_target on the target,
    so its load takes k = (b_testbed / b_target) * (R_target / R_testbed) times as long on the
    testbed. For the testbed to keep the target's ratio of KV-load time to compute time (the
    quantity the whole paper is about), its emulated compute must last k times the target's too:
    every emulated duration is the target's seconds times k.
    """
    if testbed_kv_bytes_per_token <= 0 or target_kv_bytes_per_token <= 0:
        raise ValueError("bytes per token must be > 0")
    if not link_scale > 0:
        raise ValueError(f"link_scale must be > 0, got {link_scale!r}")
    return (testbed_kv_bytes_per_token / target_kv_bytes_per_token) / link_scale


TARGETS: dict[tuple[str, str], Target] = {(g, m): Target(GPUS[g], MODELS[m]) for g in GPUS for m in MODELS}


def target(gpu_name: str, model_name: str) -> Target:
    """The target `gpu_name` x `model_name`; a bad name is a one-line error naming it and the
    valid ones (GPU checked first)."""
    lookup(GPUS, "GPU", gpu_name)
    lookup(MODELS, "model", model_name)
    return TARGETS[(gpu_name, model_name)]


__all__ = ["Target", "TARGETS", "target", "dilation", "UnknownName", "GB", "PFLOP", "TRACE_APPEND_TOKENS"]
