"""Byte accounting per read path (DESIGN.md section 7), derived from the paths' hops.

Each path is a list of hops. A hop moves a byte count, written as a linear expression in
    H  hit-token KV bytes of the request (read from the store),
    M  miss-token KV bytes (computed by the PE this turn),
    W  bytes of new Full Blocks the DE writes back,
from a source NIC to a destination NIC: the source counts them as tx, the destination as rx
(direction is always in the NIC owner's view). NICs, as the fabric builds them (testbed/fabric/network.py):

    PE SNIC, PE host port, PE CNIC, DE SNIC, DE host port, DE CNIC, and the storage servers' NICs.

The host port stands for the DRAM side of a node's CNICs (DESIGN.md section 3): a DRAM-buffer
read toward an engine is host-port tx then CNIC rx; an SNIC writes into DRAM without crossing it.

    PE path:  store -> PE SNIC (H); PE host port -> PE CNIC (H, per-layer H2D);
              PE CNIC -> DE host port (H+M, RDMA WRITE to the DE buffer);
              DE host port -> DE CNIC (H+M, H2D into DE HBM).
    DE path:  store -> DE SNIC (H); DE host port -> PE CNIC (H, RDMA READ of hit KV);
              PE CNIC -> DE host port (M, only the miss KV goes back);
              DE host port -> DE CNIC (H+M, H2D into DE HBM).
    write-back: DE CNIC -> DE host port (W, D2H); DE SNIC -> store (W).
    basic and layerwise move the PE path's bytes; oracle moves nothing (not even the write-back:
    "all I/O skipped"). split reads Hp of the hit bytes on the PE path and Hd = H - Hp on the DE
    path: PE path(Hp, M) + DE path(Hd, 0), i.e. the miss KV travels once, with the PE part.
    chunked prefill adds, on any path, R: the past KV (hits and earlier chunks) that each later
    chunk READs back from the DE buffer: DE host port -> PE CNIC (R). And the decode engine reads
    again, DE host port -> DE CNIC (Rd), the layers whose CRC showed a WRITE not yet applied.

Summing the hops per (NIC, direction) gives DESIGN.md's table; tests/test_accounting.py holds the
table as independent expectations. `expected_totals` maps per-request records onto the concrete
NICs of a run and `compare` checks measured kernel counters against them.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Mapping, NamedTuple, Sequence

DIRECTIONS = ("tx", "rx")


class Nic(Enum):
    """A NIC role in one request's transfer. value = (side, kind as in testbed.fabric.network.Nic.kind)."""

    PE_SNIC = ("pe", "snic")
    PE_HOST = ("pe", "host_port")
    PE_CNIC = ("pe", "cnic")
    DE_SNIC = ("de", "snic")
    DE_HOST = ("de", "host_port")
    DE_CNIC = ("de", "cnic")
    STORAGE = ("storage", "storage_nic")

    @property
    def side(self) -> str:
        return self.value[0]

    @property
    def kind(self) -> str:
        return self.value[1]

    @property
    def label(self) -> str:
        kind = {"snic": "SNIC", "host_port": "host port", "cnic": "CNIC", "storage_nic": "NIC"}[self.kind]
        return f"{self.side.upper() if self.side != 'storage' else 'storage'} {kind}"


NODE_NICS = tuple(n for n in Nic if n is not Nic.STORAGE)


# --------------------------------------------------------------------------- byte expressions


@dataclass(frozen=True)
class Bytes:
    """A linear expression over named byte variables: sum(coef * var)."""

    terms: tuple[tuple[str, int], ...] = ()  # sorted, no zero coefficients

    @staticmethod
    def var(name: str) -> "Bytes":
        return Bytes(((name, 1),))

    @staticmethod
    def _norm(d: Mapping[str, int]) -> "Bytes":
        return Bytes(tuple(sorted((k, v) for k, v in d.items() if v)))

    def __add__(self, other: "Bytes") -> "Bytes":
        d = dict(self.terms)
        for k, v in other.terms:
            d[k] = d.get(k, 0) + v
        return Bytes._norm(d)

    def __rmul__(self, k: int) -> "Bytes":
        return Bytes._norm({n: k * v for n, v in self.terms})

    def subst(self, **repl: "Bytes | int") -> "Bytes":
        """Replace variables by expressions (or 0)."""
        out = Bytes()
        for n, v in self.terms:
            r = repl.get(n, Bytes.var(n))
            if isinstance(r, int):
                if r != 0:
                    raise ValueError("only 0 may replace a variable by a number")
                continue
            out = out + v * r
        return out

    def __call__(self, **values: int) -> int:
        missing = [n for n, _ in self.terms if n not in values]
        if missing:
            raise ValueError(f"no value for {', '.join(missing)} in {self}")
        return sum(v * values[n] for n, v in self.terms)

    @property
    def is_zero(self) -> bool:
        return not self.terms

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        order = {"H": 0, "Hp": 1, "Hd": 2, "M": 3, "W": 4, "R": 5, "Rd": 6}
        parts = [(f"{v}{n}" if v != 1 else n) for n, v in sorted(self.terms, key=lambda t: order.get(t[0], 9))]
        return "+".join(parts).replace("+-", "-")


