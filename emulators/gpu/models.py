"""Target model configs, and every byte and FLOP count derived from them.

Each model is the public config.json of its Hugging Face checkpoint, embedded below field for field
(only the fields the counts need). Nothing derived is typed in: parameter counts, KV bytes per
token and FLOPs per token and per (query, key) pair are computed from those fields, so a test can
check them against the published totals (671B / 37B for DeepSeek-V3, 32.8B for Qwen2.5-32B).

Layouts the counts assume:
- MLA KV (DeepSeek-V3, V3.2) is stored in FlashMLA's FP8 layout: per token per layer the
  kv_lora_rank latent in FP8 (1 byte each), one FP32 scale per 128-element tile of it, and the
  qk_rope_head_dim RoPE dims in BF16: 512 + 4*4 + 64*2 = 656 bytes.
- GQA KV (Qwen2.5) is BF16 K and V: 2 * n_kv_heads * head_dim * 2 bytes per layer.
- DSA's lightning-indexer key cache (V3.2) is index_head_dim FP8 values plus one FP32 scale:
  132 bytes per token per layer. It is reported separately and NOT counted in kv_bytes_per_token,
  because Table 1 of the paper excludes it (shared/reference/dualpath-article-zh.txt section 1.1
  shows the published numbers are reproduced only without it).
- Multi-token-prediction modules (num_nextn_predict_layers) are not part of the served model and
  are not counted (DeepSeek's 671B excludes its 14B MTP module).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ._names import lookup

FP8_SCALE_TILE = 128  # FlashMLA: one FP32 scale per 128 FP8 latent values
FP32_BYTES = 4
BF16_BYTES = 2
FP8_BYTES = 1

# The paper's prefill group per model (appendix A / section 7.2): DS 660B runs 2P4D, so 2 prefill
# nodes x 8 GPUs share one EP group; DS 27B's default is 1P1D (8 GPUs). DeepSeek-V3 is not run in
# the paper; it gets the same group as V3.2, its successor with the same MoE.
EP_DS_660B = 16
EP_DS_27B = 8
# The paper's decode group: DS 660B's 2P4D decodes on 4 nodes x 8 GPUs, so each decode GPU holds
# half the routed-expert bytes a prefill GPU does; DS 27B's 1P1D decodes on one node, as it prefills.
DECODE_EP_DS_660B = 32
DECODE_EP_DS_27B = 8


@dataclass(frozen=True, eq=False)
class TargetModel:
    """A target model: its public config plus how its weights sit on one GPU.

    weight_bytes_per_param: storage of every parameter (one number: the DeepSeek checkpoints are
        FP8 for the linear layers, 1 byte; their BF16 embedding, lm_head and norms are counted at
        1 byte too, which undercounts weight bytes by about 2 %). Qwen2.5 is served in BF16, 2 bytes.
    ep: expert-parallel degree; routed experts are split over `ep` GPUs, everything else (attention,
        shared experts, dense layers, embeddings) is replicated, as DP attention + EP does. 1 means
        no sharding (Qwen2.5-32B is served data-parallel, a full copy per GPU).
    decode_ep: the same for the decode group (None: `ep`); it sets a decode GPU's weights, so its
        HBM for KV and the bytes a decode step streams.
    """

    name: str
    source: str
    config: Mapping[str, Any]
    weight_bytes_per_param: float
    ep: int = 1
    assumptions: tuple[str, ...] = ()
    decode_ep: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))
        if self.weight_bytes_per_param <= 0:
            raise ValueError(f"model {self.name}: weight_bytes_per_param must be > 0")
        if self.decode_ep is None:
            object.__setattr__(self, "decode_ep", self.ep)
        n_routed = self.config.get("n_routed_experts") or 0
        for name in ("ep", "decode_ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"model {self.name}: {name} must be an int >= 1, got {v!r}")
            if n_routed and v > n_routed:
                raise ValueError(f"model {self.name}: {name}={v} exceeds its {n_routed} routed experts")

    # -- shape -------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def hidden(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def n_heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def is_mla(self) -> bool:
        return "kv_lora_rank" in self.config

    @property
    def is_dsa(self) -> bool:
        """DeepSeek Sparse Attention: a lightning indexer picks index_topk keys per query."""
        return "index_topk" in self.config

    @property
    def head_dim(self) -> int:
        """GQA head dim (Qwen2 configs omit it: hidden / heads)."""
        return int(self.config.get("head_dim") or self.hidden // self.n_heads)

    @property
    def n_routed_experts(self) -> int:
        return int(self.config.get("n_routed_experts") or 0)

    @property
    def n_moe_layers(self) -> int:
        if not self.n_routed_experts:
            return 0
        return self.n_layers - int(self.config.get("first_k_dense_replace", 0))

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers - self.n_moe_layers

    # -- parameters --------------------------------------------------------------------------
    @property
    def embedding_params(self) -> int:
        return int(self.config["vocab_size"]) * self.hidden

    @property
    def lm_head_params(self) -> int:
        return 0 if self.config.get("tie_word_embeddings", False) else self.embedding_params

    def _attention_params(self) -> int:
        """One layer's attention, including DSA's indexer."""
        c, h, nh = self.config, self.hidden, self.n_heads
        if self.is_mla:
            nope, rope, v, kv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
            ql = c.get("q_lora_rank")
            q = h * ql + ql + ql * nh * (nope + rope) if ql else h * nh * (nope + rope)  # q_a, q_a_norm, q_b
            kv_p = h * (kv + rope) + kv + kv * nh * (nope + v)  # kv_a_proj_with_mqa, kv_a_norm, kv_b
            p = q + kv_p + nh * v * h  # o_proj
            if self.is_dsa:
                ih, idim = c["index_n_heads"], c["index_head_dim"]
                p += ql * ih * idim + h * idim + 2 * idim + h * ih  # wq_b, wk, k_norm (LayerNorm), weights_proj
            return p
        hd, nkv = self.head_dim, int(c["num_key_value_heads"])
        p = h * nh * hd + 2 * h * nkv * hd + nh * hd * h  # q, k, v, o
        if c.get("qkv_bias"):
            p += nh * hd + 2 * nkv * hd
        return p

    def _expert_params(self) -> int:
        """One routed or shared expert: gate, up and down projections."""
        return 3 * self.hidden * int(self.config["moe_intermediate_size"])

    def _router_params(self) -> int:
        n = self.n_routed_experts
        bias = n if self.config.get("topk_method") == "noaux_tc" else 0  # e_score_correction_bias
        return self.hidden * n + bias

    def _params(self, routed_per_layer: int) -> int:
        c, h = self.config, self.hidden
        per_layer = self._attention_params() + 2 * h  # + input and post-attention norms
        p = self.n_layers * per_layer
        p += self.n_dense_layers * 3 * h * int(c["intermediate_size"])
        if self.n_moe_layers:
            shared = int(c.get("n_shared_experts") or 0)
            p += self.n_moe_layers * (self._router_params() + (routed_per_layer + shared) * self._expert_params())
        return p + self.embedding_params + self.lm_head_params + h  # + final norm

    @property
    def total_params(self) -> int:
        return self._params(self.n_routed_experts)

    @property
    def active_params(self) -> int:
        """Parameters one token touches: all but the routed experts it is not sent to."""
        return self._params(int(self.config.get("num_experts_per_tok") or 0))

    @property
    def routed_expert_params(self) -> int:
        if not self.n_moe_layers:
            return 0
        return self.n_moe_layers * self.n_routed_experts * self._expert_params()

    @property
    def linear_flops_per_token(self) -> int:
        """2 FLOPs (multiply, add) per parameter a token is multiplied by: its active parameters
        minus the input embedding, which is a row lookup, not a product; lm_head is included."""
        return 2 * (self.active_params - self.embedding_params)

    # -- weights on one GPU ------------------------------------------------------------------
    def weight_bytes(self, ep: int | None = None) -> float:
        """Bytes of weights resident on one GPU: routed experts split over `ep` GPUs (default:
        this model's ep), the rest replicated."""
        ep = self.ep if ep is None else ep
        routed = self.routed_expert_params
        return (self.total_params - routed + routed / ep) * self.weight_bytes_per_param

    def streamed_weight_bytes(self, ep: int | None = None) -> float:
        """Weight bytes one forward pass reads from HBM: all resident weights except the input
        embedding table, of which a pass reads only its tokens' rows (negligible)."""
        return self.weight_bytes(ep) - self.embedding_params * self.weight_bytes_per_param

    # -- KV cache ----------------------------------------------------------------------------
    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        c = self.config
        if self.is_mla:
            lat = int(c["kv_lora_rank"])
            return lat * FP8_BYTES + -(-lat // FP8_SCALE_TILE) * FP32_BYTES + int(c["qk_rope_head_dim"]) * BF16_BYTES
        return 2 * int(c["num_key_value_heads"]) * self.head_dim * BF16_BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        """Main KV cache bytes of one token over all layers (excludes DSA's indexer keys)."""
        return self.n_layers * self.kv_bytes_per_token_per_layer

    @property
    def indexer_key_bytes_per_token(self) -> int:
        """DSA's indexer key cache over all layers: FP8 key + one FP32 scale per layer; 0 without DSA."""
        if not self.is_dsa:
            return 0
        return self.n_layers * (int(self.config["index_head_dim"]) * FP8_BYTES + FP32_BYTES)

    # -- attention FLOPs per (query, key) pair, all layers ------------------------------------
    @property
    def attention_flops_per_pair(self) -> int:
        """Main attention, one query against one key, all layers: QK^T plus PV, 2 FLOPs per MAC.
        Dense GQA: 4 * heads * head_dim. MLA in its absorbed form (the query is projected into
        the 512-d latent; keys are the 576-d latent+RoPE, values the 512-d latent):
        2 * heads * (kv_lora_rank + rope) + 2 * heads * kv_lora_rank. Under DSA a query has at
        most attention_key_cap such pairs."""
        c, nh = self.config, self.n_heads
        if self.is_mla:
            kv, rope = int(c["kv_lora_rank"]), int(c["qk_rope_head_dim"])
            per_layer = 2 * nh * (kv + rope) + 2 * nh * kv
        else:
            per_layer = 4 * nh * self.head_dim
        return self.n_layers * per_layer

    @property
    def attention_key_cap(self) -> int:
        """Most keys main attention reads per query: DSA's index_topk; 0 for dense (no cap)."""
        return int(self.config["index_topk"]) if self.is_dsa else 0

    @property
    def indexer_flops_per_pair(self) -> int:
        """DSA's lightning indexer, one query against one key, all layers: it scores every key,
        2 * index_n_heads * index_head_dim per pair per layer; 0 without DSA."""
        if not self.is_dsa:
            return 0
        return self.n_layers * 2 * int(self.config["index_n_heads"]) * int(self.config["index_head_dim"])

    def attention_flops_per_query(self, keys: int) -> int:
        """Attention FLOPs of one query over `keys` keys (main attention capped under DSA, plus
        the indexer over all of them)."""
        main = min(keys, self.attention_key_cap) if self.is_dsa else keys
        return main * self.attention_flops_per_pair + keys * self.indexer_flops_per_pair

    def flops_per_new_token(self, context: int) -> int:
        """Forward FLOPs of one new token after `context` keys: linear layers plus attention."""
        if context < 0:
            raise ValueError(f"context must be >= 0, got {context!r}")
        return self.linear_flops_per_token + self.attention_flops_per_query(context)


_HF = "https://huggingface.co/{}/blob/main/config.json"

# deepseek-ai/DeepSeek-V3 config.json (model_type deepseek_v3). quantization_config there is FP8
# e4m3 with 128x128 weight blocks.
DEEPSEEK_V3_CONFIG: dict[str, Any] = {
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "num_nextn_predict_layers": 1,
}

# deepseek-ai/DeepSeek-V3.2 (and -Exp) config.json (model_type deepseek_v32): V3 plus DSA.
DEEPSEEK_V32_CONFIG: dict[str, Any] = {
    **DEEPSEEK_V3_CONFIG,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
}

# Qwen/Qwen2.5-32B config.json (model_type qwen2). head_dim is not a field (hidden / heads = 128).
# "qkv_bias" is not a config field: the Qwen2 architecture always has biases on q, k and v
# (transformers' Qwen2Attention), and none on o.
QWEN25_32B_CONFIG: dict[str, Any] = {
    "num_hidden_layers": 64,
    "hidden_size": 5120,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "intermediate_size": 27648,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "qkv_bias": True,
}

# The paper's DS 27B is internal; appendix A.2 gives only 30 layers, hidden 2560, 72 routed experts
# and indexer top-k 1024. Everything else is assumed, listed in DS27B_ASSUMPTIONS.
DS27B_CONFIG: dict[str, Any] = {
    **DEEPSEEK_V32_CONFIG,
    "num_hidden_layers": 30,
    "hidden_size": 2560,
    "n_routed_experts": 72,
    "index_topk": 1024,
    # assumed:
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "q_lora_rank": 768,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1536,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
}
DS27B_ASSUMPTIONS: tuple[str, ...] = (
    "given by the paper (appendix A.2): 30 layers, hidden 2560, 72 routed experts, index top-k 1024",
    "MLA with V3.2's per-head dims: kv_lora_rank 512, qk_rope 64, qk_nope 128, v_head 128 "
    "(so the same 656 B/token/layer KV layout)",
    "32 attention heads (heads*128 = 1.6x hidden, between DeepSeek-V2-Lite's 1.0x and V3's 2.3x)",
    "q_lora_rank 768 (the indexer's query comes from the q latent, so one is needed)",
    "indexer as V3.2: 64 heads of dim 128",
    "MoE: 6 routed experts per token plus 2 shared (DeepSeek-V2-Lite's routing), "
    "moe_intermediate 1536, first layer dense with intermediate 10240 (4x hidden)",
    "moe_intermediate 1536 with 2 shared experts is what sizes the total to about 27B",
    "vocab 129280 and untied lm_head as V3; FP8 weights; EP over the 1P1D prefill node (8 GPUs)",
)

MODELS: dict[str, TargetModel] = {
    "deepseek-v3": TargetModel("deepseek-v3", _HF.format("deepseek-ai/DeepSeek-V3"), DEEPSEEK_V3_CONFIG,
                               weight_bytes_per_param=FP8_BYTES, ep=EP_DS_660B, decode_ep=DECODE_EP_DS_660B),
    "deepseek-v3.2": TargetModel("deepseek-v3.2", _HF.format("deepseek-ai/DeepSeek-V3.2"), DEEPSEEK_V32_CONFIG,
                                 weight_bytes_per_param=FP8_BYTES, ep=EP_DS_660B, decode_ep=DECODE_EP_DS_660B),
    "ds-27b": TargetModel("ds-27b", "DualPath paper appendix A.2 plus assumptions", DS27B_CONFIG,
                          weight_bytes_per_param=FP8_BYTES, ep=EP_DS_27B, assumptions=DS27B_ASSUMPTIONS,
                          decode_ep=DECODE_EP_DS_27B),
    "qwen2.5-32b": TargetModel("qwen2.5-32b", _HF.format("Qwen/Qwen2.5-32B"), QWEN25_32B_CONFIG,
                               weight_bytes_per_param=BF16_BYTES, ep=1),
}


def model(name: str) -> TargetModel:
    """The catalog entry `name`; an unknown name is a one-line error listing the valid ones."""
    return lookup(MODELS, "model", name)
