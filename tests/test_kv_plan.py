"""Request planning as pure code: which blocks hit, which buffer each part goes to, what decode writes."""
import pytest
import torch

from dualpath.kv.plan import Route, plan_request
from dualpath.lifecycle.index import StoreIndex
from dualpath.kv.layouts import BlockGeometry
from dualpath.store.keys import chain_keys

G = BlockGeometry(n_layer=4, block_size=16, n_kv_heads=1, head_dim=8, dtype=torch.float32)
NS = b"test"
PROMPT = list(range(4, 4 + 100))  # 6 full blocks and a 4-token tail
KEYS = chain_keys(PROMPT, 16, namespace=NS)


def _plan(path: str, pe_blocks: int, connector: str = "layerwise", n_hit: int = 5, gen_len: int = 30):
    return plan_request("r", PROMPT, gen_len, KEYS, n_hit, Route("p0e0", "d0e0", path, pe_blocks), G, connector,
                        "p0", "d0")


def _hits(prompt: list[int], stored, ns: bytes = NS) -> int:
    return StoreIndex(stored).match(chain_keys(prompt, 16, namespace=ns), len(prompt), 16)


def test_hits_are_the_stored_leading_blocks_and_one_token_always_misses():
    assert _hits(PROMPT, KEYS[:3]) == 3
    assert _hits(PROMPT, {KEYS[0], KEYS[2]}) == 1  # a gap ends the prefix
    assert _hits(PROMPT, KEYS) == 6
    exact = list(range(4, 4 + 96))  # 6 whole blocks: the last must be recomputed for its logits
    assert _hits(exact, chain_keys(exact, 16, namespace=NS)) == 5
    assert _hits(PROMPT, KEYS, b"other") == 0  # another run's blocks never hit


def test_pe_path_reads_every_hit_into_the_pe_buffer_and_forwards_it():
    p = _plan("pe", 5)
    assert [(a.name, a.node, a.blocks) for a in p.areas] == [("de", "d0", 7), ("pe", "p0", 5)]
    assert [(x.node, x.keys, x.area, x.first_block) for x in p.loads] == [("p0", tuple(KEYS[:5]), "pe", 0)]
    assert [(x.area, x.first, x.n) for x in p.past] == [("pe", 0, 80)]
    assert p.forward_past == 80


def test_de_path_reads_into_the_requests_de_area_and_forwards_nothing():
    p = _plan("de", 0)
    assert [a.name for a in p.areas] == ["de"]
    assert [(x.node, x.keys, x.area, x.first_block) for x in p.loads] == [("d0", tuple(KEYS[:5]), "de", 0)]
    assert [(x.area, x.first, x.n) for x in p.past] == [("de", 0, 80)]
    assert p.forward_past == 0


def test_split_reads_the_first_blocks_on_the_pe_side_and_the_rest_at_their_place_on_the_de_side():
    p = _plan("split", 2)
    assert [(x.node, x.keys, x.area, x.first_block) for x in p.loads] == [
        ("p0", tuple(KEYS[:2]), "pe", 0), ("d0", tuple(KEYS[2:5]), "de", 2)]
    assert [(x.area, x.first, x.n) for x in p.past] == [("pe", 0, 32), ("de", 32, 48)]
    assert p.forward_past == 32
    assert [a.blocks for a in p.areas] == [7, 2]


def test_decode_writes_back_every_full_block_after_the_hits():
    p = _plan("de", 0, gen_len=30)
    # KV exists for 100 + 30 - 1 = 129 tokens: 8 full blocks, 5 of them hits
    assert p.first_new_block == 5 and p.writeback.blocks == 3 and p.writeback.node == "d0"
    assert p.writeback_notif(6) == "r/wb6" and p.layer_notifs("/c0", 2) == ["r/c0/L0", "r/c0/L1"]
    assert _plan("de", 0, gen_len=1, n_hit=6).writeback is None  # nothing new fills a block


def test_oracle_moves_nothing_and_cold_prompts_read_nothing():
    p = _plan("pe", 5, connector="oracle")
    assert p.areas == () and p.loads == () and p.past == () and p.writeback is None and not p.moves_kv
    cold = _plan("de", 0, n_hit=0)
    assert cold.loads == () and cold.past == () and [a.name for a in cold.areas] == ["de"]
    assert _plan("pe", 3, n_hit=0).pe_blocks == 0  # a route's PE blocks mean nothing without hits


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="blocks on the PE side"):
        _plan("split", 6)
    with pytest.raises(ValueError, match="unknown read path"):
        _plan("sideways", 0)
    with pytest.raises(ValueError, match="unknown connector"):
        _plan("pe", 5, connector="fast")