H, M, W = Bytes.var("H"), Bytes.var("M"), Bytes.var("W")
Hp, Hd = Bytes.var("Hp"), Bytes.var("Hd")


@dataclass(frozen=True)
class Hop:
    bytes: Bytes
    src: Nic
    dst: Nic
    what: str

    def subst(self, **repl) -> "Hop":
        return Hop(self.bytes.subst(**repl), self.src, self.dst, self.what)


# --------------------------------------------------------------------------- the paths

PE_PATH = (
    Hop(H, Nic.STORAGE, Nic.PE_SNIC, "hit Full Blocks from the store into the PE buffer"),
    Hop(H, Nic.PE_HOST, Nic.PE_CNIC, "per layer, H2D of hit KV from the PE buffer into PE HBM"),
    Hop(H + M, Nic.PE_CNIC, Nic.DE_HOST, "per layer, RDMA WRITE of hit and miss KV to the DE buffer"),
    Hop(H + M, Nic.DE_HOST, Nic.DE_CNIC, "H2D of the whole prompt KV into DE HBM"),
)
DE_PATH = (
    Hop(H, Nic.STORAGE, Nic.DE_SNIC, "hit Full Blocks from the store into the DE buffer"),
    Hop(H, Nic.DE_HOST, Nic.PE_CNIC, "per layer, RDMA READ of hit KV from the DE buffer into PE HBM"),
    Hop(M, Nic.PE_CNIC, Nic.DE_HOST, "per layer, only the miss KV back to the DE buffer (merged there)"),
    Hop(H + M, Nic.DE_HOST, Nic.DE_CNIC, "H2D of the whole prompt KV into DE HBM"),
)
REREADS = (
    Hop(Bytes.var("R"), Nic.DE_HOST, Nic.PE_CNIC, "chunked prefill: a later chunk READs its past KV from the DE buffer"),
    Hop(Bytes.var("Rd"), Nic.DE_HOST, Nic.DE_CNIC, "decode: layers READ again until their CRC matches"),
)
WRITEBACK = (
    Hop(W, Nic.DE_CNIC, Nic.DE_HOST, "D2H of each new Full Block into the DE buffer"),
    Hop(W, Nic.DE_SNIC, Nic.STORAGE, "the new Full Blocks to the store"),
)
SPLIT_PATH = tuple(
    h for h in (*(x.subst(H=Hp) for x in PE_PATH), *(x.subst(H=Hd, M=0) for x in DE_PATH))
    if not h.bytes.is_zero
)

PATHS: dict[str, tuple[Hop, ...]] = {
    "pe": PE_PATH,
    "de": DE_PATH,
    "split": SPLIT_PATH,
    "basic": PE_PATH,  # PE reads only, all layers up front: same bytes, different timing
    "layerwise": PE_PATH,
    "oracle": (),
    "writeback": WRITEBACK,
    "rereads": REREADS,
}


def _name(path) -> str:
    name = getattr(path, "value", path)  # accepts dualpath.scheduler.ReadPath
    if name not in PATHS:
        raise ValueError(f"unknown path {path!r}; known: {', '.join(PATHS)}")
    return name


def hops(path) -> tuple[Hop, ...]:
    return PATHS[_name(path)]


def symbolic(path) -> dict[tuple[Nic, str], Bytes]:
    """Per (NIC, direction) byte expression of a path, summed over its hops (zeros included)."""
    out = {(n, d): Bytes() for n in Nic for d in DIRECTIONS}
    for h in hops(path):
        out[(h.src, "tx")] = out[(h.src, "tx")] + h.bytes
        out[(h.dst, "rx")] = out[(h.dst, "rx")] + h.bytes
    return out


def expected_bytes(path, H: int = 0, M: int = 0, W: int = 0, *, h_pe: int | None = None,
                   R: int = 0, Rd: int = 0) -> dict[tuple[Nic, str], int]:
    """Bytes each NIC sends (tx) and receives (rx) for one transfer of the given path, every
    (NIC, direction) present. W only matters for "writeback", R and Rd for "rereads"; h_pe
    (hit bytes read on the PE side) only for "split"."""
    name = _name(path)
    if min(H, M, W, R, Rd) < 0:
        raise ValueError("byte counts must be >= 0")
    values = {"H": H, "M": M, "W": W, "R": R, "Rd": Rd}
    if name == "split":
        if h_pe is None or not 0 <= h_pe <= H:
            raise ValueError(f"split needs 0 <= h_pe <= H, got h_pe={h_pe!r}, H={H}")
        values.update(Hp=h_pe, Hd=H - h_pe)
    return {k: e(**values) for k, e in symbolic(name).items()}


