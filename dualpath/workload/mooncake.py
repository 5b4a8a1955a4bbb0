"""Loader for public Mooncake-format JSONL traces (kvcache-ai/Mooncake `mooncake_trace.jsonl` and
the FAST'25 conversation / tool-agent traces).

Each non-blank line is one request, a JSON object with at least

    {"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": [0, 1, ..., 13]}

  * timestamp: arrival in ms since the trace start (int or float, >= 0);
  * input_length / output_length: prompt and generated tokens (ints; input >= 1, output >= 0);
  * hash_ids: one id per 512-token block of the prompt, the last one covering the partial tail
    block, so len(hash_ids) <= ceil(input_length / 512). Equal ids at the same position mean an
    equal prefix (ids are chained: they already encode everything before them).
Other fields are ignored.

Token ids are derived deterministically from hash ids: block j of a prompt is the first tokens of
the pseudo-random block `default_rng([salt, 0x4D43, hash_ids[j]])` (ids in [4, vocab_size)), so
requests that share hash ids share exactly that token prefix, and so their chained store keys.
Prompt blocks past the end of hash_ids (shorter lists) get tokens unique to the request.

Scaling: `scale` divides lengths for this machine. Each 512-token trace block becomes
512 / scale tokens (scale must divide the trace block), input_length becomes
ceil(input_length / scale) and output_length ceil(output_length / scale).

Every trace line becomes one single-turn request (`to_trajectories`): the trace has no session
ids, and a replayed model generates its own tokens, so turns cannot be re-chained faithfully.

Bad input raises `TraceError` whose message is one line naming the file, the line number and the
field; `python -m dualpath.workload.mooncake FILE` prints that line (no traceback) and exits 2.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .trajectories import DEFAULT_VOCAB, RESERVED_TOKENS, Trajectory, Turn

MOONCAKE_BLOCK = 512  # tokens per hash id in the published Mooncake traces
REQUIRED = ("timestamp", "input_length", "output_length", "hash_ids")
_TAG_HASH = 0x4D43  # "MC": tokens of a hash block
_TAG_UNIQUE = 0x554E  # "UN": tokens of a prompt block with no hash id


class TraceError(ValueError):
    """A bad trace file. str() is one line: '<file>:<line>: field '<f>': <what is wrong>'."""

    def __init__(self, path: str | Path, line: int | None, field: str | None, problem: str):
        self.path, self.line, self.field, self.problem = str(path), line, field, problem
        where = self.path if line is None else f"{self.path}:{line}"
        what = problem if field is None else f"field '{field}': {problem}"
        super().__init__(f"{where}: {what}")


@dataclass(frozen=True)
class TraceRequest:
    index: int  # 0-based position among the trace's requests
    line: int  # 1-based line number in the file
    arrival_s: float  # timestamp / 1000
    input_length: int  # prompt tokens, in this run's (scaled) tokens
    output_length: int  # generated tokens, scaled
    hash_ids: tuple[int, ...]
    block_tokens: int  # tokens per hash block in this run: trace_block / scale
    vocab_size: int = DEFAULT_VOCAB
    salt: int = 0

    def tokens(self) -> tuple[int, ...]:
        """The prompt's token ids (computed on demand: real traces hold millions of tokens)."""
        out: list[int] = []
        n_blocks = math.ceil(self.input_length / self.block_tokens)
        for j in range(n_blocks):
            n = min(self.block_tokens, self.input_length - j * self.block_tokens)
            if j < len(self.hash_ids):
                block = _hash_block(self.hash_ids[j], self.block_tokens, self.vocab_size, self.salt)
            else:
                block = _unique_block(self.index, j, self.block_tokens, self.vocab_size, self.salt)
            out.extend(block[:n])
        return tuple(out)


@lru_cache(maxsize=16384)
def _hash_block(hash_id: int, n: int, vocab: int, salt: int) -> tuple[int, ...]:
    rng = np.random.default_rng([salt, _TAG_HASH, hash_id])
    return tuple(rng.integers(RESERVED_TOKENS, vocab, size=n).tolist())


