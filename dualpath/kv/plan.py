"""One request's KV plan, as pure code: which blocks hit, where they are read to, what moves.

The lifecycle (dualpath.lifecycle.request) plans every request this way, for the testbed and the
simulator alike. Given the prompt, what the store holds and the scheduler's route (engines, read
path, how many hit blocks each side reads), the plan names every buffer area the request needs,
every load from the store, where each part of the past KV will be when the PE reads it, how many
past rows the PE forwards to the DE, and which Full Blocks decode will write back.

Terms (the README's glossary):
- past tokens: tokens whose KV exists before a pass (`n_past`); for a turn, the stored hits;
- hit blocks: the prompt's leading Full Blocks found in the store (`n_hit_blocks`);
- area: a request's region of a node's DRAM buffer, in Full Blocks, token block b at block b
  (so an area holding blocks from 0 on and one holding blocks from pe_blocks on index alike);
  "de" is the request's area in the DE buffer (the past it reads there, every layer the PE
  writes, decode's source), "pe" the hits read on the PE side, "wb" decode's write-back area.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING


if TYPE_CHECKING:  # annotations only: planning needs block_size and blocks_spanned, not torch
    from dualpath.kv.layouts import BlockGeometry

PATHS = ("pe", "de", "split", "none")
CONNECTORS = ("basic", "layerwise", "oracle")


@dataclass(frozen=True)
class Route:
    """The scheduler's decision for one request."""

    pe: str
    de: str
    path: str  # "pe", "de", "split" or "none"
    pe_blocks: int  # hit blocks read on the PE side; the rest on the DE side
    avoided: str = ""  # a node whose SNIC was down when this was decided (read by the other side)


@dataclass(frozen=True)
class Area:
    name: str  # "de", "pe" or "wb"
    node: str
    blocks: int


@dataclass(frozen=True)
class Load:
    """Hit Full Blocks from the store into an area, from token block `first_block` on."""

    node: str
    keys: tuple[str, ...]
    area: str
    first_block: int


@dataclass(frozen=True)
class Past:
    """Past rows [first, first + n) sit in `area` when the PE reads them."""

    area: str
    first: int
    n: int


@dataclass(frozen=True)
class RequestPlan:
    request: str
    n_prompt: int
    gen_len: int
    n_hit_blocks: int
    block_size: int
    route: Route
    pe_node: str
    de_node: str
    connector: str  # "basic", "layerwise" or "oracle"
    areas: tuple[Area, ...]  # the de and pe areas, needed from the loads to decode's start
    writeback: Area | None  # needed from decode's start to the flush
    loads: tuple[Load, ...]
    past: tuple[Past, ...]
    forward_past: int  # past rows the PE writes to the de area (those it read on its side)

    @property
    def n_hit(self) -> int:
        return self.n_hit_blocks * self.block_size

    @property
    def n_miss(self) -> int:
        return self.n_prompt - self.n_hit

    @property
    def pe_blocks(self) -> int:
        return self.route.pe_blocks if self.n_hit_blocks else 0

    @property
    def moves_kv(self) -> bool:
        return self.connector != "oracle"

    @property
    def first_new_block(self) -> int:
        """Decode writes back Full Blocks from this one on (the earlier ones are stored)."""
        return self.n_hit_blocks

    def layer_notifs(self, tag: str, n_layer: int) -> list[str]:
        """What the PE's pass `tag` notifies the DE buffer's host with, one per layer."""
        return [f"{self.request}{tag}/L{layer}" for layer in range(n_layer)]

    def writeback_notif(self, block: int) -> str:
        return f"{self.request}/wb{block}"


def plan_request(request: str, prompt: list[int], gen_len: int, keys: list[str], n_hit_blocks: int,
                 route: Route, geom: BlockGeometry, connector: str, pe_node: str, de_node: str) -> RequestPlan:
    """The whole plan of one request on `route` (see the module docstring)."""
    if connector not in CONNECTORS:
        raise ValueError(f"unknown connector {connector!r}; expected one of {CONNECTORS}")
    if route.path not in PATHS:
        raise ValueError(f"unknown read path {route.path!r}; expected one of {PATHS}")
    bs = geom.block_size
    pe_blocks = route.pe_blocks if n_hit_blocks else 0
    if not 0 <= pe_blocks <= n_hit_blocks:
        raise ValueError(f"request {request}: {pe_blocks} blocks on the PE side of {n_hit_blocks} hits")
    n_wb = (len(prompt) + gen_len - 1) // bs - n_hit_blocks  # the last token's KV is never computed
    common = dict(request=request, n_prompt=len(prompt), gen_len=gen_len, n_hit_blocks=n_hit_blocks,
                  block_size=bs, route=route, pe_node=pe_node, de_node=de_node, connector=connector)
    if connector == "oracle":  # nothing moves: the past is zeros already in HBM
        return RequestPlan(**common, areas=(), writeback=None, loads=(), past=(), forward_past=0)
    areas = [Area("de", de_node, geom.blocks_spanned(len(prompt)))]  # holds the partial tail block too
    loads, past = [], []
    if pe_blocks:
        areas.append(Area("pe", pe_node, pe_blocks))
        loads.append(Load(pe_node, tuple(keys[:pe_blocks]), "pe", 0))
        past.append(Past("pe", 0, pe_blocks * bs))
    if n_hit_blocks > pe_blocks:
        loads.append(Load(de_node, tuple(keys[pe_blocks:n_hit_blocks]), "de", pe_blocks))
        past.append(Past("de", pe_blocks * bs, (n_hit_blocks - pe_blocks) * bs))
    return RequestPlan(**common, areas=tuple(areas), writeback=Area("wb", de_node, n_wb) if n_wb > 0 else None,
                       loads=tuple(loads), past=tuple(past), forward_past=pe_blocks * bs)