def table(path) -> list[str]:
    """Human-readable lines 'PE CNIC tx: H+M' for the non-zero entries of a path."""
    return [f"{n.label} {d}: {e}" for (n, d), e in symbolic(path).items() if not e.is_zero]


# --------------------------------------------------------------------------- per-run totals


@dataclass(frozen=True)
class RequestBytes:
    """One request's transfer as a run records it."""

    path: str  # "pe", "de", "split", "basic", "layerwise" or "oracle"
    H: int  # hit KV bytes
    M: int  # miss KV bytes
    W: int  # new Full Block bytes written back by the DE (skipped under "oracle")
    pe_node: str  # e.g. "dpt-p0"
    de_node: str  # e.g. "dpt-d0"
    pe_engine: str | None = None  # e.g. "dpt-p0e1": key CNIC bytes by engine instead of node
    de_engine: str | None = None
    h_pe: int | None = None  # split only: hit bytes read on the PE side
    R: int = 0  # chunked prefill: past KV bytes later chunks read back from the DE buffer
    Rd: int = 0  # bytes the decode engine read again (a WRITE not yet applied when it first read)


STORAGE_OWNER = "storage"  # all storage servers together (blocks are striped over them)


def request_bytes(r: RequestBytes) -> dict[tuple[Nic, str], int]:
    """The request's path bytes plus its write-back (none under oracle)."""
    name = _name(r.path)
    if name in ("writeback", "rereads"):
        raise ValueError("a request's path is its read path; write-back and re-reads are added from W, R and Rd")
    out = expected_bytes(name, r.H, r.M, h_pe=r.h_pe)
    if name != "oracle":
        for k, v in expected_bytes("writeback", W=r.W).items():
            out[k] += v
        for k, v in expected_bytes("rereads", R=r.R, Rd=r.Rd).items():
            out[k] += v
    return out


def expected_totals(records: Iterable[RequestBytes | Sequence], *,
                    storage_owner: str = STORAGE_OWNER) -> dict[tuple[str, str, str], int]:
    """Sum records onto concrete NICs: keys (owner, kind, direction), e.g. ("dpt-p0", "snic", "rx").

    owner is the node for SNIC and host port; for the CNIC the engine when the record names it,
    else the node (then the value is summed over the node's engines); `storage_owner` for the
    storage servers' NICs together. Every NIC of each node in its role appears, zeros included,
    so stray traffic on a NIC that should be silent shows up in `compare`. Records may be
    RequestBytes or tuples (path, H, M, W, pe_node, de_node).
    """
    out: dict[tuple[str, str, str], int] = {}
    for r in records:
        if not isinstance(r, RequestBytes):
            r = RequestBytes(*r)
        owners = {
            "pe": r.pe_node, "de": r.de_node, "storage": storage_owner,
        }
        for (nic, d), v in request_bytes(r).items():
            owner = owners[nic.side]
            if nic.kind == "cnic":
                owner = (r.pe_engine if nic.side == "pe" else r.de_engine) or owner
            key = (owner, nic.kind, d)
            out[key] = out.get(key, 0) + v
    return out


class CompareRow(NamedTuple):
    nic: object  # the key without its direction: a Nic, or (owner, kind)
    direction: str
    expected: int
    measured: int
    ratio: float  # measured / expected (1.0 when both are 0, inf when only expected is 0)
    ok: bool


def compare(expected: Mapping[tuple, int], measured: Mapping[tuple, int], tolerance: float = 0.02,
            abs_tolerance: int = 0) -> list[CompareRow]:
    """Rows for every key of either mapping (a key missing from one side counts as 0).

    ok when |measured - expected| <= tolerance * expected + abs_tolerance; abs_tolerance covers
    NICs expected to be silent that carry a little other traffic (control, headers).
    """
    if tolerance < 0 or abs_tolerance < 0:
        raise ValueError("tolerances must be >= 0")
    rows = []
    keys = list(expected) + [k for k in measured if k not in expected]
    for k in keys:
        e, m = int(expected.get(k, 0)), int(measured.get(k, 0))
        ratio = m / e if e else (1.0 if m == 0 else float("inf"))
        nic = k[0] if len(k) == 2 else tuple(k[:-1])
        rows.append(CompareRow(nic, k[-1], e, m, ratio, abs(m - e) <= tolerance * e + abs_tolerance))
    return rows


def format_compare(rows: Iterable[CompareRow]) -> str:
    lines = [f"{'nic':<28} {'dir':<3} {'expected':>14} {'measured':>14} {'ratio':>7}  ok"]
    for r in rows:
        nic = r.nic.label if isinstance(r.nic, Nic) else "/".join(map(str, r.nic))
        lines.append(f"{nic:<28} {r.direction:<3} {r.expected:>14} {r.measured:>14} {r.ratio:>7.3f}  "
                     f"{'yes' if r.ok else 'NO'}")
    return "\n".join(lines)
