"""KV data plane: NIXL over UCX (TCP here), with the UCX environment asserted at start-up.

See agent.py (Agent, regions, READ/WRITE of descriptor lists, notifications), env.py (the
mandatory UCX settings and the RDMA preflight) and bench.py (throughput and submission
overhead between two processes, e.g. two engine namespaces).
"""
from .agent import (
    DEFAULT_TIMEOUT_S,
    Agent,
    Region,
    Transfer,
    TransferFailed,
    TransferStats,
    TransferTimeout,
    as_descs,
    contiguous_descs,
)
from .env import (
    MODEL_PORT_RANGE,
    RdmaUnavailableError,
    TransportError,
    UcxEnvError,
    build_ucx_env,
    rdma_devices,
    require_rdma,
)

__all__ = [
    "Agent", "Region", "Transfer", "TransferStats", "TransferFailed", "TransferTimeout",
    "TransportError", "UcxEnvError", "RdmaUnavailableError", "DEFAULT_TIMEOUT_S",
    "MODEL_PORT_RANGE", "as_descs", "build_ucx_env", "contiguous_descs", "rdma_devices",
    "require_rdma",
]
