"""Correctness against recomputation: every request's tokens and loaded KV vs a full recompute.

The reference runs the same checkpoint in this process with no stored KV at
all: a full prefill of the prompt, then greedy decode. The engines hash each
layer's KV as it lands in their HBM (the PE: the hit KV; the DE: the whole
prompt); the reference hashes the same rows of its own KV. Equal hashes mean
bit-exact KV; the model is tiled so that chunked and full attention agree in
every bit (dualpath/model/transformer.py).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from dualpath.layouts import BlockGeometry, pack_rows
from dualpath.model import Transformer


@dataclass
class Verdict:
    tokens_match: bool
    pe_kv_match: bool | None  # None: nothing loaded (no hit, or oracle)
    de_kv_match: bool | None


def _layer_hashes(kv, geom: BlockGeometry, n: int) -> list[str]:
    out = []
    for k, v in kv:
        rows = torch.empty((n, geom.bytes_per_token_per_layer), dtype=torch.uint8)
        pack_rows(k[:n], v[:n], geom, rows)
        out.append(hashlib.blake2b(rows.numpy().tobytes(), digest_size=16).hexdigest())
    return out


class Reference:
    def __init__(self, checkpoint: str, geom: BlockGeometry):
        torch.set_num_threads(1)  # the engines run single-threaded: same kernels, same bits
        self.model = Transformer.from_pretrained(checkpoint)
        self.geom = geom
        self._cache: dict[tuple, tuple[list[int], object]] = {}

    def run(self, prompt: list[int], gen_len: int) -> tuple[list[int], object]:
        key = (tuple(prompt), gen_len)
        if key not in self._cache:
            res = self.model.generate(prompt, gen_len)
            self._cache[key] = (res.tokens, res.kv)
        return self._cache[key]

    def check(self, prompt: list[int], gen_len: int, tokens: list[int], n_hit: int,
              pe_hashes: list[str], de_hashes: list[str]) -> Verdict:
        ref_tokens, kv = self.run(prompt, gen_len)
        pe = _layer_hashes(kv, self.geom, n_hit) == pe_hashes if pe_hashes else None
        de = _layer_hashes(kv, self.geom, len(prompt)) == de_hashes if de_hashes else None
        return Verdict(ref_tokens == tokens, pe, de)
