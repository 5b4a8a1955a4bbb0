"""A tiny, deterministic checkpoint for tests and demos.

`make_tiny_checkpoint(path, seed=0, kind="qwen2")` builds `Qwen2ForCausalLM` (or
`LlamaForCausalLM` with kind="llama") from a fixed config with transformers, initialised under a
fixed seed, and writes a standard checkpoint directory: config.json + model.safetensors. The same
seed gives byte-identical files.

Sizes (both kinds): 4 layers, hidden 128, 4 query heads, 2 KV heads, head_dim 32, MLP 256,
vocab 512, float32. KV is 2 * 2 * 32 * 4 = 512 bytes per token per layer, 2 KiB per token over all
layers. A 2k-token prefill runs in a fraction of a second on one CPU core.

The qwen2 kind ties embeddings (like Qwen2-0.5B) and has q/k/v biases; the llama kind has an
untied lm_head, no biases and Llama-3-style RoPE scaling (rope_type "llama3") with a small
original context, so that the scaled frequencies are exercised in tests.

Weights use a larger init std (0.1) than transformers' 0.02 so that the random model's greedy
output depends on its context: with 0.02 every prompt decodes to nearly the same token, and a
test comparing tokens could not tell right KV from wrong.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
            rms_norm_eps=1e-6, initializer_range=0.1,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no tokenizer, so no special ids
KINDS = ("qwen2", "llama")


# The end-to-end demo's model: deeper, so "about one layer of hit KV resident" in layerwise prefill
# stands out against all layers in basic, with one KV head to keep KV per token at 2 KiB.
DEMO = dict(num_hidden_layers=8, num_key_value_heads=1)
# Its KV bytes per token over all layers (float32 K and V of 1 head of 128 / 4 dims, 8 layers):
# what sets a run's dilation, known without building the model.
DEMO_KV_BYTES_PER_TOKEN = 2 * DEMO["num_key_value_heads"] * (TINY["hidden_size"] // TINY["num_attention_heads"]) \
    * 4 * DEMO["num_hidden_layers"]


def tiny_hf_config(kind: str = "qwen2", **overrides):
    """The transformers config object of the tiny model (`overrides`: e.g. DEMO)."""
    from transformers import LlamaConfig, Qwen2Config

    sizes = {**TINY, **overrides}
    if kind == "qwen2":
        return Qwen2Config(**sizes, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 10000.0})
    if kind == "llama":
        return LlamaConfig(**sizes, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 256})
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def make_tiny_checkpoint(path: str | Path, seed: int = 0, kind: str = "qwen2", **overrides) -> Path:
    """Write the tiny checkpoint into directory `path` (created if needed) and return it."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    cls = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}.get(kind)
    cfg = tiny_hf_config(kind, **overrides)
    cfg.dtype = "float32"
    gen = torch.random.fork_rng(devices=[])
    with gen:  # do not disturb the caller's RNG
        torch.manual_seed(seed)
        model = cls(cfg).to(torch.float32).eval()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: stored once, as transformers saves it
    # Written by hand rather than save_pretrained: sorted keys and fixed metadata make the bytes a
    # function of (seed, kind, transformers version) only.
    save_file(dict(sorted(state.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # save_file creates 0600; engines may run as other users
    d = cfg.to_dict()
    d["architectures"] = [cls.__name__]
    (out / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    return out
