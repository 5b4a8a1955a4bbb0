"""Portable CPU kernels: the same floats from every server of a cluster.

torch picks its CPU kernels by what the CPU offers (AVX-512 on this project's dev machine, AVX2
in its QEMU guest), and MKL's GEMMs block their sums by it: the demo model's KV after a 64-token
prefill and 8 decoded tokens hashed differently on the two (a871f9c9 and 60af553e), and
MKL_CBWR=AVX2 alone did not make them agree (52ebbe6c against 60af553e). With MKL's
conditional-numerical-reproducibility mode COMPATIBLE and ATen's plain (non-vector) kernels,
both gave 82abb256. A run whose engines sit on more than one server therefore runs every
engine, and the conductor's reference, with these kernels; `dualpath cluster prepare` checks
that each server gives this machine's hash (`python -m dualpath.model.numerics CHECKPOINT`).

Both settings are read once, when torch first dispatches a CPU kernel or MKL first runs, so
they must be in the environment before that: `use_portable_kernels` checks it took.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

PORTABLE_KERNELS = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"}


class NumericsError(RuntimeError):
    """The kernels were picked before the portable ones could be asked for."""


def portable_kernels_set() -> bool:
    return all(os.environ.get(k) == v for k, v in PORTABLE_KERNELS.items())


def use_portable_kernels() -> None:
    """Ask for the portable kernels in this process (and its children); raises NumericsError when
    torch had already picked others."""
    os.environ.update(PORTABLE_KERNELS)
    import torch

    got = torch.backends.cpu.get_cpu_capability()
    if got != "DEFAULT":
        raise NumericsError(f"torch already runs its {got} kernels in this process: the portable ones must be "
                            "asked for before the first tensor operation")


def probe_hash(checkpoint: Path, prompt_tokens: int = 64, new_tokens: int = 8) -> str:
    """A prefill and a greedy decode of the checkpoint on a seeded prompt: a hash of its tokens
    and every layer's KV. Equal on two servers means they compute the same floats."""
    import torch

    from dualpath.model import Transformer

    m = Transformer.from_pretrained(checkpoint)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, m.config.vocab_size, (prompt_tokens,), generator=g).tolist()
    r = m.generate(prompt, new_tokens)
    h = hashlib.sha256(repr(r.tokens).encode())
    for k, v in r.kv:
        h.update(k.contiguous().numpy().tobytes())
        h.update(v.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m dualpath.model.numerics CHECKPOINT_DIR", file=sys.stderr)
        return 2
    if not Path(argv[0], "config.json").is_file():
        print(f"numerics: no checkpoint at {argv[0]}", file=sys.stderr)
        return 2
    use_portable_kernels()
    print(probe_hash(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
