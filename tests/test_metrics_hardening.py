"""KvPoolCollector checks its arguments when it is made (it checked none: tables of another
pool were reported beside this pool's blocks, a non-str label failed inside every scrape,
a reserved `__name__` label was emitted)."""

from __future__ import annotations

import pytest
from kvpool import BlockTables, InvalidArgumentError, KvLayout, Pool
from kvpool.metrics import KvPoolCollector
from prometheus_client import CollectorRegistry, generate_latest

LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=4)


@pytest.fixture
def pool() -> Pool:
    return Pool(LAYOUT, 8, device="host")


def test_tables_of_another_pool_are_refused(pool):
    other = Pool(LAYOUT, 8, device="host")
    with pytest.raises(InvalidArgumentError, match="tables belong to another pool"):
        KvPoolCollector(pool, BlockTables(other, 2, 4))
    KvPoolCollector(pool, BlockTables(pool, 2, 4))  # its own tables are fine


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"labels": {"model": 3}}, "labels must map str to str, got str 'model': int"),
        ({"labels": {3: "m"}}, "labels must map str to str, got int 3"),
        ({"labels": [("model", "m")]}, "labels must be a mapping of str to str, got list"),
        ({"preemptions": 5}, "preemptions must be a callable"),
    ],
)
def test_wrong_types_are_type_errors(pool, kwargs, message):
    with pytest.raises(TypeError, match=message):
        KvPoolCollector(pool, **kwargs)


def test_pool_and_tables_must_be_what_they_say(pool):
    with pytest.raises(TypeError, match="pool must be a kvpool.Pool, got str"):
        KvPoolCollector("pool")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tables must be kvpool.BlockTables or None, got Pool"):
        KvPoolCollector(pool, pool)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["__name__", "__meta", "model-name", "0model", "", "mödel"])
def test_label_names_prometheus_refuses_are_refused(pool, name):
    with pytest.raises(InvalidArgumentError, match="is not a Prometheus label name"):
        KvPoolCollector(pool, labels={name: "x"})


def test_valid_labels_are_copied_and_exported(pool):
    labels = {"model_name": "m", "_shard": "0"}
    collector = KvPoolCollector(pool, labels=labels)
    labels["model_name"] = "changed later"
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'kvpool:num_blocks{_shard="0",model_name="m"} 8.0' in text
