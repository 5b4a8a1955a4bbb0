"""Reading the weights of a Hugging Face checkpoint directory (safetensors only).

A directory holds either `model.safetensors` or `model.safetensors.index.json` plus the shards it
names. Tensor names are the standard ones of `Qwen2ForCausalLM` / `LlamaForCausalLM`
(`model.layers.{i}.self_attn.q_proj.weight`, ...). Every expected tensor must be present with the
expected shape; a tensor we do not know is an error too, because it means a feature this
transformer would silently ignore.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import CheckpointError, ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers that some old checkpoints saved and that carry no information we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the transformer needs, with its shape."""
    h, kv, hd = cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim, cfg.head_dim
    q = cfg.n_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        for name, shape in (("gate_proj", (cfg.intermediate_size, h)), ("up_proj", (cfg.intermediate_size, h)),
                            ("down_proj", (h, cfg.intermediate_size))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if cfg.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = (shape[0],)
    return shapes


def _tensor_files(root: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it."""
    single, index = root / SINGLE_FILE, root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: field 'weight_map' unreadable ({e!r})") from None
        files = {}
        for name, fname in weight_map.items():
            f = root / fname
            if Path(fname).name != fname or not f.is_file():
                raise CheckpointError(f"{index}: field 'weight_map' names shard {fname!r}, which is not in {root}")
            files[name] = f
        return files
    if single.is_file():
        with safe_open(str(single), framework="pt") as sf:
            return {name: single for name in sf.keys()}
    extra = " (pytorch_model.bin is not supported; convert to safetensors)" if (root / "pytorch_model.bin").exists() else ""
    raise CheckpointError(f"{root}: missing {SINGLE_FILE} or {INDEX_FILE}{extra}")


def load_weights(root: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu"
                 ) -> dict[str, torch.Tensor]:
    """Load and check every tensor `cfg` needs, cast to `dtype` on `device`."""
    root = Path(root)
    files = _tensor_files(root)
    want = expected_shapes(cfg)
    if cfg.tie_word_embeddings:
        files.pop("lm_head.weight", None)  # some tied checkpoints still store it; the embedding wins, as in HF
    unknown = sorted(n for n in files if n not in want and not n.endswith(_IGNORED_SUFFIXES))
    if unknown:
        more = f" (+{len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise CheckpointError(f"{files[unknown[0]]}: unexpected tensors {unknown[:3]}{more}; "
                              f"this {cfg.model_type} config does not use them")
    missing = [n for n in want if n not in files]
    if missing:
        where = root / (INDEX_FILE if (root / INDEX_FILE).is_file() else SINGLE_FILE)
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{where}: missing tensors {missing[:3]}{more}")

    by_file: dict[Path, list[str]] = {}
    for name in want:
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as sf:
            for name in names:
                t = sf.get_tensor(name)
                if tuple(t.shape) != want[name]:
                    raise CheckpointError(f"{f}: tensor '{name}' has shape {tuple(t.shape)}, "
                                          f"config.json implies {want[name]}")
                if not t.is_floating_point():
                    raise CheckpointError(f"{f}: tensor '{name}' has dtype {t.dtype}; expected floating point")
                out[name] = t.to(device=device, dtype=dtype).contiguous()
    return out
