"""Pool, block-table and prefix-cache metrics, exportable to Prometheus.

``snapshot(pool, tables)`` returns the numbers as a plain list (no dependency).
``KvPoolCollector`` exposes them to ``prometheus_client`` (the optional ``metrics`` extra:
``pip install 'kvpool[metrics]'``), which is imported only when a collector is made::

    from prometheus_client import REGISTRY
    from kvpool.metrics import KvPoolCollector

    REGISTRY.register(KvPoolCollector(pool, tables, labels={"model_name": "llama-3-8b"}))

Names follow vLLM where vLLM has the metric (``vllm:kv_cache_usage_perc``,
``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``, ``vllm:num_preemptions``,
``vllm:num_requests_running``), so existing dashboards work; the rest are ``kvpool:``.
Counters are exported with the ``_total`` suffix, as ``prometheus_client`` (and vLLM) do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvpool._core import BlockTables, Pool


@dataclass(frozen=True)
class Sample:
    name: str
    kind: Literal["gauge", "counter"]
    documentation: str
    value: float


def snapshot(
    pool: Pool, tables: BlockTables | None = None, *, preemptions: Callable[[], int] | None = None
) -> list[Sample]:
    """Every metric's current value. `preemptions` returns the scheduler's preemption count
    (kvpool's tables never preempt: the scheduler does)."""
    stats = pool.stats()
    cache = pool.prefix_cache_stats()
    num_blocks = int(stats["num_blocks"])
    samples = [
        Sample(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage: fraction of blocks referenced (1 = full).",
            int(stats["num_used"]) / num_blocks if num_blocks else 0.0,
        ),
        Sample(
            "vllm:prefix_cache_queries",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            cache["queries"],
        ),
        Sample(
            "vllm:prefix_cache_hits",
            "counter",
            "Prompt tokens found in the prefix cache.",
            cache["hits"],
        ),
        Sample("kvpool:num_blocks", "gauge", "Blocks in the pool.", num_blocks),
        Sample(
            "kvpool:num_free_blocks", "gauge", "Blocks on the free list.", int(stats["num_free"])
        ),
        Sample(
            "kvpool:num_evictable_blocks",
            "gauge",
            "Cached blocks nobody references.",
            int(stats["num_evictable"]),
        ),
        Sample(
            "kvpool:num_used_blocks",
            "gauge",
            "Blocks referenced by requests.",
            int(stats["num_used"]),
        ),
        Sample(
            "kvpool:high_water_blocks",
            "gauge",
            "Most blocks referenced at once (evictable cached blocks count as free).",
            int(stats["high_water"]),
        ),
        Sample(
            "kvpool:mapped_bytes",
            "gauge",
            "Bytes of KV memory the pool holds.",
            int(stats["mapped_bytes"]),
        ),
        Sample(
            "kvpool:prefix_cache_cached_blocks",
            "gauge",
            "Blocks in the prefix cache.",
            cache["num_cached_blocks"],
        ),
        Sample(
            "kvpool:prefix_cache_stored_blocks",
            "counter",
            "Blocks that entered the prefix cache.",
            cache["stored_blocks"],
        ),
        Sample(
            "kvpool:prefix_cache_evictions",
            "counter",
            "Cached blocks evicted for reuse.",
            cache["evictions"],
        ),
        Sample("kvpool:prefix_cache_resets", "counter", "Prefix-cache resets.", cache["resets"]),
        Sample(
            "kvpool:prefix_cache_host_cached_blocks",
            "gauge",
            "Blocks in the prefix cache's host tier.",
            cache["host_num_cached_blocks"],
        ),
        Sample(
            "kvpool:prefix_cache_swapped_in_blocks",
            "counter",
            "Cached blocks copied back from the host tier on a hit.",
            cache["swapped_in_blocks"],
        ),
    ]
    if tables is not None:
        samples.append(
            Sample(
                "vllm:num_requests_running", "gauge", "Requests in the block tables.", len(tables)
            )
        )
    if preemptions is not None:
        samples.append(
            Sample("vllm:num_preemptions", "counter", "Preempted requests.", preemptions())
        )
    return samples


class KvPoolCollector:
    """A ``prometheus_client`` collector over one pool (and optionally its tables); every
    scrape reads the live counters. ``labels`` are added to every sample."""

    def __init__(
        self,
        pool: Pool,
        tables: BlockTables | None = None,
        *,
        labels: Mapping[str, str] | None = None,
        preemptions: Callable[[], int] | None = None,
    ) -> None:
        try:
            from prometheus_client import core
        except ImportError as e:
            raise ImportError(
                "kvpool.metrics needs prometheus-client: pip install 'kvpool[metrics]'"
            ) from e
        self._core = core
        self.pool, self.tables, self.preemptions = pool, tables, preemptions
        self.labels = dict(labels or {})

    def collect(self) -> Iterator[Any]:
        names, values = list(self.labels), list(self.labels.values())
        for s in snapshot(self.pool, self.tables, preemptions=self.preemptions):
            family = (
                self._core.GaugeMetricFamily
                if s.kind == "gauge"
                else self._core.CounterMetricFamily
            )
            metric = family(s.name, s.documentation, labels=names)
            metric.add_metric(values, s.value)
            yield metric
