"""KV data plane: NIXL over UCX (TCP here), with the UCX environment asserted at start-up, or
Mooncake's transfer engine behind the same interface (mooncake.py, `--transport mooncake`).

See agent.py (Agent, regions, READ/WRITE of descriptor lists, notifications), multiclass.py
(MultiClassAgent: a traffic class chosen per transfer, one Agent per class because UCX over
TCP cannot set IP TOS and the class reaches the wire as a port range nftables marks), env.py
(the mandatory UCX settings and the RDMA preflight) and bench.py (throughput, submission
overhead and byte-exact checks between two processes, e.g. two engine namespaces).
"""
from .agent import Agent
from .base import (
    DEFAULT_TIMEOUT_S,
    Region,
    TransportAgent,
    Transfer,
    TransferFailed,
    TransferStats,
    TransferTimeout,
    as_descs,
    contiguous_descs,
)
from .env import (
    MODEL_PORT_RANGE,
    RdmaNotProvenError,
    RdmaUnavailableError,
    TransportError,
    UcxEnvError,
    build_ucx_env,
    rdma_devices,
    require_rdma,
)
from .multiclass import MultiClassAgent, class_agent_name, kv_ports_reserved

__all__ = [
    "Agent", "TransportAgent", "Region", "Transfer", "TransferStats", "TransferFailed", "TransferTimeout",
    "TransportError", "UcxEnvError", "RdmaUnavailableError", "RdmaNotProvenError", "DEFAULT_TIMEOUT_S",
    "MODEL_PORT_RANGE", "as_descs", "build_ucx_env", "contiguous_descs", "rdma_devices",
    "require_rdma", "MultiClassAgent", "class_agent_name", "kv_ports_reserved",
]
