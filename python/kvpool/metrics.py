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

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvpool._core import BlockTables, InvalidArgumentError, Pool

# Prometheus label names; those starting with "__" are reserved for Prometheus itself.
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


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
    scrape reads the live counters. ``labels`` are added to every sample.

    Everything is checked here, not at the first scrape: a wrong type raises TypeError;
    tables of another pool, or a label name Prometheus does not accept (reserved ``__``
    names included), raise InvalidArgumentError."""

    def __init__(
        self,
        pool: Pool,
        tables: BlockTables | None = None,
        *,
        labels: Mapping[str, str] | None = None,
        preemptions: Callable[[], int] | None = None,
    ) -> None:
        if not isinstance(pool, Pool):
            raise TypeError(f"pool must be a kvpool.Pool, got {type(pool).__name__}")
        if tables is not None:
            if not isinstance(tables, BlockTables):
                raise TypeError(
                    f"tables must be kvpool.BlockTables or None, got {type(tables).__name__}"
                )
            if tables.pool is not pool:
                raise InvalidArgumentError(
                    "tables belong to another pool: their requests would be reported "
                    "beside this pool's blocks"
                )
        if preemptions is not None and not callable(preemptions):
            raise TypeError(
                f"preemptions must be a callable returning an int, got {type(preemptions).__name__}"
            )
        self.labels = _checked_labels(labels)
        try:
            from prometheus_client import core
        except ImportError as e:
            raise ImportError(
                "kvpool.metrics needs prometheus-client: pip install 'kvpool[metrics]'"
            ) from e
        self._core = core
        self.pool, self.tables, self.preemptions = pool, tables, preemptions

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


def _checked_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    """A copy of `labels` once every name and value is one Prometheus accepts."""
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise TypeError(f"labels must be a mapping of str to str, got {type(labels).__name__}")
    out = dict(labels)
    for name, value in out.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(
                f"labels must map str to str, got {type(name).__name__} {name!r}: "
                f"{type(value).__name__}"
            )
        if not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise InvalidArgumentError(
                f"label name {name!r} is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*, "
                "not starting with '__', which Prometheus reserves)"
            )
    return out
