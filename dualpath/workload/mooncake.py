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
ceil(input_length / scale) and output_length ceil(output_length / scale), except that a partial
tail block stays partial (one token shorter where the rounding up would complete it), so the
scaled prompt has exactly the trace's full blocks.

`to_trajectories` makes every trace line a single-turn request; `dualpath.workload.trace`
recovers the trace's sessions from its prefixes and replays them as multi-turn agents.

Bad input raises `TraceError` whose message is one line naming the file, the line number and the
field; `python -m dualpath.workload.mooncake FILE` prints that line (no traceback) and exits 2.

A gzip-compressed trace (`.jsonl.gz`, recognised by its magic bytes) is read the same way.

Bounds (whatever the file holds, reading stays bounded in time and memory): only a regular file
is read (a FIFO would block, /dev/zero never ends), at most MAX_TRACE_BYTES of it (decompressed) before
`max_requests` stops the read, and at most MAX_LINE_BYTES per line; JSON nested too deeply
or with integers too long for Python is a TraceError like any other; input_length is at most
MAX_INPUT_LENGTH tokens (the published traces peak near 128K; tokens() materializes the whole
prompt), output_length at most MAX_OUTPUT_LENGTH, hash ids below 2**63 and timestamps at most
MAX_TIMESTAMP_MS. The published traces are a few MB with lines of at most tens of KB.