def _unique_block(index: int, j: int, n: int, vocab: int, salt: int) -> tuple[int, ...]:
    rng = np.random.default_rng([salt, _TAG_UNIQUE, index, j])
    return tuple(rng.integers(RESERVED_TOKENS, vocab, size=n).tolist())


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(v: object) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def parse_line(text: str, *, path: str | Path = "<trace>", line: int = 1) -> dict:
    """Validate one trace line; returns the four fields. Raises TraceError."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(path, line, None, f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(path, line, None, f"expected a JSON object, got {type(obj).__name__}")
    for f in REQUIRED:
        if f not in obj:
            raise TraceError(path, line, f, "missing")
    ts = obj["timestamp"]
    if not (isinstance(ts, (int, float)) and not isinstance(ts, bool)) or not math.isfinite(ts):
        raise TraceError(path, line, "timestamp", f"expected a number of ms, got {_short(ts)}")
    if ts < 0:
        raise TraceError(path, line, "timestamp", f"must be >= 0, got {_short(ts)}")
    for f, least in (("input_length", 1), ("output_length", 0)):
        v = obj[f]
        if not _is_int(v):
            raise TraceError(path, line, f, f"expected an integer, got {_short(v)}")
        if v < least:
            raise TraceError(path, line, f, f"must be >= {least}, got {v}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise TraceError(path, line, "hash_ids", f"expected a list of integers, got {_short(ids)}")
    for k, h in enumerate(ids):
        if not _is_int(h) or h < 0:
            raise TraceError(path, line, "hash_ids", f"entry {k} must be a non-negative integer, got {_short(h)}")
    return {f: obj[f] for f in REQUIRED}


def load_mooncake(path: str | Path, *, scale: int = 1, trace_block: int = MOONCAKE_BLOCK,
                  vocab_size: int = DEFAULT_VOCAB, salt: int = 0,
                  max_requests: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace into requests (file order). Raises TraceError on bad input."""
    if not _is_int(scale) or scale < 1 or trace_block % scale:
        raise ValueError(f"scale must be a positive integer dividing the trace block {trace_block}, got {scale!r}")
    if vocab_size <= RESERVED_TOKENS:
        raise ValueError(f"vocab_size must be > {RESERVED_TOKENS}")
    block_tokens = trace_block // scale
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise TraceError(path, None, None, f"cannot read: {e.strerror or e}") from None
    out: list[TraceRequest] = []
    for lineno, bline in enumerate(raw.splitlines(), start=1):
        if max_requests is not None and len(out) >= max_requests:
            break
        try:
            text = bline.decode("utf-8")
        except UnicodeDecodeError:
            raise TraceError(path, lineno, None, "not UTF-8 text") from None
        if not text.strip():
            continue
        rec = parse_line(text, path=path, line=lineno)
        n_in, ids = rec["input_length"], rec["hash_ids"]
        most = math.ceil(n_in / trace_block)
        if len(ids) > most:
            raise TraceError(path, lineno, "hash_ids",
                             f"has {len(ids)} ids but input_length {n_in} spans only {most} "
                             f"blocks of {trace_block} tokens")
        out.append(TraceRequest(
            index=len(out), line=lineno, arrival_s=rec["timestamp"] / 1000.0,
            input_length=math.ceil(n_in / scale), output_length=math.ceil(rec["output_length"] / scale),
            hash_ids=tuple(ids), block_tokens=block_tokens, vocab_size=vocab_size, salt=salt))
    return out


def to_trajectories(requests: Iterable[TraceRequest]) -> list[Trajectory]:
    """One single-turn trajectory per request, empty system prompt, arrival time kept. The
    generation length is max(1, output_length): a request always yields its first token."""
    return [Trajectory(r.index, (), (Turn(r.tokens(), max(1, r.output_length)),), arrival_s=r.arrival_s)
            for r in requests]


def prefix_hit_rate(requests: Sequence[TraceRequest], block_size: int) -> float:
    """Token-weighted hit rate with an infinite store: a request hits the longest run of its
    full `block_size`-token blocks (chained, so by prefix) that an earlier request already had."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        toks = r.tokens()
        key, run_hits, hitting = 0, 0, True
        for j in range(len(toks) // block_size):
            key = hash((key, toks[j * block_size:(j + 1) * block_size]))
            if hitting and key in seen:
                run_hits += block_size
            else:
                hitting = False
                seen.add(key)
        hit += min(run_hits, len(toks) - 1)  # at least one token is computed
        total += len(toks)
    return hit / total if total else 0.0


def summary(requests: Sequence[TraceRequest], block_size: int = 16) -> dict:
    n = len(requests)
    return {
        "requests": n,
        "duration_s": (max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)) if n else 0.0,
        "input_length_mean": sum(r.input_length for r in requests) / n if n else 0.0,
        "output_length_mean": sum(r.output_length for r in requests) / n if n else 0.0,
        "block_tokens": requests[0].block_tokens if n else None,
        "prefix_hit_rate": prefix_hit_rate(requests, block_size),
        "block_size": block_size,
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dualpath.workload.mooncake",
                                 description="Validate a Mooncake JSONL trace and print its summary.")
    ap.add_argument("trace")
    ap.add_argument("--scale", type=int, default=1, help="divide lengths by this (must divide 512)")
    ap.add_argument("--block-size", type=int, default=16, help="block size for the prefix hit rate")
    ap.add_argument("--max-requests", type=int, default=None)
    a = ap.parse_args(argv)
    try:
        reqs = load_mooncake(a.trace, scale=a.scale, max_requests=a.max_requests)
    except (TraceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary(reqs, a.block_size), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
