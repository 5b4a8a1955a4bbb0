"""The decode engine's side of the KV read path: the same narrow interface as prefill's.

A decode engine never knows where a request's KV came from. It asks its connector to load the
prompt's KV into HBM, polls until it has landed, saves every Full Block it completes toward
the write-back area of the DE buffer, and polls until those saves are done. Polling, not
waiting, because one engine decodes a whole batch: a request whose KV is still loading must not
hold up the ones that are decoding.

- BufferDecodeConnector: the prompt's KV sits in the DE buffer (the PE wrote it there, or the
  DE read path put its hits there); one READ of every layer brings it into HBM, and a layer
  whose CRC is not yet what the PE sent is read again (see `stale_layers`).
- OracleDecodeConnector: nothing moves; the prompt's KV is zeros already "in HBM".
"""
from __future__ import annotations

import hashlib
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch

from dualpath.kv.buffers import ByteAllocator
from dualpath.kv.check import REREAD_AFTER_S, REREAD_MAX_GAP_S, crc, stale
from dualpath.kv.spans import Span, token_rows_descs
from dualpath.kv.layouts import BlockGeometry, build_full_block, unpack_layer
from dualpath.model.device import to_device
from dualpath.timeouts import scaled

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class DecodePlan:
    """One request's decode: where its prompt KV is and where its new Full Blocks go."""

    request: str
    n_prompt: int
    gen_len: int
    first_new_block: int  # blocks before this one are already stored
    src: Span | None  # the prompt's KV, Full-Block layout (None: oracle)
    wb: Span | None  # write-back area: block j of this request's new blocks at offset + j * full block
    expect_crcs: tuple[int, ...] | None = None  # per layer, of the prompt rows as the PE wrote them


@dataclass
class DecodeStats:
    read_bytes: int = 0
    reread_bytes: int = 0  # prompt rows read again because the PE's WRITE had not landed yet
    written_bytes: int = 0
    layer_hashes: list[str] = field(default_factory=list)  # of the prompt KV each layer loaded
    written_blocks: list[int] = field(default_factory=list)  # block indices, in write order
    block_crcs: list[int] = field(default_factory=list)  # CRC-32C of each written block


class DecodeConnector(ABC):
    def __init__(self, agent, hbm: np.ndarray, alloc: ByteAllocator, geom: BlockGeometry,
                 timeout_s: float = scaled(60.0), device: str | torch.device = "cpu"):
        self.agent, self.hbm, self.alloc, self.geom = agent, hbm, alloc, geom
        self.device = torch.device(device)  # where the decode batch's KV lives (the prompt goes there)
        self.timeout_s = timeout_s
        self.stats = DecodeStats()

    @abstractmethod
    def start_load(self, plan: DecodePlan) -> None:
        """Start bringing the prompt's KV into HBM, asynchronously."""

    @abstractmethod
    def poll_load(self) -> list[KV] | None:
        """The prompt's KV per layer once it is in HBM and intact, else None (never blocks)."""

    @abstractmethod
    def save_block(self, block: int, kv: list[KV]) -> None:
        """Start shipping Full Block `block` (tokens [block*bs, (block+1)*bs) of `kv`) toward
        the DE buffer's write-back area, where the host agent persists it."""

    @abstractmethod
    def poll_save(self) -> bool:
        """True once every saved block has left HBM."""

    def close(self) -> None:
        """Free whatever the request still holds in HBM."""


