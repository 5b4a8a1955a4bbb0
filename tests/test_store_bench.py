"""The store-vs-fio benchmark runs end to end (tiny sizes; no throughput assertion)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from testbed.calibrate.benches.store_fio import FIO, bench_store_vs_fio


@pytest.mark.skipif(not os.access(FIO, os.X_OK), reason="fio not installed")
def test_bench_reports_both_sides_and_cleans_up(tmp_path: Path):
    res = bench_store_vs_fio(tmp_path, total_bytes=16 << 20, block_bytes=256 << 10, repeats=1, buffer_bytes=8 << 20, timeout_s=120)
    for k in ("store_cold_gbps", "fio_direct_gbps", "store_warm_gbps", "fio_buffered_gbps"):
        assert res[k] > 0, k
    assert res["ratio"] == pytest.approx(res["store_cold_gbps"] / res["fio_direct_gbps"], rel=0.05)
    assert list(tmp_path.iterdir()) == []  # servers, blocks and fio's file are gone
