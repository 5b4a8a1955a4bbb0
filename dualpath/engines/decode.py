"""Decode engine (DE): H2D of the whole prompt KV, greedy decode, write-back of full blocks."""
from __future__ import annotations

import hashlib
import zlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dualpath.buffers import ByteAllocator
from dualpath.kv_spans import Span, token_rows_descs
from dualpath.layouts import BlockGeometry, build_full_block, unpack_layer
from dualpath.model import Transformer


@dataclass
class DecodeOutcome:
    tokens: list[int]
    written_blocks: list[int]  # block indices written back, in order (at wb.offset + j * full block)
    block_crcs: list[int] = field(default_factory=list)  # CRC32 of each written-back block
    reread_bytes: int = 0  # rows read again because the PE's WRITE had not landed yet
    layer_hashes: list[str] = field(default_factory=list)
    read_bytes: int = 0
    written_bytes: int = 0
    total_s: float = 0.0


def decode(request: str, model: Transformer, agent, hbm: np.ndarray, alloc: ByteAllocator, geom: BlockGeometry,
           n_prompt: int, first_token: int, gen_len: int, src: Span | None, wb: Span | None,
           first_new_block: int, expect_crcs: list[int] | None = None, timeout_s: float = 60.0) -> DecodeOutcome:
    """Load the prompt's KV from the DE buffer, decode gen_len tokens, write back full blocks.

    `first_token` came from prefill. Every Full Block from `first_new_block` on is
    written (D2H) to `wb` as soon as it fills; the host agent persists them.
    `src is None` is the oracle: nothing moves and the prompt KV is zeros.
    `expect_crcs[l]` is the CRC32 of layer l's rows, as the PE read and wrote them: a layer
    that does not match yet is read again until it does (bounded by timeout_s).
    """
    t0 = time.perf_counter()
    out = DecodeOutcome(tokens=[first_token], written_blocks=[])
    bpt, L = geom.bytes_per_token_per_layer, geom.n_layer
    layer_bytes = n_prompt * bpt
    off = alloc.alloc(layer_bytes * L)
    try:
        if src is not None:
            descs = np.concatenate([token_rows_descs(geom, l, 0, n_prompt, off + l * layer_bytes, src.offset)
                                    for l in range(L)])
            agent.post("READ", src.peer, "hbm", src.region, descs, layer="all").wait(timeout_s)
            out.read_bytes = int(descs[:, 2].sum())
            if expect_crcs is not None:
                _until_landed(agent, hbm, geom, src, off, n_prompt, expect_crcs, out, timeout_s)
        kv = []
        for l in range(L):
            rows = torch.from_numpy(hbm[off + l * layer_bytes: off + (l + 1) * layer_bytes]).view(n_prompt, bpt)
            if src is not None:
                out.layer_hashes.append(hashlib.blake2b(rows.numpy().tobytes(), digest_size=16).hexdigest())
                k, v = unpack_layer(rows, geom)
                kv.append((k.contiguous(), v.contiguous()))
            else:
                z = torch.zeros((n_prompt, geom.n_kv_heads, geom.head_dim), dtype=geom.dtype)
                kv.append((z, z.clone()))
    finally:
        alloc.free(off)
    writes: list = []
    n_wb = (n_prompt + gen_len - 1) // geom.block_size - first_new_block
    # One staging slot per block written back: a slot is never refilled while its WRITE may
    # still be reading it.
    wb_off = alloc.alloc(max(n_wb, 1) * geom.full_block_bytes) if wb is not None else None
    try:
        n_kv = n_prompt
        next_block = first_new_block
        _write_full(request, agent, geom, kv, n_kv, next_block, wb, wb_off, hbm, out, writes)
        next_block = max(next_block, n_kv // geom.block_size)
        tok = first_token
        for _ in range(gen_len - 1):
            res = model.prefill([tok], past_kv=kv, last_only=True)
            kv = [(torch.cat([k, nk]), torch.cat([v, nv])) for (k, v), (nk, nv) in zip(kv, res.new_kv)]
            n_kv += 1
            tok = int(torch.argmax(res.logits[-1]))
            out.tokens.append(tok)
            if n_kv % geom.block_size == 0:  # a Full Block just filled: write it back now
                _write_full(request, agent, geom, kv, n_kv, next_block, wb, wb_off, hbm, out, writes)
                next_block = n_kv // geom.block_size
        for x in writes:
            x.wait(timeout_s)
    finally:
        if wb_off is not None:
            alloc.free(wb_off)
    out.total_s = time.perf_counter() - t0
    return out


def _write_full(request: str, agent, geom: BlockGeometry, kv, n_kv: int, first_block: int,
                wb: Span | None, wb_off: int | None, hbm: np.ndarray, out: DecodeOutcome, writes: list) -> None:
    """WRITE every complete, not yet written block in [first_block, n_kv // block_size) to the
    DE buffer (D2H through the CNIC) as soon as it is full."""
    if wb is None:
        return
    bs, fb = geom.block_size, geom.full_block_bytes
    for b in range(first_block, n_kv // bs):
        j = len(out.written_blocks)
        slot = wb_off + j * fb
        staging = torch.from_numpy(hbm[slot: slot + fb]).view(geom.full_block_shape)
        build_full_block([(k[b * bs:(b + 1) * bs], v[b * bs:(b + 1) * bs]) for k, v in kv], geom, out=staging)
        writes.append(agent.post("WRITE", wb.peer, "hbm", wb.region, [(slot, wb.offset + j * fb, fb)],
                                 layer=f"wb{b}", notif=f"{request}/wb{b}"))  # the host agent waits for it
        out.written_blocks.append(b)
        out.block_crcs.append(zlib.crc32(staging.numpy()))
        out.written_bytes += fb


def _until_landed(agent, hbm: np.ndarray, geom: BlockGeometry, src: Span, off: int, n_prompt: int,
                  expect: list[int], out: DecodeOutcome, timeout_s: float) -> None:
    """Re-read the rows the PE wrote until their CRC matches what it sent.

    Over UCX's TCP transport a WRITE's completion (and even its notification)
    can reach the target before all of its bytes are applied there: measured
    here as stale 4 KiB pieces. A READ's completion is definitive, so the
    reader checks and, for the few layers that are late, reads again.
    """
    bpt = geom.bytes_per_token_per_layer
    layer_bytes = n_prompt * bpt
    deadline = time.monotonic() + timeout_s
    while True:
        late = [l for l in range(geom.n_layer)
                if zlib.crc32(hbm[off + l * layer_bytes: off + (l + 1) * layer_bytes]) != expect[l]]
        if not late:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"KV from the PE never landed intact in {src.peer} (layers {late}); "
                               f"the data plane lost or corrupted bytes")
        time.sleep(0.002)
        descs = np.concatenate([token_rows_descs(geom, l, 0, n_prompt, off + l * layer_bytes,
                                                 src.offset) for l in late])
        agent.post("READ", src.peer, "hbm", src.region, descs, layer="reread").wait(timeout_s)
        out.reread_bytes += int(descs[:, 2].sum())
