"""A deliberately wrong connector: the built-in layerwise one with a one-line bug, to show that the
testbed catches it. Layer l's past KV is read from layer l-1's rows (layer 0 is right), so the
model computes layer l on the wrong past; the KV the PE forwards and the tokens are wrong too.

Run it and watch it fail, naming the request, layer 1 and the check:
    PYTHONPATH=examples/connectors dualpath run topologies/1p1d-io.yaml --modes dualpath \\
        --connector wrong_layer:WrongLayer
"""
from __future__ import annotations

from dualpath.kv.connector import LayerwiseConnector, LoadPlan
from dualpath.kv.plugin import ConnectorPlugin


class OffByOneLayer(LayerwiseConnector):
    def _post_read(self, plan: LoadPlan, layer: int, off: int) -> list:
        return super()._post_read(plan, max(layer - 1, 0), off)  # the bug


class WrongLayer(ConnectorPlugin):
    name = "wrong-layer (deliberately broken)"
    prefill = OffByOneLayer
