"""The one narrow interface between a prefill engine and the KV read path.

The engine calls four methods, the split vLLM's v1 KV connector uses:
start_load, wait_for_layer, save_layer, wait_for_save. It never knows which
path feeds it. The implementations:

- LayerwiseConnector: per layer, READ the past KV, compute, WRITE the new KV
  (and the past rows the DE lacks) to the DE buffer. The plan's reads make it
  the PE read path (past in the PE buffer, all of it forwarded), the DE read
  path (past in the DE buffer, only the new KV goes back), a split of the two,
  or a later chunk of a chunked prefill (past in the DE buffer).
- BasicConnector: the PE path with every layer loaded up front (not layerwise).
- OracleConnector: nothing moves (all I/O skipped; the past KV is zeros).

Each connector keeps "HBM" honest: past KV occupies the engine's registered
memory only between its load and its last use, and the peak is reported. On a GPU
(`device` cuda) that memory is the page-locked host staging of the engine's HBM: a
layer's past goes H2D when the layer asks for it, and its new KV comes back D2H into
the rows its WRITE sends (dualpath/model/device.py).
"""
from __future__ import annotations

import hashlib
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch

from dualpath.kv.buffers import ByteAllocator
from dualpath.kv.check import crc as kv_crc
from dualpath.kv.check import REREAD_AFTER_S, REREAD_MAX_GAP_S, stale
from dualpath.kv.spans import Span, token_rows_descs
from dualpath.kv.layouts import BlockGeometry, pack_rows, unpack_layer
from dualpath.model.device import to_device
from dualpath.timeouts import scaled

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class PastRead:
    """Past KV rows [first, first + n) sit in `span`, a request area in Full-Block layout."""

    span: Span
    first: int
    n: int

    @classmethod
    def from_msg(cls, d: dict) -> "PastRead":
        return cls(Span.from_msg(d["span"]), int(d["first"]), int(d["n"]))

    def to_msg(self) -> dict:
        return {"span": self.span.to_msg(), "first": self.first, "n": self.n}


@dataclass(frozen=True)
class LoadPlan:
    """One prefill pass of a request: n_past tokens of past KV, n_new tokens to compute.

    The past is the stored hits, plus, for a later chunk of a chunked prefill, the
    tokens earlier passes computed. `reads` say where each part of it is: the PE
    buffer, the DE buffer, or both (split). The PE also WRITEs past rows
    [0, forward_past) to `dst`: those it read on its own side, which the DE lacks.
    """

    request: str
    n_past: int
    n_new: int
    reads: tuple[PastRead, ...]
    dst: Span | None  # the request's area in the DE buffer
    forward_past: int = 0
    # CRC-32C per layer of past rows [0, n_past) as an earlier pass wrote them: a layer that
    # does not match (a WRITE not fully applied yet) is read again, bounded by the timeout
    past_crcs: tuple[int, ...] | None = None
    tag: str = ""  # names this pass in its notifications: f"{request}{tag}/L{layer}"

    def __post_init__(self) -> None:
        covered = sorted((r.first, r.first + r.n) for r in self.reads if r.n)
        at = 0
        for a, b in covered:
            if a != at:
                break
            at = b
        if at != self.n_past or len(covered) != len([r for r in self.reads if r.n]):
            raise ValueError(f"request {self.request}: reads {covered} must tile past rows [0, {self.n_past})")
        if not 0 <= self.forward_past <= self.n_past:
            raise ValueError(f"request {self.request}: forward_past {self.forward_past} outside [0, {self.n_past}]")

    @property
    def notif_prefix(self) -> str:
        return f"{self.request}{self.tag}"


@dataclass
class ConnectorStats:
    read_bytes: int = 0
    written_bytes: int = 0
    read_wait_s: float = 0.0
    peak_hit_bytes: int = 0  # past KV resident in HBM at once (the hits, in a first pass)
    layer_hashes: list[str] = field(default_factory=list)  # of the past KV each layer loaded
    # CRC-32C per layer of rows [0, n_past + n_new) in token order, past and new: what the
    # DE buffer holds once this pass's WRITEs land; the next reader checks it
    write_crcs: list[int] = field(default_factory=list)
    reread_bytes: int = 0  # past rows read again because an earlier pass's WRITE was late