class BufferDecodeConnector(DecodeConnector):
    def start_load(self, plan: DecodePlan) -> None:
        if plan.src is None:
            raise ValueError(f"request {plan.request}: the buffer connector needs the prompt's span")
        g = self.geom
        self.plan = plan
        self._layer_bytes = plan.n_prompt * g.bytes_per_token_per_layer
        self._deadline = time.monotonic() + self.timeout_s
        self._off = self.alloc.alloc(self._layer_bytes * g.n_layer)
        self._reread_at = 0.0
        self._reread_gap = REREAD_AFTER_S
        n_wb = max(0, (plan.n_prompt + plan.gen_len - 1) // g.block_size - plan.first_new_block)
        # One staging slot per block written back: a slot is never refilled while its WRITE
        # may still be reading it.
        self._wb_off = self.alloc.alloc(max(n_wb, 1) * g.full_block_bytes) if plan.wb is not None else None
        self._writes: list = []
        self._xfer = self._read(range(g.n_layer))

    def _read(self, layers) -> object:
        descs = np.concatenate([token_rows_descs(self.geom, l, 0, self.plan.n_prompt,
                                                 self._off + l * self._layer_bytes, self.plan.src.offset)
                                for l in layers])
        self.stats.read_bytes += int(descs[:, 2].sum())
        return self.agent.post("READ", self.plan.src.peer, "hbm", self.plan.src.region, descs, layer="prompt")

    def poll_load(self) -> list[KV] | None:
        if self._xfer is None:
            raise RuntimeError(f"request {self.plan.request}: its KV was already loaded")
        if not self._xfer.poll():
            if time.monotonic() > self._deadline:
                raise TimeoutError(f"request {self.plan.request}: its prompt KV did not arrive from "
                                   f"{self.plan.src.peer} within {self.timeout_s:g} s")
            return None
        p = self.plan
        if p.expect_crcs is not None:
            lb = self._layer_bytes
            late = stale(self.hbm, [(self._off + l * lb, lb, crc) for l, crc in enumerate(p.expect_crcs)])
            if late:
                now = time.monotonic()
                if now > self._deadline:
                    raise TimeoutError(f"KV from the PE never landed intact in {p.src.peer} (layers {late}); "
                                       f"the data plane lost or corrupted bytes")
                if now < self._reread_at:
                    return None
                before = self.stats.read_bytes
                self._xfer = self._read(late)
                self.stats.reread_bytes += self.stats.read_bytes - before
                self.stats.read_bytes = before
                self._reread_at = now + self._reread_gap
                self._reread_gap = min(2 * self._reread_gap, REREAD_MAX_GAP_S)
                return None
        g, bpt = self.geom, self.geom.bytes_per_token_per_layer
        kv = []
        for l in range(g.n_layer):
            a = self._off + l * self._layer_bytes
            rows = torch.from_numpy(self.hbm[a:a + self._layer_bytes]).view(p.n_prompt, bpt)
            self.stats.layer_hashes.append(hashlib.blake2b(rows.numpy().tobytes(), digest_size=16).hexdigest())
            k, v = to_device(unpack_layer(rows, g), self.device)
            kv.append((k.contiguous(), v.contiguous()))
        self.alloc.free(self._off)  # the KV now lives in the decode batch's tensors
        self._off = None
        self._xfer = None
        return kv

    def save_block(self, block: int, kv: list[KV]) -> None:
        p, g = self.plan, self.geom
        if p.wb is None:
            return
        bs, fb = g.block_size, g.full_block_bytes
        j = len(self.stats.written_blocks)
        slot = self._wb_off + j * fb
        staging = torch.from_numpy(self.hbm[slot: slot + fb]).view(g.full_block_shape)
        build_full_block([(k[block * bs:(block + 1) * bs], v[block * bs:(block + 1) * bs]) for k, v in kv], g,
                         out=staging)
        # the host agent waits for this notification before it persists the block
        self._writes.append(self.agent.post("WRITE", p.wb.peer, "hbm", p.wb.region,
                                            [(slot, p.wb.offset + j * fb, fb)], layer=f"wb{block}",
                                            notif=f"{p.request}/wb{block}"))
        self.stats.written_blocks.append(block)
        self.stats.block_crcs.append(crc(staging.numpy()))
        self.stats.written_bytes += fb

    def poll_save(self) -> bool:
        self._writes = [x for x in self._writes if not x.poll()]
        if self._writes and time.monotonic() > self._deadline + self.timeout_s:
            raise TimeoutError(f"request {self.plan.request}: its write-back to {self.plan.wb.peer} did not complete")
        return not self._writes

    def close(self) -> None:
        for off in (getattr(self, "_off", None), getattr(self, "_wb_off", None)):
            if off is not None:
                self.alloc.free(off)
        self._off = self._wb_off = None


class OracleDecodeConnector(DecodeConnector):
    """All I/O skipped: the prompt's KV is zeros already 'in HBM'; nothing is written back."""

    def start_load(self, plan: DecodePlan) -> None:
        self.plan = plan

    def poll_load(self) -> list[KV] | None:
        g = self.geom
        z = torch.zeros((self.plan.n_prompt, g.n_kv_heads, g.head_dim), dtype=g.dtype, device=self.device)
        return [(z, z.clone()) for _ in range(g.n_layer)]

    def save_block(self, block: int, kv: list[KV]) -> None:
        pass

    def poll_save(self) -> bool:
        return True
