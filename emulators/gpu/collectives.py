"""The target's model-class traffic: the collective each forward pass runs per layer, in bytes.

The paper's models that have collectives are the DeepSeek MoE models, served with expert
parallelism (EP): every MoE layer dispatches each token's hidden state to the GPUs of its top-k
experts and combines their outputs back (an AllToAll each way). Qwen2.5-32B is served
data-parallel in DualPath (paper section 7.1: "Qwen 32B uses DP only"): no collective at all.
So the collective that fits a target is EP's AllToAll, or none.

Bytes, per token and MoE layer, as DeepEP's internode kernels move them (the kernels DeepSeek
serves V3 with), because only the internode part crosses a compute NIC (CNIC):
- dispatch: the hidden state in FP8 (1 byte each) plus one FP32 scale per 128 values;
- combine: the expert outputs reduced per node, in BF16 (2 bytes each);
- each sent once per *remote node* that holds at least one of the token's top-k experts (DeepEP
  sends one RDMA copy per node and forwards it over NVLink inside the node). With routed
  experts spread evenly over the EP group's nodes and routing uniform, a token reaches
  (nodes - 1) * (1 - C(E - E/nodes, k) / C(E, k)) remote nodes in expectation.
An EP group inside one node (DS 27B's EP 8) sends nothing over its CNICs: all of it rides
NVLink, which the testbed does not have, and `collective_traffic` says so.

Scaled like KV (`per_testbed_layer`): the testbed moves b_testbed / b_target of the target's KV
bytes per token over links scaled by `scale`, which is what makes a KV load last k times the
target's (emulators/gpu/cost.py: dilation). Scaling the collective's bytes by the same ratio
makes it last k times the target's too, on the same links, so no extra time factor is needed:
its real duration on the testbed IS its emulated duration times k. The target's total over its
MoE layers is spread evenly over the testbed model's layers (each testbed layer stands for
n_layers_target / n_layers_testbed of the target's, as its compute window does).

What this leaves out (said in reports): the fixed per-message latency of RDMA and kernel launch
(a few microseconds on the target) is not dilated, and a real AllToAll synchronises the group,
which the testbed's data-parallel engines, each running its own passes, do not
(dualpath/engines/collective.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .models import BF16_BYTES, FP8_BYTES, FP8_SCALE_TILE, FP32_BYTES, TargetModel

GPUS_PER_NODE = 8  # the paper's nodes: 8 Hopper GPUs, one CNIC each


class NoCollective(ValueError):
    """The target has no collective on its CNICs; the message says why, in one line."""


@dataclass(frozen=True)
class CollectiveTraffic:
    """What one target GPU's CNIC carries for one token in one MoE layer of a forward pass."""

    kind: str  # "alltoall" (expert parallelism)
    dispatch_bytes: float  # sent: the token to the remote nodes of its experts
    combine_bytes: float  # received: their outputs back
    moe_layers: int
    remote_nodes: float  # expected remote nodes per token
    ep: int
    nodes: int

    @property
    def bytes_per_token(self) -> float:
        """Both directions, every MoE layer: the target's model-class bytes per token."""
        return (self.dispatch_bytes + self.combine_bytes) * self.moe_layers

    def per_testbed_layer(self, testbed_kv_bytes_per_token: int, target_kv_bytes_per_token: int,
                          testbed_layers: int) -> tuple[float, float]:
        """(dispatch, combine) bytes per token in one testbed layer, scaled like KV (module doc)."""
        if testbed_kv_bytes_per_token <= 0 or target_kv_bytes_per_token <= 0:
            raise ValueError("KV bytes per token must be > 0")
        if testbed_layers < 1:
            raise ValueError(f"testbed_layers must be >= 1, got {testbed_layers!r}")
        share = testbed_kv_bytes_per_token / target_kv_bytes_per_token * self.moe_layers / testbed_layers
        return self.dispatch_bytes * share, self.combine_bytes * share

    def to_dict(self) -> dict:
        return {"kind": self.kind, "dispatch_bytes_per_token_layer": round(self.dispatch_bytes, 1),
                "combine_bytes_per_token_layer": round(self.combine_bytes, 1), "moe_layers": self.moe_layers,
                "remote_nodes_per_token": round(self.remote_nodes, 4), "ep": self.ep, "nodes": self.nodes,
                "bytes_per_token": round(self.bytes_per_token, 1)}


def expected_remote_nodes(n_experts: int, top_k: int, nodes: int) -> float:
    """Remote nodes one token's top-k experts sit on, in expectation: experts spread evenly over
    `nodes`, the token's own node one of them, routing uniform without replacement."""
    if nodes < 1 or n_experts < 1 or not 1 <= top_k <= n_experts:
        raise ValueError(f"need nodes >= 1 and 1 <= top_k <= n_experts; got {nodes}, {top_k}, {n_experts}")
    if n_experts % nodes:
        raise ValueError(f"{n_experts} experts do not spread evenly over {nodes} nodes")
    if nodes == 1:
        return 0.0
    elsewhere = n_experts - n_experts // nodes  # experts not on one given remote node
    miss = math.comb(elsewhere, top_k) / math.comb(n_experts, top_k)
    return (nodes - 1) * (1.0 - miss)


def collective_traffic(model: TargetModel, gpus_per_node: int = GPUS_PER_NODE) -> CollectiveTraffic:
    """The CNIC traffic of `model`'s collective; NoCollective if it has none (one-line reason)."""
    if not model.n_moe_layers or model.ep <= 1:
        raise NoCollective(f"target model {model.name} is served data-parallel (ep={model.ep}, no expert "
                           "parallelism): its forward pass runs no collective")
    if model.ep % gpus_per_node and model.ep > gpus_per_node:
        raise NoCollective(f"target model {model.name}: ep={model.ep} is not whole nodes of {gpus_per_node} GPUs")
    nodes = max(1, model.ep // gpus_per_node)
    if nodes == 1:
        raise NoCollective(f"target model {model.name}: its EP group (ep={model.ep}) fits one node of "
                           f"{gpus_per_node} GPUs, so its AllToAll rides NVLink and never a CNIC")
    c = model.config
    hidden = model.hidden
    remote = expected_remote_nodes(model.n_routed_experts, int(c["num_experts_per_tok"]), nodes)
    dispatch = (hidden * FP8_BYTES + -(-hidden // FP8_SCALE_TILE) * FP32_BYTES) * remote
    combine = hidden * BF16_BYTES * remote
    return CollectiveTraffic("alltoall", dispatch, combine, model.n_moe_layers, remote, model.ep, nodes)


__all__ = ["CollectiveTraffic", "NoCollective", "collective_traffic", "expected_remote_nodes", "GPUS_PER_NODE"]
