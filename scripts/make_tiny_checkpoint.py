#!/usr/bin/env python3
"""Write the tiny deterministic test checkpoint (config.json + model.safetensors).

    .venv/bin/python scripts/make_tiny_checkpoint.py OUT_DIR [--seed 0] [--kind qwen2|llama]

The same seed and kind give byte-identical files. See dualpath/model/tiny.py for the sizes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dualpath.model.config import bytes_per_token_per_layer, load_config  # noqa: E402
from dualpath.model.tiny import DEMO, KINDS, make_tiny_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="checkpoint directory to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kind", choices=KINDS, default="qwen2")
    ap.add_argument("--demo", action="store_true", help="the end-to-end demo's deeper model (8 layers)")
    a = ap.parse_args(argv)
    path = make_tiny_checkpoint(a.out, seed=a.seed, kind=a.kind, **(DEMO if a.demo else {}))
    cfg = load_config(path)
    print(f"{path}: {a.kind} seed={a.seed} layers={cfg.n_layer} hidden={cfg.hidden_size} "
          f"heads={cfg.n_heads}/{cfg.n_kv_heads} head_dim={cfg.head_dim} vocab={cfg.vocab_size} "
          f"kv={bytes_per_token_per_layer(cfg)} B/token/layer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
