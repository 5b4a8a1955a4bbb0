"""What a request's lifecycle asks of the cluster it runs on: the executor interface.

The lifecycle (request.py, prefill.py) is a generator. Each thing that takes time or touches
the cluster is a step it yields; the executor performs the step and sends back its outcome (or
raises StepError into the lifecycle). Two executors perform the same steps: the testbed's
conductor (testbed/cluster/conductor.py: real processes, asyncio) and the simulator
(simulator/cluster.py: SimPy, modelled time). Everything between the steps, what hits, the plan,
what the record says, what the store holds afterwards, is the lifecycle's and written once.

An executor's handle for a buffer area (an offset on the testbed, a byte count in the simulator)
is opaque to the lifecycle: it only hands it back in later steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from dualpath.kv.plan import Area, RequestPlan
from dualpath.scheduler.records import Request


class StepError(Exception):
    """A step could not be done. `retry`: the request may start over as a new request (a
    process it depended on died); `cause`: what the executor caught, for its own fault log."""

    def __init__(self, message: str, retry: bool = False, cause: BaseException | None = None):
        super().__init__(message)
        self.retry, self.cause = retry, cause


# -- steps: what the executor performs ------------------------------------------------------------
@dataclass(frozen=True)
class AskRoute:
    """Submit the request to the scheduler; the outcome is its `dualpath.kv.plan.Route`."""

    request: Request
    rec: Any  # the RequestRecord, for the executor's fault log


@dataclass(frozen=True)
class Allocate:
    """Space for `area` in its node's DRAM buffer, waiting for others to free some; the outcome
    is the executor's handle for it."""

    area: Area


@dataclass(frozen=True)
class Release:
    """Free an area Allocate gave."""

    area: Area
    handle: Any


@dataclass(frozen=True)
class LoadHits:
    """The plan's loads from the store into their areas, every side at once. The outcome is how
    many leading hit blocks are in place (fewer than planned: the rest is recomputed)."""

    rec: Any
    plan: RequestPlan
    held: dict[str, tuple[Area, Any]]  # area name -> (area, handle)


@dataclass(frozen=True)
class Prefill:
    """Queue the request's prefill on its PE (PrefillBatcher) and wait for its last pass; the
    outcome is the finished PrefillJob."""

    rid: str
    rec: Any
    plan: RequestPlan
    held: dict[str, tuple[Area, Any]]


@dataclass(frozen=True)
class AwaitLayers:
    """Wait until every layer the PE's passes wrote has landed in the DE buffer."""

    plan: RequestPlan
    job: Any  # the PrefillJob


@dataclass(frozen=True)
class Decode:
    """Decode on the DE from the KV in the de area, writing Full Blocks into the wb area; the
    outcome is a DecodeOutcome."""

    rid: str
    rec: Any
    plan: RequestPlan
    job: Any  # the PrefillJob: the first token and the checksums of what it wrote
    src: Any  # handle of the de area, None when nothing moves
    wb: Any  # handle of the wb area, None when nothing is written back


@dataclass(frozen=True)
class WriteBack:
    """Persist the Full Blocks decode wrote into the wb area once they landed; the outcome is,
    per block, whether the store took it."""

    rec: Any
    plan: RequestPlan
    keys: tuple[Any, ...]
    decoded: DecodeOutcome
    wb: Any


@dataclass(frozen=True)
class AfterFailure:
    """A step raised StepError mid-request: the outcome says whether the request starts over
    (the executor looks for processes that died under it)."""

    rec: Any
    route: Any
    error: StepError
    rid: str = ""  # the attempt's request id, as its engines were given it


@dataclass(frozen=True)
class GaveUp:
    """The request ended in an error; the outcome names the fault that explains it ("" none)."""

    rec: Any


@dataclass(frozen=True)
class NextInstant:
    """Let work that arrives at this same instant join before going on (prefill batching)."""


@dataclass(frozen=True)
class RunPass:
    """One forward pass on `engine` of `batch` (a dualpath.scheduler.batching.PackedBatch), each
    entry's message from its job; the outcome is a PassOutcome."""

    engine: str
    jobs: Sequence[Any]
    batch: Any


# -- outcomes ----------------------------------------------------------------------------------------
@dataclass
class PassResult:
    """What one pass did for one request (a simulator leaves what only real KV has empty)."""

    first_token: int = -1
    attention_s: float = 0.0  # this request's share of the pass's compute
    read_wait_s: float = 0.0
    reread_bytes: int = 0
    crcs: list[int] | None = None  # per layer, of the rows the pass wrote
    layer_hashes: list[str] = field(default_factory=list)
    peak_hit_bytes: int = 0
    connector: str = ""


@dataclass
class PassOutcome:
    t_end: float  # the pass's end: the first token of a request it finished
    results: list[PassResult]
    record: dict[str, Any]  # the executor's own fields for the pass's record (attention_s, ...)


@dataclass
class DecodeOutcome:
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    written_blocks: Sequence[int] = ()  # token blocks decode wrote into the wb area
    block_crcs: list[int] = field(default_factory=list)
    reread_bytes: int = 0
    layer_hashes: list[str] = field(default_factory=list)
    connector: str = ""
