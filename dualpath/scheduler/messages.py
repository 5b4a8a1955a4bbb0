"""Control-plane messages: msgpack maps validated by pydantic. Never pickle.

Every message is a map with a "type" and a client-chosen integer "msg_id" that the reply echoes, so
a client can drop stale replies after a timeout. Validation errors become an error reply naming the
offending field as a dotted path ("reports.0.tok_e"), so a buggy leader learns what it sent wrong.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo, field_validator

from .records import Assignment, EngineReport, Request, Role

MAX_ITEMS = 4096  # reports or requests per message: bounds the work one message can cause
Id = Annotated[str, Field(min_length=1, max_length=256)]
NonNeg = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class EngineReportMsg(_Strict):
    engine_id: Id
    node_id: Id
    role: Literal["prefill", "decode"]
    group_id: Id
    seq_e: NonNeg
    tok_e: NonNeg
    free_hbm_tokens: NonNeg
    free_hbm_bytes: NonNeg
    read_q_bytes: NonNeg
    snic_up: bool = True  # False: the node's storage NIC (or its host agent) is down

    def to_record(self) -> EngineReport:
        return EngineReport(
            self.engine_id, self.node_id, Role(self.role), self.group_id, self.seq_e, self.tok_e,
            self.free_hbm_tokens, self.free_hbm_bytes, self.read_q_bytes, self.snic_up,
        )


class RequestMsg(_Strict):
    request_id: Id
    # hit/miss come first so total_len's check can see them and the error names total_len
    hit_tokens: NonNeg
    miss_tokens: NonNeg
    total_len: Annotated[int, Field(gt=0)]
    arrival: float | None = None  # None: the scheduler's clock at receipt

    @field_validator("total_len")
    @classmethod
    def _lengths_add_up(cls, v: int, info: ValidationInfo) -> int:
        hit, miss = info.data.get("hit_tokens"), info.data.get("miss_tokens")
        if hit is not None and miss is not None and hit + miss != v:
            raise ValueError(f"total_len {v} != hit_tokens {hit} + miss_tokens {miss}")
        return v

    def to_record(self, now: float) -> Request:
        arrival = now if self.arrival is None else self.arrival
        return Request(self.request_id, self.total_len, self.hit_tokens, self.miss_tokens, arrival)


class PullMsg(_Strict):
    type: Literal["pull"]
    msg_id: NonNeg
    group_id: Id
    reports: Annotated[list[EngineReportMsg], Field(max_length=MAX_ITEMS)] = []


class SubmitMsg(_Strict):
    type: Literal["submit"]
    msg_id: NonNeg
    requests: Annotated[list[RequestMsg], Field(min_length=1, max_length=MAX_ITEMS)]


class PingMsg(_Strict):
    type: Literal["ping"]
    msg_id: NonNeg


class StatsMsg(_Strict):
    type: Literal["stats"]
    msg_id: NonNeg


Message = Annotated[Union[PullMsg, SubmitMsg, PingMsg, StatsMsg], Field(discriminator="type")]
MESSAGE = TypeAdapter(Message)


class BadMessage(ValueError):
    """A message that cannot be served; `field` names what was wrong ("" for the whole message)."""

    def __init__(self, field: str, error: str, msg_id: int | None = None) -> None:
        super().__init__(f"{field or '<message>'}: {error}")
        self.field = field
        self.error = error
        self.msg_id = msg_id


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack_map(data: bytes) -> dict[str, Any]:
    """Decode one msgpack map with string keys, or raise BadMessage."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for corrupt input
        raise BadMessage("", f"not a msgpack document: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise BadMessage("", f"expected a msgpack map, got {type(obj).__name__}")
    return obj


def parse(data: bytes) -> PullMsg | SubmitMsg | PingMsg | StatsMsg:
    obj = unpack_map(data)
    msg_id = obj.get("msg_id") if isinstance(obj.get("msg_id"), int) else None
    try:
        return MESSAGE.validate_python(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = list(err["loc"])
        if err["type"] in ("union_tag_not_found", "union_tag_invalid"):
            field = "type"
        else:
            if loc and loc[0] in ("pull", "submit", "ping", "stats"):
                loc = loc[1:]  # drop the discriminator tag pydantic puts first
            field = ".".join(str(p) for p in loc)
        raise BadMessage(field, err["msg"], msg_id) from None


def error_reply(e: BadMessage) -> dict[str, Any]:
    return {"type": "error", "msg_id": e.msg_id, "field": e.field, "error": e.error}


def assignment_to_dict(a: Assignment) -> dict[str, Any]:
    r = a.request
    return {
        "request_id": r.request_id, "total_len": r.total_len, "hit_tokens": r.hit_tokens,
        "miss_tokens": r.miss_tokens, "arrival": r.arrival,
        "pe_engine": a.pe_engine, "pe_node": a.pe_node, "pe_group": a.pe_group,
        "de_engine": a.de_engine, "de_node": a.de_node, "de_group": a.de_group,
        "path": a.path.value, "pe_blocks": a.pe_blocks, "de_blocks": a.de_blocks,
        "pe_assigned_at": a.pe_assigned_at, "de_assigned_at": a.de_assigned_at, "avoided": a.avoided,
    }


class AssignmentMsg(_Strict):
    """What a leader receives; validated on the client side too."""

    request_id: Id
    total_len: int
    hit_tokens: int
    miss_tokens: int
    arrival: float
    pe_engine: Id
    pe_node: Id
    pe_group: Id
    de_engine: Id
    de_node: Id
    de_group: Id
    path: Literal["pe", "de", "split"]
    pe_blocks: NonNeg
    de_blocks: NonNeg
    pe_assigned_at: float
    de_assigned_at: float
    avoided: Annotated[str, Field(max_length=256)] = ""