(`python -m dualpath.workload.mooncake` prints a runpy RuntimeWarning because the package's
__init__ imports this module before runpy runs it as __main__: the module then exists twice, with
two TraceError classes. main() only uses its own copy, so the warning is harmless; the fix is a
lazy import in dualpath/workload/__init__.py, which is not this module's to change.)
"""
from __future__ import annotations

import gzip
import json
import math
import os
import stat
import sys
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .trajectories import DEFAULT_VOCAB, RESERVED_TOKENS, Trajectory, Turn

MOONCAKE_BLOCK = 512  # tokens per hash id in the published Mooncake traces
MAX_TRACE_BYTES = 256 << 20
MAX_LINE_BYTES = 1 << 20
MAX_INPUT_LENGTH = 1 << 21  # tokens of one prompt (2M; published traces peak near 128K)
MAX_OUTPUT_LENGTH = 1 << 20
MAX_TIMESTAMP_MS = 1e12  # about 31 years
MAX_HASH_ID = (1 << 63) - 1
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
    trace_input_length: int = 0  # input_length as the trace gives it (unscaled)
    full_blocks: int = 0  # leading hash ids that cover a whole trace block (the partial tail's does not)

    @property
    def full_ids(self) -> tuple[int, ...]:
        """The ids of the prompt's full trace blocks: what a continuation of it begins with."""
        return self.hash_ids[:self.full_blocks]

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
    if isinstance(v, str):
        s = repr(v[:61])
    elif isinstance(v, (list, dict)):
        s = json.dumps(v[:12] if isinstance(v, list) else dict(list(v.items())[:6]))
        s = s[:57] + "..." if len(s) > 60 or len(v) > 12 else s  # never the whole value
    else:
        s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def parse_line(text: str, *, path: str | Path = "<trace>", line: int = 1) -> dict:
    """Validate one trace line; returns the four fields. Raises TraceError."""
    if len(text) > MAX_LINE_BYTES:
        raise TraceError(path, line, None, f"line longer than {MAX_LINE_BYTES} characters; not a trace line")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(path, line, None, f"not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise TraceError(path, line, None, "not a trace line: JSON nested too deeply") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise TraceError(path, line, None, f"not a trace line: {str(e)[:80]}") from None
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
    if ts > MAX_TIMESTAMP_MS:
        raise TraceError(path, line, "timestamp", f"must be at most {MAX_TIMESTAMP_MS:g} ms, got {_short(ts)}")
    for f, least, most in (("input_length", 1, MAX_INPUT_LENGTH), ("output_length", 0, MAX_OUTPUT_LENGTH)):
        v = obj[f]
        if not _is_int(v):
            raise TraceError(path, line, f, f"expected an integer, got {_short(v)}")
        if v < least:
            raise TraceError(path, line, f, f"must be >= {least}, got {v}")
        if v > most:
            raise TraceError(path, line, f, f"must be at most {most} tokens, got {_short(v)}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise TraceError(path, line, "hash_ids", f"expected a list of integers, got {_short(ids)}")
    for k, h in enumerate(ids):
        if not _is_int(h) or not 0 <= h <= MAX_HASH_ID:
            raise TraceError(path, line, "hash_ids", f"entry {k} must be an integer in [0, 2**63), got {_short(h)}")
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
    if max_requests is not None and (not _is_int(max_requests) or max_requests < 0):
        raise ValueError(f"max_requests must be a non-negative integer, got {max_requests!r}")
    out: list[TraceRequest] = []
    for lineno, bline in _lines(path):
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
        n_scaled = math.ceil(n_in / scale)
        if n_in % trace_block and n_scaled % block_tokens == 0:
            n_scaled = max(1, n_scaled - 1)  # the tail stays a partial block, as in the trace
        out.append(TraceRequest(
            index=len(out), line=lineno, arrival_s=rec["timestamp"] / 1000.0,
            input_length=n_scaled, output_length=math.ceil(rec["output_length"] / scale),
            hash_ids=tuple(ids), block_tokens=block_tokens, vocab_size=vocab_size, salt=salt,
            trace_input_length=n_in, full_blocks=min(len(ids), n_in // trace_block)))
    return out


def _lines(path: str | Path) -> Iterable[tuple[int, bytes]]:
    """(line number, line without its newline) of a regular file, bounded in bytes per line and
    in all; read lazily, so max_requests stops the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        raise TraceError(path, None, None, f"cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise TraceError(path, None, None, f"cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device or other"
        raise TraceError(path, None, None, f"is {kind}, not a regular file; give the path of a JSONL trace")
    raw = os.fdopen(fd, "rb")
    try:
        gz = raw.read(2) == b"\x1f\x8b"  # gzip's magic: read it decompressed (the total bound applies to that)
        raw.seek(0)
    except OSError as e:
        raw.close()
        raise TraceError(path, None, None, f"cannot read: {e.strerror or e}") from None
    with (gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw) as f, raw:
        total = 0
        lineno = 0
        while True:
            try:
                bline = f.readline(MAX_LINE_BYTES + 2)
            except (OSError, EOFError, zlib.error) as e:  # a truncated or corrupt gzip stream too
                raise TraceError(path, lineno + 1, None, f"cannot read: {getattr(e, 'strerror', None) or e}") from None
            if not bline:
                return
            lineno += 1
            total += len(bline)
            if total > MAX_TRACE_BYTES:
                raise TraceError(path, lineno, None, f"trace larger than {MAX_TRACE_BYTES >> 20} MiB; "
                                 "split it, or read fewer requests (max_requests)")
            body = bline.rstrip(b"\n").rstrip(b"\r")
            if len(body) > MAX_LINE_BYTES:
                raise TraceError(path, lineno, None, f"line longer than {MAX_LINE_BYTES} bytes; not a trace line")
            yield lineno, body


def to_trajectories(requests: Iterable[TraceRequest]) -> list[Trajectory]:
    """One single-turn trajectory per request, empty system prompt, arrival time kept. The
    generation length is max(1, output_length): a request always yields its first token."""
    return [Trajectory(r.index, (), (Turn(r.tokens(), max(1, r.output_length)),), arrival_s=r.arrival_s)
            for r in requests]


def prefix_hit_rate(requests: Sequence[TraceRequest], block_size: int) -> float:
    """Token-weighted hit rate with an infinite store: a request hits the longest run of its
    full `block_size`-token blocks (chained, so by prefix) that an earlier request already had."""
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
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

    def positive(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {text[:40]!r}") from None
        if not 1 <= v <= 1 << 20:
            raise argparse.ArgumentTypeError(f"expected an integer in [1, {1 << 20}], got {v}")
        return v

    def count(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text[:40]!r}") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
        return v

    class OneLineParser(argparse.ArgumentParser):
        def error(self, message: str) -> None:  # type: ignore[override]
            print(f"error: {message}", file=sys.stderr)  # one line, no usage block
            raise SystemExit(2)

    ap = OneLineParser(prog="python -m dualpath.workload.mooncake",
                       description="Validate a Mooncake JSONL trace and print its summary.")
    ap.add_argument("trace")
    ap.add_argument("--scale", type=positive, default=1, help="divide lengths by this (must divide 512)")
    ap.add_argument("--block-size", type=positive, default=16, help="block size for the prefix hit rate")
    ap.add_argument("--max-requests", type=count, default=None)
    a = ap.parse_args(argv)
    try:
        reqs = load_mooncake(a.trace, scale=a.scale, max_requests=a.max_requests)
        out = summary(reqs, a.block_size)
    except (TraceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
