"""Data the scheduler decides on: engine reports, requests, and its own engine/node state.

Reports and requests are immutable inputs. EngineState and NodeState are the scheduler's
*estimates*: the last report plus whatever the scheduler itself assigned since, because the
engines only learn of an assignment when their leader next pulls (DESIGN.md section 8).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class ReadPath(str, Enum):
    """Which node's SNIC reads a request's hit KV from storage."""

    PE = "pe"  # PE node reads into the PE buffer (conventional path)
    DE = "de"  # DE node reads into the DE buffer; the PE pulls it over RDMA
    SPLIT = "split"  # some blocks each way (our extension; the paper's future work)


@dataclass(frozen=True, slots=True)
class EngineReport:
    """What an engine group leader reports for one of its engines when it pulls."""

    engine_id: str
    node_id: str
    role: Role
    group_id: str
    seq_e: int  # unfinished requests on the engine
    tok_e: int  # total tokens of those requests
    free_hbm_tokens: int  # KV tokens the engine can still admit (what DE admission checks)
    free_hbm_bytes: int  # same in bytes, carried for metrics
    read_q_bytes: int  # pending storage-read bytes of the engine's *node* (its SNIC is shared)
    snic_up: bool = True  # the node's storage NIC works (its host agent sees a link and answers)

    def __post_init__(self) -> None:
        if min(self.seq_e, self.tok_e, self.free_hbm_tokens, self.free_hbm_bytes, self.read_q_bytes) < 0:
            raise ValueError(f"engine report fields must be >= 0: {self!r}")
        if type(self.role) is not Role:
            object.__setattr__(self, "role", Role(self.role))


@dataclass(frozen=True, slots=True)
class Request:
    """One turn of an agent: a prompt of which hit_tokens already sit in storage."""

    request_id: str
    total_len: int  # prompt tokens = hit + miss; what tok_e and HBM admission count
    hit_tokens: int  # KV read from storage
    miss_tokens: int  # KV computed by prefill
    arrival: float

    def __post_init__(self) -> None:
        if self.hit_tokens < 0 or self.miss_tokens < 0:
            raise ValueError("hit_tokens and miss_tokens must be >= 0")
        if self.hit_tokens + self.miss_tokens != self.total_len:
            raise ValueError(
                f"total_len {self.total_len} != hit_tokens {self.hit_tokens} + miss_tokens {self.miss_tokens}"
            )
        if self.total_len <= 0:
            raise ValueError("total_len must be > 0")


@dataclass(slots=True)
class NodeState:
    node_id: str
    read_q: int = 0  # estimated pending read bytes: last report + inflight_read
    inflight_read: int = 0  # bytes assigned to this node's SNIC but not yet delivered to it
    read_total: int = 0  # bytes the scheduler has given this node to read, ever (breaks ties)
    snic_up: bool = True  # as last reported: False while its SNIC or its host agent is down


@dataclass(slots=True, eq=False)
class EngineState:
    """The scheduler's running estimate of one engine (mutated by the policies)."""

    engine_id: str
    node: NodeState
    group_id: str
    role: Role
    index: int  # stable tie-breaker: registration order
    tok: int = 0
    seq: int = 0
    free_hbm: int = 0  # tokens
    free_hbm_bytes: int = 0
    # Assigned by the scheduler but not yet delivered to the engine's leader, so a report
    # cannot include it yet; re-added on every report so it is never lost or double counted.
    inflight_tok: int = 0
    inflight_seq: int = 0
    last_report: float = float("-inf")

    @property
    def node_id(self) -> str:
        return self.node.node_id


@dataclass(frozen=True, slots=True)
class PathDecision:
    path: ReadPath
    pe_blocks: int  # hit blocks the PE node reads: blocks [0, pe_blocks)
    de_blocks: int  # hit blocks the DE node reads: blocks [pe_blocks, pe_blocks + de_blocks)


@dataclass(frozen=True, slots=True)
class Assignment:
    """A complete decision for one request, delivered to both its PE and DE group leaders."""

    request: Request
    pe_engine: str
    pe_node: str
    pe_group: str
    de_engine: str
    de_node: str
    de_group: str
    path: ReadPath
    pe_blocks: int
    de_blocks: int
    pe_assigned_at: float
    de_assigned_at: float
    avoided: str = ""  # a node whose SNIC was down: the read path moved to the other side

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class GroupState:
    group_id: str
    role: Role
    engines: list[EngineState] = field(default_factory=list)
    tok_sum: int = 0  # sum of engines' tok; kept incrementally (phase 1 reads it per request)
