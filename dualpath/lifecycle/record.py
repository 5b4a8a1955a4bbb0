"""The record of one request, shared by the live conductor and the simulator."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """One request's life, the same record whether the testbed ran it or the simulator did
    (the simulator leaves the fields only a real run has empty: tokens, prompt, layer hashes,
    connectors, attempts and faults). Times are testbed seconds."""

    request: str
    trajectory: int
    turn: int
    mode: str
    path: str = ""  # "pe", "de", "split" or "none" (oracle); "" until routed
    pe: str = ""
    de: str = ""
    pe_node: str = ""
    de_node: str = ""
    n_prompt: int = 0
    n_hit: int = 0
    n_miss: int = 0
    gen_len: int = 0
    hit_bytes: int = 0  # H
    miss_bytes: int = 0  # M
    writeback_bytes: int = 0  # W
    pe_hit_bytes: int = 0  # of H, read on the PE side (all of it on the PE path, part when split)
    passes: int = 0  # prefill passes: more than one when the request was chunked
    chunk_read_bytes: int = 0  # past KV later chunks read back from the DE buffer
    prompt: list[int] = field(default_factory=list, repr=False)
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # when each token existed (testbed s)
    pe_layer_hashes: list[str] = field(default_factory=list, repr=False)
    de_layer_hashes: list[str] = field(default_factory=list, repr=False)
    peak_hit_bytes: int = 0
    connectors: tuple[str, str] = ("", "")  # the classes that moved its KV on the PE and on the DE
    t_arrive: float = 0.0
    t_routed: float = 0.0  # the scheduler's decision reached the conductor
    t_read_start: float = 0.0
    t_read_end: float = 0.0
    t_prefill_start: float = 0.0
    t_first_token: float = 0.0
    t_done: float = 0.0
    read_wait_s: float = 0.0
    reread_bytes: int = 0  # KV read again by the DE because the PE's WRITE had not landed yet
    attention_s: float = 0.0  # the PE's layer compute time for this request (CPU time, see engines.prefill)
    error: str = ""
    attempts: int = 1  # more than one: processes it depended on died, and it started over
    faults: list[str] = field(default_factory=list)  # what it met, charged to which fault

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("prompt")
        return d
