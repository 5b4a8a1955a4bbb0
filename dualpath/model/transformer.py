"""A decoder-only GQA transformer of the Qwen2/Llama family, driven one layer at a time.

This is the model the engines run. It is written for reading (in the spirit of nanoGPT and
gpt-fast), with one explicit loop over layers that the engines drive themselves:

    x = model.embed(tokens)                                   # [n, hidden]
    for l in range(model.config.n_layer):
        x, k_new, v_new = model.layer_forward(l, x, positions, past_k[l], past_v[l])
    logits = model.logits(x, positions)                       # [n, vocab]

KV convention. For one sequence and one layer, K and V are tensors of shape
`[n_tokens, n_kv_heads, head_dim]` in the model dtype, token-major. K is stored *after* RoPE (as
transformers and vLLM cache it), so a cached K is bound to its absolute position. `past_k`/`past_v`
are the hit KV of the prefix (positions 0..P-1); `k_new`/`v_new` are the KV of the new (miss)
tokens (positions P..P+n-1). Attention is causal over past + new.

One sequence per call. A batch of requests is a loop over its requests inside each layer.

Determinism: token-aligned tiles
--------------------------------
The engines must produce the same tokens whether a prompt's KV is recomputed in one prefill, read
back from cache after an earlier prefill, or built one token at a time by decode. With float32 on
CPU a naive implementation does not give that: BLAS picks different kernels for different row
counts (1-2 rows take a GEMV path; large K splits differently), and elementwise kernels such as
SiLU take a scalar path for a tensor's tail, so a token's K differs in the last bits depending on
how many tokens were computed with it. Measured with transformers on the tiny checkpoint, 2048
tokens: prefill in two chunks vs one differs by up to ~5e-6 in K and ~4e-6 in the logits, and a
one-token decode step by ~5e-6 in the logits; a lone F.linear on 1-2 rows differs from the same
rows inside a 16-row GEMM by up to ~1e-5.

So every per-token computation runs on fixed-shape tiles of `tile` rows aligned to *absolute*
positions: the token at position p is always row p % tile of tile p // tile, and rows that are not
part of the call are zero padding. Attention for tile t always spans keys [0, (t+1)*tile) with the
same causal mask, keys past the end being zero and masked. Each op therefore sees the same shapes
and the same row index for a given token, whatever the chunking, and its result does not depend
on other rows' contents (masked keys get weight exactly 0). The result: a prefill that reuses past
KV yields bit-identical logits and KV to a full recomputation, and so does decode, on the same
device, dtype, tile size and torch thread count (larger GEMMs in MKL split work by thread count,
so engines that must agree bit for bit should run with the same `torch.get_num_threads()`; the
tiny checkpoint was bit-identical at 1 and 2 threads). In bfloat16 or float16 on CPU the
methods turn oneDNN off while they run (`_exact`): its GEMMs on CPUs with native bfloat16 are not
row-independent. On a shared 2-core machine run CPU engines
with `torch.set_num_threads(1)`: with 2 OpenMP threads and a busy CPU a 2k-token prefill of the
tiny model took 5.2 s instead of 0.33 s (spin-waiting).
The cost is padding: a decode step computes a `tile`-row tile for one token. For the tiny model
that costs about the same as one row (small GEMMs are bound by reading the weights); for
SmolLM2-135M (float32, one core of this testbed's AVX2 EPYC) a 16-row GEMM is compute-bound, about
5x one row. Measured at 1K tokens of context: tile 16 (the default) prefills 7.8 ms per token and
decodes 207 ms per token; tile 8: 13.0 / 166; tile 4: 21.9 / 140; tile 1: 36.3 / 73.
A batched decode step shares tiles between its sequences' tokens (each still at row p % tile of
some tile; `decode_step`), so a batch of B needs as many tiles as the most tokens on one row, not
B: with SmolLM2 a step of 6 sequences at ~600 tokens took 0.32 s instead of about 0.6 s.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from .checkpoint import load_weights
from .config import ModelConfig, RopeConfig, bytes_per_token_per_layer, load_config, parse_dtype

TILE = 16  # rows per tile; see the module docstring
_ROPE_CHUNK = 4096  # RoPE tables grow in aligned chunks of this many positions (fixed shapes again)

KV = tuple[torch.Tensor, torch.Tensor]  # (K, V), each [n_tokens, n_kv_heads, head_dim]


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [n_new, vocab] (or [1, vocab] with last_only), float
    new_kv: list[KV]  # per layer: KV of the new tokens only
    n_past: int  # tokens of past KV the call started from


@dataclass
class GenerateResult:
    tokens: list[int]  # the generated tokens (not the prompt)
    kv: list[KV]  # per layer: KV of past + prompt + all generated tokens but the last


def concat_kv(past: Sequence[KV] | None, new: Sequence[KV]) -> list[KV]:
    """Per layer, past KV followed by new KV along the token axis."""
    if not past:
        return [(k, v) for k, v in new]
    return [(torch.cat([pk, k]), torch.cat([pv, v])) for (pk, pv), (k, v) in zip(past, new)]


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies of RoPE (float32, [head_dim // 2]), as transformers computes them."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        low_wl = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wl = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled)
    return inv


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _exact(method):
    """torch.no_grad, and oneDNN off for a reduced-precision model on CPU. oneDNN's bfloat16
    GEMMs (CPUs with AVX512-BF16 or AMX) pick their blocking by the row count, so a row's result
    depends on how many rows were stacked with it: on such a CPU a cached-prefix prefill gave
    other logits than a full one. Without oneDNN, torch's own kernels are row-independent, as
    on CPUs without native bfloat16, and slower: a 33-token SmolLM2 prefill took 0.92 s against
    oneDNN's 0.19 s, timed by hand."""
    @functools.wraps(method)
    def run(self: "Transformer", *args, **kwargs):
        with torch.no_grad():
            if not self._onednn_off:
                return method(self, *args, **kwargs)
            was = torch.backends.mkldnn.enabled  # (its `flags()` also resets the TF32 settings)
            torch.backends.mkldnn.enabled = False
            try:
                return method(self, *args, **kwargs)
            finally:
                torch.backends.mkldnn.enabled = was
    return run


