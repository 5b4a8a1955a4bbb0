"""A team's own KV connector, written against the contract only (docs/connectors.md, version 1).

Both sides, in the simplest shape that is still correct:
- prefill: per layer, READ that layer's past when the model asks for it (no prefetch), then WRITE
  the layer's new KV, and the past rows the DE lacks, to the request's area in the DE buffer, and
  wait for that WRITE before the next layer (no overlap). Slower than the built-in layerwise
  connector, never wrong.
- decode: one READ per layer of the prompt's KV (the built-in posts one READ for all layers),
  checked against the PE's CRCs; the write-back of new Full Blocks is the built-in's (inherited).

Run it:  PYTHONPATH=examples/connectors dualpath run topologies/1p1d-io.yaml --modes dualpath \\
             --connector simple_layerwise:SimpleConnectors
"""
from __future__ import annotations

import time

import numpy as np
import torch

from dualpath.kv.check import REREAD_AFTER_S, REREAD_MAX_GAP_S, crc, stale
from dualpath.kv.connector import KV, KVConnector, LoadPlan
from dualpath.kv.decode_connector import BufferDecodeConnector, DecodePlan
from dualpath.kv.layouts import pack_rows, unpack_layer
from dualpath.kv.plugin import ConnectorPlugin
from dualpath.kv.spans import token_rows_descs


class SimpleLayerwise(KVConnector):
    def start_load(self, plan: LoadPlan) -> None:
        self.plan = plan
        self.past_bytes = self._layer_bytes(plan.n_past)
        self.past_off: int | None = None  # the layer being computed: its past, until saved

    def wait_for_layer(self, layer: int) -> KV | None:
        if not self.plan.n_past:
            return None
        self.past_off = self._alloc_past(self.past_bytes)
        self._wait(self._post_read(self.plan, layer, self.past_off))
        self._until_intact(self.plan, layer, self.past_off)  # a later chunk: re-read a WRITE still landing
        return self._view(self.past_off, self.plan.n_past)

    def save_layer(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        p, g = self.plan, self.geom
        new_off = self.alloc.alloc(self._layer_bytes(p.n_new))
        try:
            pack_rows(k_new, v_new, g, self._rows(new_off, p.n_new))
            parts = [token_rows_descs(g, layer, p.n_past, p.n_new, new_off, p.dst.offset)]
            past_crc = 0
            if self.past_off is not None:
                past_crc = crc(self._rows(self.past_off, p.n_past).numpy())
                if p.forward_past:
                    parts.insert(0, token_rows_descs(g, layer, 0, p.forward_past, self.past_off, p.dst.offset))
            # the next reader checks the DE buffer's rows [0, n_past + n_new) of this layer against this
            self.stats.write_crcs.append(crc(self._rows(new_off, p.n_new).numpy(), past_crc))
            descs = np.concatenate(parts)
            self.stats.written_bytes += int(descs[:, 2].sum())
            self.agent.post("WRITE", p.dst.peer, "hbm", p.dst.region, descs, layer=layer,
                            notif=f"{p.notif_prefix}/L{layer}").wait(self.timeout_s)
        finally:
            self.alloc.free(new_off)
            self._release_past()

    def wait_for_save(self) -> None:
        self._release_past()  # only after an error between wait_for_layer and save_layer

    def _release_past(self) -> None:
        if self.past_off is not None:
            self._free_past(self.past_off, self.past_bytes)
            self.past_off = None


class SimpleDecode(BufferDecodeConnector):
    """Its own load (one READ per layer); the built-in's write-back (save_block, poll_save, close)."""

    def start_load(self, plan: DecodePlan) -> None:
        g = self.geom
        self.plan = plan
        self.layer_bytes = plan.n_prompt * g.bytes_per_token_per_layer
        self._deadline = time.monotonic() + self.timeout_s
        self._off = self.alloc.alloc(self.layer_bytes * g.n_layer)
        n_wb = max(0, (plan.n_prompt + plan.gen_len - 1) // g.block_size - plan.first_new_block)
        self._wb_off = self.alloc.alloc(max(n_wb, 1) * g.full_block_bytes) if plan.wb is not None else None
        self._writes: list = []
        self.reads = {layer: self._read_layer(layer) for layer in range(g.n_layer)}
        self.reread_at, self.gap = 0.0, REREAD_AFTER_S

    def _read_layer(self, layer: int):
        descs = token_rows_descs(self.geom, layer, 0, self.plan.n_prompt, self._off + layer * self.layer_bytes,
                                 self.plan.src.offset)
        self.stats.read_bytes += int(descs[:, 2].sum())
        return self.agent.post("READ", self.plan.src.peer, "hbm", self.plan.src.region, descs, layer=layer)

    def poll_load(self) -> list[KV] | None:
        if time.monotonic() > self._deadline:
            raise TimeoutError(f"request {self.plan.request}: its prompt KV did not arrive intact")
        if not all(x.poll() for x in self.reads.values()):
            return None
        lb, p = self.layer_bytes, self.plan
        if p.expect_crcs is not None:  # a layer the PE's WRITE had not finished landing: read it again
            late = stale(self.hbm, [(self._off + l * lb, lb, c) for l, c in enumerate(p.expect_crcs)])
            if late:
                now = time.monotonic()
                if now < self.reread_at:  # backing off: a layer that never matches must not flood the link
                    return None
                self.reread_at, self.gap = now + self.gap, min(2 * self.gap, REREAD_MAX_GAP_S)
                before = self.stats.read_bytes
                self.reads = {layer: self._read_layer(layer) for layer in late}
                self.stats.reread_bytes += self.stats.read_bytes - before
                self.stats.read_bytes = before
                return None
        g, bpt = self.geom, self.geom.bytes_per_token_per_layer
        kv = []
        for layer in range(g.n_layer):
            rows = torch.from_numpy(self.hbm[self._off + layer * lb:self._off + (layer + 1) * lb]).view(p.n_prompt, bpt)
            k, v = unpack_layer(rows, g)
            kv.append((k.to(self.device).contiguous(), v.to(self.device).contiguous()))  # copies: HBM is freed next
        self.alloc.free(self._off)
        self._off = None
        return kv


class SimpleConnectors(ConnectorPlugin):
    name = "simple-layerwise"
    prefill = SimpleLayerwise
    decode = SimpleDecode
