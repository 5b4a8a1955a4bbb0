"""KV layouts: Full Blocks (the storage unit) and Layer Blocks (the GPU transfer unit).

A **Full Block** holds the KV of `block_size` consecutive tokens for every layer, as bytes of shape

    [n_layer, block_size, bytes_per_token_per_layer]

A **Layer Block** is one layer of it, `full[l]`: a zero-copy view of shape
`[block_size, bytes_per_token_per_layer]`, i.e. the byte range
`[l * layer_block_bytes, (l + 1) * layer_block_bytes)` of the Full Block. So n_layer Layer Blocks
laid end to end *are* the Full Block, byte for byte, with no reshuffle: storage moves Full Blocks,
GPUs move Layer Blocks, and a DRAM buffer that holds a Full Block hands out Layer Blocks by offset.

Inside a Layer Block each token has one row of `bytes_per_token_per_layer` bytes: its K
(`n_kv_heads * head_dim` elements, heads major) followed by its V (same size), in the model's
dtype, native byte order. This is the model's KV convention (K, V each
`[n_tokens, n_kv_heads, head_dim]`, see dualpath/model/transformer.py) flattened per token, so
packing is one copy and unpacking is a view.

Block size. DEFAULT_BLOCK_SIZE = 16 tokens. The paper uses 64-token blocks with prompts of tens of
thousands of tokens. Our trajectories are scaled down (appends of a few hundred tokens), and the
partial tail block of every turn is recomputed as miss tokens next turn, so a smaller block keeps
the hit rate of scaled-down workloads near the paper's (>= 90 %) while a Full Block of the tiny
model stays a sensible I/O unit (16 tokens * 4 layers * 512 B = 32 KiB). It is a parameter
everywhere, so a topology can choose 64.

Every function here works on torch uint8 tensors (CPU or GPU) and accepts any writable buffer
(bytearray, memoryview, numpy array) where a view over existing memory is wanted.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dualpath.model.config import ModelConfig, dtype_size, parse_dtype

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class BlockGeometry:
    n_layer: int
    block_size: int  # tokens per block
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the KV dtype

    def __post_init__(self):
        for name in ("n_layer", "block_size", "n_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"BlockGeometry.{name} must be a positive int, got {v!r}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))

    @classmethod
    def from_config(cls, config: ModelConfig, dtype: str | torch.dtype | None = None,
                    block_size: int = DEFAULT_BLOCK_SIZE) -> "BlockGeometry":
        """Geometry of a model's KV blocks; `dtype` defaults to the checkpoint's dtype."""
        return cls(config.n_layer, block_size, config.n_kv_heads, config.head_dim,
                   parse_dtype(dtype if dtype is not None else config.dtype))

    @property
    def elem_size(self) -> int:
        return dtype_size(self.dtype)

    @property
    def kv_elems_per_token(self) -> int:
        """Elements of K (or of V) per token per layer."""
        return self.n_kv_heads * self.head_dim

    @property
    def bytes_per_token_per_layer(self) -> int:
        """2 (K and V) * n_kv_heads * head_dim * dtype size."""
        return 2 * self.kv_elems_per_token * self.elem_size

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all layers: the one place this is computed."""
        return self.bytes_per_token_per_layer * self.n_layer

    @property
    def layer_block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token_per_layer

    @property
    def full_block_bytes(self) -> int:
        return self.n_layer * self.layer_block_bytes

    @property
    def full_block_shape(self) -> tuple[int, int, int]:
        return (self.n_layer, self.block_size, self.bytes_per_token_per_layer)

    @property
    def layer_block_shape(self) -> tuple[int, int]:
        return (self.block_size, self.bytes_per_token_per_layer)

    def layer_block_offset(self, l: int) -> int:
        """Byte offset of Layer Block l inside its Full Block (for transfer descriptors)."""
        if not 0 <= l < self.n_layer:
            raise IndexError(f"layer {l} out of range [0, {self.n_layer})")
        return l * self.layer_block_bytes

    def n_blocks(self, n_tokens: int) -> int:
        """Complete blocks in n_tokens (a partial tail block is not stored)."""
        return n_tokens // self.block_size

    def blocks_spanned(self, n_tokens: int) -> int:
        """Blocks that n_tokens occupy, the partial tail block included."""
        return -(-n_tokens // self.block_size)


def _as_bytes(buf) -> torch.Tensor:
    """A flat uint8 tensor sharing memory with `buf` (tensor, numpy array, bytearray, memoryview)."""
    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ValueError("buffer tensor must be contiguous")
        return buf.reshape(-1).view(torch.uint8) if buf.dtype != torch.uint8 else buf.reshape(-1)
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("buffer array must be C-contiguous")
        return torch.from_numpy(buf.reshape(-1).view(np.uint8))
    mv = memoryview(buf)
    if mv.readonly:
        raise ValueError("buffer is read-only; a block view needs writable memory")
    return torch.frombuffer(mv.cast("B"), dtype=torch.uint8)


def full_block_view(buf, geom: BlockGeometry, offset: int = 0) -> torch.Tensor:
    """View `geom.full_block_bytes` bytes of `buf` starting at byte `offset` as a Full Block.

    Zero-copy: writes through the view land in `buf`.
    """
    flat = _as_bytes(buf)
    end = offset + geom.full_block_bytes
    if offset < 0 or end > flat.numel():
        raise ValueError(f"Full Block [{offset}, {end}) does not fit a buffer of {flat.numel()} bytes")
    return flat[offset:end].view(geom.full_block_shape)


def empty_full_block(geom: BlockGeometry, device: str | torch.device = "cpu") -> torch.Tensor:
    """A new, zeroed Full Block [n_layer, block_size, bytes_per_token_per_layer] of uint8."""
    return torch.zeros(geom.full_block_shape, dtype=torch.uint8, device=device)


def layer_block(full: torch.Tensor, l: int) -> torch.Tensor:
    """Layer Block l of a Full Block: `full[l]`, a zero-copy view [block_size, bytes_per_token_per_layer]."""
    if full.dim() != 3 or full.dtype != torch.uint8:
        raise ValueError(f"expected a uint8 Full Block [n_layer, block_size, bytes], got {full.dtype} {tuple(full.shape)}")
    if not 0 <= l < full.shape[0]:
        raise IndexError(f"layer {l} out of range [0, {full.shape[0]})")
    return full[l]


def layer_blocks(full: torch.Tensor) -> list[torch.Tensor]:
    """All Layer Blocks of a Full Block, in layer order (views)."""
    return [layer_block(full, l) for l in range(full.shape[0])]


def concat_layer_blocks(blocks: list[torch.Tensor]) -> torch.Tensor:
    """n_layer Layer Blocks -> a new Full Block (plain concatenation, no reordering)."""
    return torch.stack(blocks)


def _check_kv(k: torch.Tensor, v: torch.Tensor, geom: BlockGeometry) -> None:
    want = (geom.n_kv_heads, geom.head_dim)
    for name, t in (("K", k), ("V", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != want:
            raise ValueError(f"{name} must be [n_tokens, {want[0]}, {want[1]}], got {tuple(t.shape)}")
        if t.dtype != geom.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, the layout {geom.dtype}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"K has {k.shape[0]} tokens, V {v.shape[0]}")
    if k.shape[0] > geom.block_size:
        raise ValueError(f"{k.shape[0]} tokens do not fit a block of {geom.block_size}")


def pack_layer(k: torch.Tensor, v: torch.Tensor, geom: BlockGeometry, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Write one layer's K, V ([n, n_kv_heads, head_dim], n <= block_size) as Layer Block bytes.

    Token i's row is K[i] then V[i], raw bytes. With `out` (a Layer Block, e.g. `layer_block(full, l)`)
    the rows are written in place into its first n rows and `out` is returned; otherwise a new
    [n, bytes_per_token_per_layer] uint8 tensor is returned.
    """
    _check_kv(k, v, geom)
    n = k.shape[0]
    if out is None:
        out = torch.empty((n, geom.bytes_per_token_per_layer), dtype=torch.uint8, device=k.device)
        rows = out
    else:
        if out.dtype != torch.uint8 or out.dim() != 2 or out.shape[1] != geom.bytes_per_token_per_layer \
                or out.shape[0] < n:
            raise ValueError(f"out must be uint8 [>={n}, {geom.bytes_per_token_per_layer}], got "
                             f"{out.dtype} {tuple(out.shape)}")
        rows = out[:n]
    kv = rows.view(geom.dtype).view(n, 2, geom.n_kv_heads, geom.head_dim)  # a view of the bytes
    kv[:, 0] = k
    kv[:, 1] = v
    return out


def pack_rows(k: torch.Tensor, v: torch.Tensor, geom: BlockGeometry, rows: torch.Tensor) -> torch.Tensor:
    """One layer's K, V of any number of tokens written into contiguous token rows `rows`
    ([n, bytes_per_token_per_layer] uint8): the engine-side ("HBM") layout of a layer."""
    n = k.shape[0]
    kv = rows.view(geom.dtype).view(n, 2, geom.n_kv_heads, geom.head_dim)
    kv[:, 0] = k
    kv[:, 1] = v
    return rows


def unpack_layer(lb: torch.Tensor, geom: BlockGeometry, n_tokens: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer Block bytes -> (K, V), each [n, n_kv_heads, head_dim] in geom.dtype.

    Zero-copy: K and V are views of `lb` (not contiguous: rows interleave K and V). `n_tokens`
    defaults to all rows.
    """
    if lb.dtype != torch.uint8 or lb.dim() != 2 or lb.shape[1] != geom.bytes_per_token_per_layer:
        raise ValueError(f"expected uint8 [n, {geom.bytes_per_token_per_layer}], got {lb.dtype} {tuple(lb.shape)}")
    n = lb.shape[0] if n_tokens is None else n_tokens
    if not 0 <= n <= lb.shape[0]:
        raise ValueError(f"n_tokens={n} outside [0, {lb.shape[0]}]")
    kv = lb[:n].view(geom.dtype).view(n, 2, geom.n_kv_heads, geom.head_dim)
    return kv[:, 0], kv[:, 1]


def build_full_block(kv_per_layer: list[tuple[torch.Tensor, torch.Tensor]], geom: BlockGeometry,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-layer (K, V) of exactly block_size tokens -> a Full Block (new, or written into `out`)."""
    if len(kv_per_layer) != geom.n_layer:
        raise ValueError(f"{len(kv_per_layer)} layers of KV for a {geom.n_layer}-layer block")
    if out is None:
        out = torch.empty(geom.full_block_shape, dtype=torch.uint8, device=kv_per_layer[0][0].device)
    elif tuple(out.shape) != geom.full_block_shape or out.dtype != torch.uint8:
        raise ValueError(f"out must be uint8 {geom.full_block_shape}, got {out.dtype} {tuple(out.shape)}")
    for l, (k, v) in enumerate(kv_per_layer):
        if k.shape[0] != geom.block_size:
            raise ValueError(f"layer {l}: a Full Block needs {geom.block_size} tokens, got {k.shape[0]}")
        pack_layer(k, v, geom, out=out[l])
    return out


def split_full_block(full: torch.Tensor, geom: BlockGeometry) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A Full Block -> per-layer (K, V) views, each [block_size, n_kv_heads, head_dim]."""
    if tuple(full.shape) != geom.full_block_shape:
        raise ValueError(f"expected a Full Block {geom.full_block_shape}, got {tuple(full.shape)}")
    return [unpack_layer(full[l], geom) for l in range(geom.n_layer)]


def full_blocks_from_kv(kv_per_layer: list[tuple[torch.Tensor, torch.Tensor]], geom: BlockGeometry
                        ) -> list[torch.Tensor]:
    """A sequence's per-layer KV ([n_tokens, ...]) -> its complete Full Blocks, in token order.

    The partial tail (n_tokens % block_size tokens) is left out: it is recomputed next turn.
    """
    n = kv_per_layer[0][0].shape[0]
    bs = geom.block_size
    return [build_full_block([(k[b * bs:(b + 1) * bs], v[b * bs:(b + 1) * bs]) for k, v in kv_per_layer], geom)
            for b in range(n // bs)]


def kv_from_full_blocks(blocks: list[torch.Tensor], geom: BlockGeometry) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Full Blocks in token order -> per-layer contiguous (K, V) of all their tokens (copies)."""
    if not blocks:
        empty = torch.empty((0, geom.n_kv_heads, geom.head_dim), dtype=geom.dtype)
        return [(empty, empty.clone()) for _ in range(geom.n_layer)]
    per_block = [split_full_block(b, geom) for b in blocks]
    return [(torch.cat([pb[l][0] for pb in per_block]), torch.cat([pb[l][1] for pb in per_block]))
            for l in range(geom.n_layer)]