class Transformer:
    """Weights plus the per-layer forward. No nn.Module: nothing here trains."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: str | torch.device = "cpu", tile: int = TILE):
        if tile < 1:
            raise ValueError(f"tile must be >= 1, got {tile}")
        self.config, self.dtype, self.device, self.tile = config, dtype, torch.device(device), tile
        self._onednn_off = self.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
        c = config
        self.embed_w = weights["model.embed_tokens.weight"]
        self.norm_w = weights["model.norm.weight"]
        self.lm_head_w = self.embed_w if c.tie_word_embeddings else weights["lm_head.weight"]
        self.layers = []
        for i in range(c.n_layer):
            p = f"model.layers.{i}."
            self.layers.append({name: weights.get(p + key) for name, key in (
                ("ln1", "input_layernorm.weight"), ("ln2", "post_attention_layernorm.weight"),
                ("wq", "self_attn.q_proj.weight"), ("bq", "self_attn.q_proj.bias"),
                ("wk", "self_attn.k_proj.weight"), ("bk", "self_attn.k_proj.bias"),
                ("wv", "self_attn.v_proj.weight"), ("bv", "self_attn.v_proj.bias"),
                ("wo", "self_attn.o_proj.weight"), ("bo", "self_attn.o_proj.bias"),
                ("wg", "mlp.gate_proj.weight"), ("bg", "mlp.gate_proj.bias"),
                ("wu", "mlp.up_proj.weight"), ("bu", "mlp.up_proj.bias"),
                ("wd", "mlp.down_proj.weight"), ("bd", "mlp.down_proj.bias"))})
        self.scale = c.head_dim ** -0.5
        self._inv_freq = rope_inv_freq(c.rope, c.head_dim).to(self.device)
        self._cos = torch.empty(0, c.head_dim, dtype=dtype, device=self.device)
        self._sin = torch.empty(0, c.head_dim, dtype=dtype, device=self.device)
        # causal mask inside a tile: query row i may not see key column j > i
        self._tile_mask = torch.ones(tile, tile, dtype=torch.bool, device=self.device).triu(1)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str | torch.dtype | None = None,
                        device: str | torch.device = "cpu", tile: int = TILE) -> "Transformer":
        """Load a Qwen2 or Llama checkpoint directory (config.json + safetensors).

        `dtype` defaults to the dtype config.json declares. Unsupported checkpoints raise
        `CheckpointError` with one line naming the file and the field.
        """
        config = load_config(path)
        dt = parse_dtype(dtype) if dtype is not None else config.dtype
        return cls(config, load_weights(path, config, dt, device), dt, device, tile)

    # -- sizes ----------------------------------------------------------------------------------

    @property
    def bytes_per_token_per_layer(self) -> int:
        """KV bytes per token per layer in the dtype this model runs in."""
        return bytes_per_token_per_layer(self.config, self.dtype)

    # -- the per-layer API -----------------------------------------------------------------------

    @_exact
    def embed(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Token ids [n] -> hidden states [n, hidden_size]."""
        return F.embedding(self._tokens(tokens), self.embed_w)

    @_exact
    def layer_forward(self, l: int, hidden: torch.Tensor, positions: int | Sequence[int] | torch.Tensor | None,
                      past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run decoder layer `l` on the new tokens of one sequence.

        hidden:   [n, hidden_size], the new tokens' hidden states entering layer l.
        positions: absolute positions of the new tokens: an int start, a range/tensor that must be
                  P, P+1, ..., P+n-1, or None (= P), where P = len(past_k).
        past_k/past_v: [P, n_kv_heads, head_dim] hit KV of this layer for positions 0..P-1, or None.
        Returns (hidden [n, hidden_size], k_new, v_new [n, n_kv_heads, head_dim]); the new tokens
        attend causally to past and new.
        """
        c, T, w = self.config, self.tile, self.layers[l]
        n = hidden.shape[0]
        P = self._check_past(past_k, past_v)
        self._check_positions(positions, n, P)
        kv_shape = (c.n_kv_heads, c.head_dim)
        if n == 0:
            empty = hidden.new_empty((0, *kv_shape))
            return hidden, empty, empty.clone()
        t0, t1 = P // T, -(-(P + n) // T)  # tiles touched by the new tokens
        self._ensure_rope(t1 * T)
        # Keys and values of positions [0, t1*T), zero past P+n, built once per call directly in
        # the head-major layouts attention multiplies: Kh [Hkv, D, L] and Vh [Hkv, L, D]. (Building a
        # token-major padded copy and permuting it per tile cost three passes over the past KV per
        # layer and call, a tenth of a decode step at 1K tokens of SmolLM2.) The values and shapes
        # _attend sees are the same as before, so are its results, bit for bit.
        L_all = t1 * T
        Kh = torch.empty(c.n_kv_heads, c.head_dim, L_all, dtype=self.dtype, device=self.device)
        Vh = torch.empty(c.n_kv_heads, L_all, c.head_dim, dtype=self.dtype, device=self.device)
        if P:
            Kh[:, :, :P] = past_k.permute(1, 2, 0)
            Vh[:, :P] = past_v.permute(1, 0, 2)
        Kh[:, :, P:].zero_()
        Vh[:, P:].zero_()
        k_new = torch.empty(n, *kv_shape, dtype=self.dtype, device=self.device)
        v_new = torch.empty_like(k_new)
        off = P - t0 * T  # row of the first new token in the padded buffer
        nt = (t1 - t0) * T
        x = hidden.new_zeros((nt, c.hidden_size))
        x[off:off + n] = hidden
        # Every tile's row-wise ops (norms, projections, RoPE, MLP) run stacked in one call each:
        # a row's result does not depend on the other rows (tests/test_model.py checks it bit for
        # bit), and one call instead of one per tile is most of a CPU prefill's time. Attention
        # stays per tile: tile t sees keys [0, (t+1)*T) with its own causal mask.
        h = self._rmsnorm(x, w["ln1"])
        q = F.linear(h, w["wq"], w["bq"]).view(nt, c.n_heads, c.head_dim)
        k = F.linear(h, w["wk"], w["bk"]).view(nt, *kv_shape)
        v = F.linear(h, w["wv"], w["bv"]).view(nt, *kv_shape)
        cos, sin = self._cos[t0 * T:t1 * T, None, :], self._sin[t0 * T:t1 * T, None, :]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_new.copy_(k[off:off + n])
        v_new.copy_(v[off:off + n])
        Kh[:, :, P:P + n], Vh[:, P:P + n] = k_new.permute(1, 2, 0), v_new.permute(1, 0, 2)
        att = []
        for t in range(t0, t1):
            rows = slice((t - t0) * T, (t - t0 + 1) * T)
            L = (t + 1) * T
            if L == L_all:  # the last tile (a decode step's only one) attends to the whole buffers
                att.append(self._attend(q[rows], Kh, Vh))
            else:  # an earlier tile: a contiguous copy of its key range, as the last tile sees its own
                att.append(self._attend(q[rows], Kh[:, :, :L].contiguous(), Vh[:, :L].contiguous()))
        x = x + F.linear(torch.cat(att) if len(att) > 1 else att[0], w["wo"], w["bo"])
        h = self._rmsnorm(x, w["ln2"])
        g = F.silu(F.linear(h, w["wg"], w["bg"])) * F.linear(h, w["wu"], w["bu"])
        out = x + F.linear(g, w["wd"], w["bd"])
        return out[off:off + n], k_new, v_new

    @_exact
    def logits(self, hidden: torch.Tensor, positions: int | Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Final RMSNorm + lm_head: [n, hidden_size] at the given positions -> [n, vocab] logits."""
        T, n = self.tile, hidden.shape[0]
        start = self._check_positions(positions, n, None)
        t0, t1 = start // T, -(-(start + n) // T)
        off = start - t0 * T
        x = hidden.new_zeros(((t1 - t0) * T, hidden.shape[1]))
        x[off:off + n] = hidden
        out = torch.cat([F.linear(self._rmsnorm(x[i:i + T], self.norm_w), self.lm_head_w)
                         for i in range(0, x.shape[0], T)]) if n else x.new_empty((0, self.config.vocab_size))
        return out[off:off + n]

    @_exact
    def decode_step(self, tokens: Sequence[int], caches: Sequence["DecodeCache"]) -> list[int]:
        """One decode step of a batch: sequence i feeds tokens[i] after the KV in caches[i].

        Returns each sequence's greedy next token; each cache gains the fed token's KV. Bit-identical
        to `prefill([tokens[i]], past_kv, last_only=True)` for each sequence on its own: every
        token still sits in row p % tile of a `tile`-row tile (p its position; see the module
        docstring), and the row-wise ops (linear layers, norms, RoPE, SiLU, lm_head), whose result
        for a row does not depend on the other rows (checked in tests/test_model.py), run once on
        the stacked tiles. Attention stays per sequence, on the cache's buffers, which have exactly
        the shape and zeros layer_forward would build.

        Tokens share tiles: a token goes into the first tile whose row p % tile is still free, so
        a batch takes as many tiles as the most tokens that fall on one row (a batch of B usually
        needs far fewer than B tiles, and each of its tiles was mostly padding). A sequence's
        attention runs on the whole tile its token is in (the same shape as alone; only its own
        row is kept). What batching saves is the per-op overhead and the padding rows of a CPU
        decode step, which otherwise dominate a one-token step; what the cache saves is rebuilding
        and concatenating every sequence's past on every step.
        """
        c, T, B = self.config, self.tile, len(tokens)
        if B == 0:
            return []
        if len(caches) != B:
            raise ValueError(f"{B} tokens but {len(caches)} caches")
        P = [cache.n for cache in caches]
        for cache in caches:
            cache.make_room()
        rows = [p % T for p in P]  # the token's row in its tile
        used: list[set[int]] = []  # per packed tile, the rows taken
        slot = []  # each token's row in the stacked tiles
        for r in rows:
            j = next((j for j, u in enumerate(used) if r not in u), len(used))
            if j == len(used):
                used.append(set())
            used[j].add(r)
            slot.append(j * T + r)
        nt = len(used) * T
        self._ensure_rope(max(P) + 1)
        kv_shape = (c.n_kv_heads, c.head_dim)
        x = torch.zeros(nt, c.hidden_size, dtype=self.dtype, device=self.device)
        x[slot] = self.embed(tokens)
        # row slot[i] gets position P[i]'s angles; the free rows keep their row's angles of tile 0
        cos = self._cos[:T].repeat(len(used), 1)
        sin = self._sin[:T].repeat(len(used), 1)
        cos[slot], sin[slot] = self._cos[P], self._sin[P]
        cos, sin = cos[:, None, :], sin[:, None, :]
        tile_of = [(s // T) * T for s in slot]
        for l, w in enumerate(self.layers):
            h = self._rmsnorm(x, w["ln1"])
            q = F.linear(h, w["wq"], w["bq"]).view(nt, c.n_heads, c.head_dim)
            k = F.linear(h, w["wk"], w["bk"]).view(nt, *kv_shape)
            v = F.linear(h, w["wv"], w["bv"]).view(nt, *kv_shape)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            att = torch.zeros(nt, c.n_heads * c.head_dim, dtype=self.dtype, device=self.device)
            for i, cache in enumerate(caches):  # attention per sequence, exactly as layer_forward's one tile
                s, t0 = slot[i], tile_of[i]
                kh, vh = cache.write(l, k[s:s + 1], v[s:s + 1])
                att[s] = self._attend(q[t0:t0 + T], kh, vh)[rows[i]]
            x = x + F.linear(att, w["wo"], w["bo"])
            h = self._rmsnorm(x, w["ln2"])
            g = F.silu(F.linear(h, w["wg"], w["bg"])) * F.linear(h, w["wu"], w["bu"])
            x = x + F.linear(g, w["wd"], w["bd"])
        for cache in caches:
            cache.n += 1
        logits = F.linear(self._rmsnorm(x, self.norm_w), self.lm_head_w)
        return [int(torch.argmax(logits[s])) for s in slot]

    # -- conveniences built on the per-layer API -----------------------------------------------

    @_exact
    def prefill(self, tokens: Sequence[int] | torch.Tensor, past_kv: Sequence[KV] | None = None,
                last_only: bool = False) -> PrefillResult:
        """Run the new `tokens` after `past_kv` (per layer (K, V) of the prefix, or None).

        Returns the logits of every new token (or of the last one with `last_only`) and the new
        tokens' KV per layer.
        """
        tokens = self._tokens(tokens)
        n, P = tokens.shape[0], (past_kv[0][0].shape[0] if past_kv else 0)
        if past_kv is not None and len(past_kv) not in (0, self.config.n_layer):
            raise ValueError(f"past_kv has {len(past_kv)} layers, the model {self.config.n_layer}")
        x = self.embed(tokens)
        new_kv = []
        for l in range(self.config.n_layer):
            pk, pv = past_kv[l] if past_kv else (None, None)
            x, k, v = self.layer_forward(l, x, P, pk, pv)
            new_kv.append((k, v))
        if last_only and n:
            return PrefillResult(self.logits(x[-1:], P + n - 1), new_kv, P)
        return PrefillResult(self.logits(x, P), new_kv, P)

    @_exact
    def generate(self, tokens: Sequence[int] | torch.Tensor, max_new_tokens: int,
                 past_kv: Sequence[KV] | None = None, eos_token_id: int | Sequence[int] | None = None
                 ) -> GenerateResult:
        """Greedy decoding: prefill `tokens` after `past_kv`, then one token at a time.

        Stops after `max_new_tokens` or right after emitting an id in `eos_token_id`.
        """
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        res = self.prefill(tokens, past_kv, last_only=True)
        kv = concat_kv(past_kv, res.new_kv)
        out = [int(res.logits[-1].argmax())]
        if len(out) == max_new_tokens or out[-1] in eos:
            return GenerateResult(out, kv)
        # one token at a time on a DecodeCache: decode_step is bit-identical to a one-token
        # prefill, without concatenating the whole past per token (a third of a step's CPU here)
        cache = DecodeCache(self, kv)
        while len(out) < max_new_tokens and out[-1] not in eos:
            out += self.decode_step([out[-1]], [cache])
        return GenerateResult(out, [(k.contiguous(), v.contiguous()) for k, v in cache.kv()])

    # -- internals --------------------------------------------------------------------------------

    def _tokens(self, tokens) -> torch.Tensor:
        t = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        return t

    def _check_past(self, past_k, past_v) -> int:
        if past_k is None and past_v is None:
            return 0
        if past_k is None or past_v is None:
            raise ValueError("give both past_k and past_v, or neither")
        want = (self.config.n_kv_heads, self.config.head_dim)
        for name, t in (("past_k", past_k), ("past_v", past_v)):
            if t.dim() != 3 or tuple(t.shape[1:]) != want:
                raise ValueError(f"{name} must be [n_tokens, {want[0]}, {want[1]}], got {tuple(t.shape)}")
        if past_k.shape[0] != past_v.shape[0]:
            raise ValueError(f"past_k has {past_k.shape[0]} tokens, past_v {past_v.shape[0]}")
        return past_k.shape[0]

    @staticmethod
    def _check_positions(positions, n: int, past: int | None) -> int:
        """Positions must be contiguous; with `past` given they must start right after it."""
        if positions is None:
            if past is None:
                raise ValueError("positions are required")
            return past
        if isinstance(positions, int):
            start = positions
        else:
            pos = torch.as_tensor(positions).reshape(-1).cpu()
            if pos.numel() != n:
                raise ValueError(f"{pos.numel()} positions for {n} tokens")
            start = int(pos[0]) if n else (past or 0)
            if n and not torch.equal(pos, torch.arange(start, start + n, dtype=pos.dtype)):
                raise ValueError("positions must be contiguous and increasing")
        if past is not None and start != past:
            raise ValueError(f"new tokens must start at position {past} (the past KV length), got {start}")
        if start < 0:
            raise ValueError("positions must be >= 0")
        return start

    def _ensure_rope(self, n_pos: int) -> None:
        have = self._cos.shape[0]
        if n_pos <= have:
            return
        cos, sin = [self._cos], [self._sin]
        for s in range(have, n_pos, _ROPE_CHUNK):  # fixed-shape chunks aligned to 0: same values every time
            pos = torch.arange(s, s + _ROPE_CHUNK, device=self.device).float()
            freqs = pos[:, None] * self._inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos.append(emb.cos().to(self.dtype))
            sin.append(emb.sin().to(self.dtype))
        self._cos, self._sin = torch.cat(cos), torch.cat(sin)

    def _rmsnorm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return w * x32.to(x.dtype)

    def _attend(self, q: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
        """One query tile q [T, n_heads, D] against keys kh [n_kv_heads, D, L] and values
        vh [n_kv_heads, L, D] (both contiguous), L = (t+1)*T.

        Query head h uses KV head h // n_rep (transformers' repeat_kv order). Keys before the
        tile are all visible; inside the tile the causal mask applies.
        """
        c, T = self.config, q.shape[0]
        L, g = kh.shape[2], c.n_rep
        qh = q.view(T, c.n_kv_heads, g, c.head_dim).permute(1, 2, 0, 3).reshape(c.n_kv_heads, g * T, c.head_dim)
        s = (torch.bmm(qh, kh) * self.scale).view(c.n_kv_heads, g, T, L)
        s[..., L - T:].masked_fill_(self._tile_mask, float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype).view(c.n_kv_heads, g * T, L)
        o = torch.bmm(p, vh)  # [Hkv, g*T, D]
        return o.view(c.n_kv_heads, g, T, c.head_dim).permute(2, 0, 1, 3).reshape(T, c.n_heads * c.head_dim)


class DecodeCache:
    """One sequence's KV while it decodes, kept in the layout attention multiplies.

    Per layer, keys [n_kv_heads, head_dim, L] and values [n_kv_heads, L, head_dim], contiguous,
    L the end of the tile the next token falls in, zero past the tokens written: exactly the
    buffers `layer_forward` builds for a one-token call, so attention on them gives the same
    bits. They grow one tile at a time (a copy every `tile` tokens) instead of being rebuilt from
    token-major KV on every step.
    """

    def __init__(self, model: Transformer, kv: Sequence[KV]):
        self.model = model
        self.n = kv[0][0].shape[0] if kv else 0
        self.kh: list[torch.Tensor] = []
        self.vh: list[torch.Tensor] = []
        length = self._length(self.n)
        for k, v in kv:
            kh, vh = self._empty(length)
            kh[:, :, :self.n] = k.permute(1, 2, 0)
            vh[:, :self.n] = v.permute(1, 0, 2)
            self.kh.append(kh)
            self.vh.append(vh)
        if not kv:
            for _ in range(model.config.n_layer):
                kh, vh = self._empty(length)
                self.kh.append(kh)
                self.vh.append(vh)

    def _length(self, n: int) -> int:
        T = self.model.tile
        return (n // T + 1) * T  # the tile of position n, which the next token takes

    def _empty(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        c, m = self.model.config, self.model
        return (torch.zeros(c.n_kv_heads, c.head_dim, length, dtype=m.dtype, device=m.device),
                torch.zeros(c.n_kv_heads, length, c.head_dim, dtype=m.dtype, device=m.device))

    def make_room(self) -> None:
        """Buffers long enough for position n (a new tile: one copy into larger zeros)."""
        length = self._length(self.n)
        if self.kh[0].shape[2] == length:
            return
        for l in range(len(self.kh)):
            kh, vh = self._empty(length)
            kh[:, :, :self.n] = self.kh[l][:, :, :self.n]
            vh[:, :self.n] = self.vh[l][:, :self.n]
            self.kh[l], self.vh[l] = kh, vh

    def write(self, l: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put the new token's K, V ([1, n_kv_heads, head_dim]) of layer l at position n."""
        p = self.n
        self.kh[l][:, :, p:p + 1] = k.permute(1, 2, 0)
        self.vh[l][:, p:p + 1] = v.permute(1, 0, 2)
        return self.kh[l], self.vh[l]

    def kv(self) -> list[KV]:
        """Token-major (K, V) views per layer of the n tokens so far ([n, n_kv_heads, head_dim])."""
        return [(kh[:, :, :self.n].permute(2, 0, 1), vh[:, :self.n].permute(1, 0, 2))
                for kh, vh in zip(self.kh, self.vh)]
