"""The testbed's model: a Qwen2/Llama-family GQA decoder run one layer at a time.

See transformer.py for the per-layer API and the KV shape convention
([n_tokens, n_kv_heads, head_dim] per layer for K and for V).
"""
from .config import (CheckpointError, ModelConfig, bytes_per_token_per_layer, dtype_size, load_config,
                     parse_dtype)
from .registry import MODEL_NAMES, resolve_model
from .transformer import KV, TILE, DecodeCache, GenerateResult, PrefillResult, Transformer, concat_kv

__all__ = ["CheckpointError", "ModelConfig", "bytes_per_token_per_layer", "dtype_size", "load_config",
           "parse_dtype", "MODEL_NAMES", "resolve_model", "KV", "TILE", "GenerateResult", "PrefillResult",
           "Transformer", "DecodeCache", "concat_kv"]
