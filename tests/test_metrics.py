"""kvpool.metrics: the snapshot's numbers, their Prometheus exposition, and the lazy import."""

from __future__ import annotations

import subprocess
import sys

from kvpool import BlockTables, KvLayout, Pool
from kvpool.metrics import KvPoolCollector, snapshot
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=4)


def scrape(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_collector_exports_vllm_names_and_live_values() -> None:
    pool = Pool(LAYOUT, 10, device="host", enable_prefix_caching=True)
    tables = BlockTables(pool, 4, 10)
    registry = CollectorRegistry()
    registry.register(
        KvPoolCollector(pool, tables, labels={"model_name": "m"}, preemptions=lambda: 3)
    )
    tables.add_request(1, range(9))
    tables.add_request(2, range(9))
    tables.free(1)
    got = scrape(registry)
    assert got["vllm:prefix_cache_queries_total"] == 18
    assert got["vllm:prefix_cache_hits_total"] == 8
    assert got["vllm:kv_cache_usage_perc"] == 3 / 10  # two shared cached blocks + one of its own
    assert got["vllm:num_requests_running"] == 1
    assert got["vllm:num_preemptions_total"] == 3
    # Request 1's third block (partial, never cached) went back to the free list.
    assert (
        got["kvpool:num_free_blocks"],
        got["kvpool:num_evictable_blocks"],
        got["kvpool:num_used_blocks"],
    ) == (7, 0, 3)
    tables.free(2)
    assert scrape(registry)["kvpool:num_evictable_blocks"] == 2
    tables.add(3, 40)  # every block: evicts the two cached ones
    got = scrape(registry)
    assert got["kvpool:prefix_cache_evictions_total"] == 2
    assert got["vllm:kv_cache_usage_perc"] == 1.0
    text = generate_latest(registry).decode()
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 8.0' in text


def test_snapshot_needs_no_prometheus_and_the_import_is_lazy() -> None:
    pool = Pool(LAYOUT, 4, device="host")
    assert {s.name for s in snapshot(pool)} >= {
        "vllm:kv_cache_usage_perc",
        "kvpool:num_free_blocks",
    }
    code = "import sys, kvpool.metrics; assert 'prometheus_client' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