class KVConnector(ABC):
    def __init__(self, agent, hbm: np.ndarray, alloc: ByteAllocator, geom: BlockGeometry,
                 timeout_s: float = scaled(60.0), device: str | torch.device = "cpu"):
        self.agent, self.hbm, self.alloc, self.geom = agent, hbm, alloc, geom
        self.device = torch.device(device)  # where the model computes (the past goes there)
        self.timeout_s = timeout_s
        self.stats = ConnectorStats()
        self._past_resident = 0

    @abstractmethod
    def start_load(self, plan: LoadPlan) -> None:
        """Start fetching the past KV of every layer, asynchronously."""

    @abstractmethod
    def wait_for_layer(self, layer: int) -> KV | None:
        """Block until layer `layer`'s past KV is in HBM; return (K, V) views, or None if there is none."""

    @abstractmethod
    def save_layer(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Start shipping layer `layer`'s KV toward the DE buffer."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until everything is shipped; free what the request held in HBM."""

    # -- shared helpers ------------------------------------------------------------------------
    def _layer_bytes(self, n_tokens: int) -> int:
        return n_tokens * self.geom.bytes_per_token_per_layer

    def _alloc_past(self, nbytes: int) -> int:
        off = self.alloc.alloc(nbytes)
        self._past_resident += nbytes
        self.stats.peak_hit_bytes = max(self.stats.peak_hit_bytes, self._past_resident)
        return off

    def _free_past(self, off: int, nbytes: int) -> None:
        self.alloc.free(off)
        self._past_resident -= nbytes

    def _rows(self, off: int, n_tokens: int) -> torch.Tensor:
        bpt = self.geom.bytes_per_token_per_layer
        return torch.from_numpy(self.hbm[off:off + n_tokens * bpt]).view(n_tokens, bpt)

    def _view(self, off: int, n_tokens: int) -> KV:
        rows = self._rows(off, n_tokens)
        self.stats.layer_hashes.append(hashlib.blake2b(rows.numpy().tobytes(), digest_size=16).hexdigest())
        return to_device(unpack_layer(rows, self.geom), self.device)

    def _post_read(self, plan: LoadPlan, layer: int, off: int) -> list:
        """READ layer `layer` of the past into HBM at `off`: one descriptor list per source."""
        bpt = self.geom.bytes_per_token_per_layer
        xfers = []
        for r in plan.reads:
            if not r.n:
                continue
            descs = token_rows_descs(self.geom, layer, r.first, r.n, off + r.first * bpt, r.span.offset)
            self.stats.read_bytes += int(descs[:, 2].sum())
            xfers.append(self.agent.post("READ", r.span.peer, "hbm", r.span.region, descs, layer=layer))
        return xfers

    def _wait(self, xfers: list) -> None:
        t0 = time.perf_counter()
        for x in xfers:
            x.wait(self.timeout_s)
        self.stats.read_wait_s += time.perf_counter() - t0

    def _until_intact(self, plan: LoadPlan, layer: int, off: int) -> None:
        """Re-read a layer's past until its CRC is what the earlier pass wrote.

        Over UCX's TCP transport a WRITE's completion, and even its notification, can reach
        the target before all its bytes are applied there. A READ's completion is final, so
        the reader checks and reads again.
        """
        if plan.past_crcs is None:
            return
        deadline = time.monotonic() + self.timeout_s
        nbytes = self._layer_bytes(plan.n_past)
        gap = REREAD_AFTER_S
        while stale(self.hbm, [(off, nbytes, plan.past_crcs[layer])]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {plan.request}: layer {layer} of its past KV never landed intact "
                                   f"in the DE buffer; the data plane lost or corrupted bytes")
            time.sleep(gap)
            gap = min(2 * gap, REREAD_MAX_GAP_S)  # a layer that never matches must not flood the link
            before = self.stats.read_bytes
            self._wait(self._post_read(plan, layer, off))
            self.stats.reread_bytes += self.stats.read_bytes - before
            self.stats.read_bytes = before


class LayerwiseConnector(KVConnector):
    """Per layer: READ the past KV (prefetching the next layer), compute, hand the KV to the DE buffer."""

    def start_load(self, plan: LoadPlan) -> None:
        self.plan = plan
        self.slots: dict[int, tuple[int, list]] = {}  # layer -> (hbm offset, read transfers)
        # (hbm offset, write transfer, past bytes if it is a past slot): freed once the WRITE is done
        self.writes: list[tuple[int, object, int | None]] = []
        self.past_bytes = self._layer_bytes(plan.n_past)
        if plan.n_past:
            self._prefetch(0)

    def _prefetch(self, layer: int) -> None:
        if layer >= self.geom.n_layer or layer in self.slots or not self.plan.n_past:
            return
        off = self._alloc_past(self.past_bytes)
        self.slots[layer] = (off, self._post_read(self.plan, layer, off))

    def wait_for_layer(self, layer: int) -> KV | None:
        if not self.plan.n_past:
            return None
        self._prefetch(layer)
        off, xfers = self.slots[layer]
        self._wait(xfers)
        self._until_intact(self.plan, layer, off)
        # Earlier layers must have left HBM before the next one comes in: at most this layer
        # and the prefetched one are resident (the paper's "about one layer per batch").
        self._reap_writes(block=True)
        self._prefetch(layer + 1)  # overlaps this layer's compute
        return self._view(off, self.plan.n_past)

    def save_layer(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        p, g = self.plan, self.geom
        self._reap_writes()
        miss_off = self.alloc.alloc(self._layer_bytes(p.n_new))
        pack_rows(k_new, v_new, g, self._rows(miss_off, p.n_new))
        parts = [token_rows_descs(g, layer, p.n_past, p.n_new, miss_off, p.dst.offset)]
        slot = self.slots.pop(layer, None)
        crc = 0
        if slot is not None:
            crc = kv_crc(self._rows(slot[0], p.n_past).numpy())
            if p.forward_past:
                parts.insert(0, token_rows_descs(g, layer, 0, p.forward_past, slot[0], p.dst.offset))
        self.stats.write_crcs.append(kv_crc(self._rows(miss_off, p.n_new).numpy(), crc))
        descs = np.concatenate(parts)
        self.stats.written_bytes += int(descs[:, 2].sum())
        # One descriptor list per layer, one request. The notification lets the DE side know
        # the layer has landed (DONE here only means our buffer may be reused).
        xfer = self.agent.post("WRITE", p.dst.peer, "hbm", p.dst.region, descs, layer=layer,
                               notif=f"{p.notif_prefix}/L{layer}")
        self.writes.append((miss_off, xfer, None))
        if slot is not None:
            if p.forward_past:  # past rows leave from the slot: free it once the WRITE is done
                self.writes.append((slot[0], xfer, self.past_bytes))
            else:
                self._free_past(slot[0], self.past_bytes)

    def _reap_writes(self, block: bool = False) -> None:
        still = []
        for off, xfer, past_bytes in self.writes:
            if block:
                xfer.wait(self.timeout_s)
            if xfer.poll():
                if past_bytes is None:
                    self.alloc.free(off)
                else:
                    self._free_past(off, past_bytes)
            else:
                still.append((off, xfer, past_bytes))
        self.writes = still

    def wait_for_save(self) -> None:
        self._reap_writes(block=True)
        for off, xfers in self.slots.values():  # only if a layer was never saved (error paths)
            for x in xfers:
                x.wait(self.timeout_s)
            self._free_past(off, self.past_bytes)
        self.slots.clear()


class BasicConnector(LayerwiseConnector):
    """The PE path, not layerwise: every layer's past KV is in HBM before layer 0 runs."""

    def start_load(self, plan: LoadPlan) -> None:
        super().start_load(plan)
        for layer in range(self.geom.n_layer):
            self._prefetch(layer)
        for layer, (off, xfers) in self.slots.items():
            self._wait(xfers)
            self._until_intact(plan, layer, off)


class OracleConnector(KVConnector):
    """All I/O skipped: the past KV is zeros already 'in HBM'; nothing is written."""

    def start_load(self, plan: LoadPlan) -> None:
        self.plan = plan
        shape = (plan.n_past, self.geom.n_kv_heads, self.geom.head_dim)
        self.zeros = torch.zeros(shape, dtype=self.geom.dtype, device=self.device)

    def wait_for_layer(self, layer: int) -> KV | None:
        return (self.zeros, self.zeros) if self.plan.n_past else None

    def save_layer(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

