"""Correctness against recomputation: every request's tokens and loaded KV vs a full recompute.

The reference runs the same checkpoint in this process with none of the
testbed's KV: a prefill of the prompt (after its own KV of the trajectory's
earlier turns), then greedy decode. The engines hash each
layer's KV as it lands in their HBM (the PE: the hit KV; the DE: the whole
prompt); the reference hashes the same rows of its own KV. Equal hashes mean
bit-exact KV; the model is tiled so that chunked and full attention agree in
every bit (dualpath/model/transformer.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dualpath.kv.check import layer_hash
from dualpath.kv.layouts import BlockGeometry
from dualpath.model import Transformer
from dualpath.model.device import resolve_device


@dataclass
class Verdict:
    tokens_match: bool
    pe_kv_match: bool | None  # None: nothing loaded (no hit, or oracle)
    de_kv_match: bool | None
    wrong_tokens: int = 0  # generated tokens unlike the recomputation's (a missing or extra one counts)
    pe_bad_layer: int | None = None  # the first layer whose loaded KV differs (None: every one matched)
    de_bad_layer: int | None = None


def first_bad_layer(got: list[str], want: list[str]) -> int | None:
    """The first layer whose hash differs; a missing or extra layer counts from where the lists part."""
    for layer, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return layer
    return None if len(got) == len(want) else min(len(got), len(want))


def _layer_hashes(kv, geom: BlockGeometry, n: int) -> list[str]:
    return [layer_hash(k[:n], v[:n], geom) for k, v in kv]


class Reference:
    """Recomputes each request in this process, with no KV from the testbed at all.

    A trajectory's turns share their prefix: turn t's prompt is turn t-1's prompt, its tokens
    and a new append. The reference keeps its *own* KV of each trajectory's latest context and
    prefills only what is new, which is bit-identical to a full recomputation because the model
    computes every token on position-aligned tiles whatever the chunking
    (dualpath/model/transformer.py; tests/test_model.py checks cached against full prefill).
    Nothing it uses ever passed through a store, a NIC or an engine.
    """

    MAX_CONTEXTS = 256  # contexts kept for extension (one per live trajectory is enough)

    def __init__(self, checkpoint: str, geom: BlockGeometry, device: str = "cpu"):
        torch.set_num_threads(1)  # the engines run single-threaded: same kernels, same bits
        self.model = Transformer.from_pretrained(checkpoint, device=resolve_device(device))
        self.geom = geom
        self._cache: dict[tuple, tuple[list[int], object]] = {}
        self._contexts: dict[tuple, list] = {}  # tokens whose KV we computed -> that KV per layer

    def _longest_prefix(self, prompt: tuple) -> tuple[tuple, list | None]:
        best: tuple = ()
        for ctx in self._contexts:
            if len(best) < len(ctx) < len(prompt) and prompt[:len(ctx)] == ctx:
                best = ctx
        return best, self._contexts.get(best)

    def run(self, prompt: list[int], gen_len: int) -> tuple[list[int], object]:
        self.run_many([(prompt, gen_len)])
        return self._cache[(tuple(prompt), gen_len)]

    def run_many(self, items: list[tuple[list[int], int]]) -> None:
        """Recompute every (prompt, gen_len) not seen yet: each prompt prefilled alone after its
        longest computed prefix, then all of them decoded together, one batched step per token
        (`decode_step` is bit-identical to decoding each alone; tests/test_model.py). Requests of
        different trajectories share the steps; the per-step overhead of a one-token decode was
        most of the recomputation's CPU."""
        from dualpath.model import DecodeCache
        from dualpath.model.transformer import concat_kv

        todo: dict[tuple, tuple[tuple, list[int], DecodeCache]] = {}  # key -> (prefix, tokens, cache)
        for prompt, gen_len in items:
            key = (tuple(prompt), gen_len)
            if key in self._cache or key in todo:
                continue
            done, past = self._longest_prefix(key[0])
            res = self.model.prefill(prompt[len(done):], past, last_only=True)
            todo[key] = (done, [int(res.logits[-1].argmax())], DecodeCache(self.model, concat_kv(past, res.new_kv)))
        while step := [(out, cache) for (_, gen_len), (_, out, cache) in todo.items() if len(out) < gen_len]:
            for (out, _), tok in zip(step, self.model.decode_step([o[-1] for o, _ in step], [c for _, c in step])):
                out.append(tok)
        for key, (done, out, cache) in todo.items():
            kv = [(k.contiguous(), v.contiguous()) for k, v in cache.kv()]
            self._cache[key] = (out, kv)
            self._contexts.pop(done, None)  # extended: the longer context replaces it
            self._contexts[key[0] + tuple(out[:-1])] = kv
        while len(self._contexts) > self.MAX_CONTEXTS:
            self._contexts.pop(next(iter(self._contexts)))

    def check(self, prompt: list[int], gen_len: int, tokens: list[int], n_hit: int,
              pe_hashes: list[str], de_hashes: list[str]) -> Verdict:
        ref_tokens, kv = self.run(prompt, gen_len)
        pe_bad = first_bad_layer(pe_hashes, _layer_hashes(kv, self.geom, n_hit)) if pe_hashes else None
        de_bad = first_bad_layer(de_hashes, _layer_hashes(kv, self.geom, len(prompt))) if de_hashes else None
        wrong = sum(a != b for a, b in zip(ref_tokens, tokens)) + abs(len(ref_tokens) - len(tokens))
        return Verdict(ref_tokens == tokens, pe_bad is None if pe_hashes else None,
                       de_bad is None if de_hashes else None, wrong, pe_bad, de_bad)


_REFERENCES: dict[tuple[str, str], Reference] = {}  # per process: one model per checkpoint and device


def check_trajectories(checkpoint: str, geom: BlockGeometry, trajectories: dict[int, list[tuple]],
                       device: str = "cpu") -> dict[int, list[Verdict]]:
    """Each trajectory's requests (`Reference.check`'s arguments, in turn order, every mode's in a
    row) against this process's reference on `device`: a worker of `testbed.experiments.ablation.verify`.
    The trajectories go in lockstep, each one's next request in one `run_many`, so their decode
    steps are batched; within a trajectory every turn still extends the one before."""
    ref = _REFERENCES.get((checkpoint, device))
    if ref is None or ref.geom != geom:
        ref = _REFERENCES[(checkpoint, device)] = Reference(checkpoint, geom, device)
    out: dict[int, list[Verdict]] = {t: [] for t in trajectories}
    for i in range(max((len(r) for r in trajectories.values()), default=0)):
        now = {t: reqs[i] for t, reqs in trajectories.items() if i < len(reqs)}
        ref.run_many([(args[0], args[1]) for args in now.values()])
        for t, args in now.items():
            out[t].append(ref.check(*args))
    return out
