"""kvpool.KvGroup, ModelKvSpec and HybridTables: what each call returns on a small mixed model,
and every bad input refused with the right class, a message naming what was wrong, and
nothing changed. The state machine over random calls is tests/test_hybrid_state.py."""

from __future__ import annotations

import numpy as np
import pytest
from kvpool import (
    CapacityError,
    DuplicateRequestError,
    HostTierFullError,
    HybridHostTier,
    HybridTables,
    InvalidArgumentError,
    InvalidBlockError,
    KvGroup,
    KvLayout,
    LayoutError,
    ModelKvSpec,
    OutOfBlocksError,
    Pool,
    UnknownRequestError,
    WrongTierError,
)


def pool_for(spec: ModelKvSpec, num_blocks: int, **kwargs: object) -> Pool:
    """A host pool whose blocks are `spec`'s pages (a stand-in layout of that many bytes,
    which also lets the prefix-caching keyword through)."""
    layout = KvLayout(1, 1, spec.page_bytes // 4, 1, "float16")
    return Pool(layout, num_blocks, device="host", **kwargs)


def gpt_oss_like(num_layers: int = 4, window: int = 8) -> ModelKvSpec:
    """Alternating sliding-window and full layers, 1 KV head of 64 fp16 elements."""
    return ModelKvSpec(
        [
            KvGroup.sliding_window(range(0, num_layers, 2), window, 1, 64),
            KvGroup.full(range(1, num_layers, 2), 1, 64),
        ]
    )


def snapshot(tables: HybridTables, request_ids: list[int]) -> object:
    """Everything the tables say about `request_ids`, to compare before and after a refusal."""
    spec = tables.spec
    out = [tables.pool.num_free, len(tables)]
    for r in request_ids:
        if r not in tables:
            out.append((r, None))
            continue
        for g in range(spec.num_groups):
            first, ids, n = tables.table(r, g)
            out.append((r, g, first, ids.tolist(), n))
    return out


# --- KvGroup and ModelKvSpec --------------------------------------------------------------


def test_group_constructors_keep_what_they_are_given():
    g = KvGroup.sliding_window([0, 2], 128, 8, 64, "bfloat16")
    assert (g.kind, g.layers, g.window, g.num_kv_heads, g.head_dim, g.dtype) == (
        "sliding_window",
        (0, 2),
        128,
        8,
        64,
        "bfloat16",
    )
    assert g.chunk is None and g.latent_dim is None and g.bytes_per_layer is None
    assert g.token_bytes == 2 * 2 * 8 * 64 * 2  # layers x K,V x heads x head_dim x elem
    c = KvGroup.chunked_local(np.arange(3), 8192, 8, 128)
    assert (c.kind, c.layers, c.chunk, c.dtype) == ("chunked_local", (0, 1, 2), 8192, "float16")
    m = KvGroup.mla_latent(range(61), dtype="bfloat16")
    assert (m.kind, m.latent_dim, m.rope_dim, m.num_kv_heads) == ("mla_latent", 512, 64, None)
    assert m.token_bytes == 61 * 576 * 2
    s = KvGroup.recurrent_state([np.int64(5)], 1000)
    assert (s.kind, s.layers, s.bytes_per_layer, s.token_bytes, s.dtype) == (
        "recurrent_state",
        (5,),
        1000,
        None,
        None,
    )
    assert KvGroup.full([0, 1], 1, 64) == KvGroup.full(range(2), 1, 64)
    assert hash(KvGroup.full([0, 1], 1, 64)) == hash(KvGroup.full(range(2), 1, 64))
    assert KvGroup.full([0, 1], 1, 64) != KvGroup.full([0, 1], 2, 64)
    assert repr(g) == (
        "KvGroup.sliding_window([0, 2], window=128, num_kv_heads=8, head_dim=64, dtype='bfloat16')"
    )


def test_default_page_bytes_is_16_tokens_of_the_largest_group():
    # gpt-oss-20b: 12 window + 12 full layers of 8 heads x 64, bf16 (hybrid.md's table).
    spec = ModelKvSpec(
        [
            KvGroup.sliding_window(range(0, 24, 2), 128, 8, 64, "bfloat16"),
            KvGroup.full(range(1, 24, 2), 8, 64, "bfloat16"),
        ]
    )
    assert spec.page_bytes == 393_216 and spec.num_layers == 24
    assert spec.block_size(0) == spec.block_size(1) == 16
    # A larger group sets the page; the smaller one gets more tokens per page.
    spec = ModelKvSpec([KvGroup.full([0], 4, 64), KvGroup.full([1], 1, 64)])
    assert spec.page_bytes == 16 * 2 * 4 * 64 * 2
    assert (spec.block_size(0), spec.block_size(1)) == (16, 64)
    # MLA pages hold 64 tokens (DeepSeek-V3: 61 layers x 576 bf16).
    spec = ModelKvSpec([KvGroup.mla_latent(range(61), dtype="bfloat16")])
    assert spec.page_bytes == 4_497_408 and spec.block_size(0) == 64
    # Rounded up to the 256-byte block alignment: one fp8 head of 8 is 16 bytes a token.
    spec = ModelKvSpec([KvGroup.full([0], 1, 8, "float8_e4m3fn")])
    assert spec.page_bytes == 256 and spec.block_size(0) == 16
    # State groups do not set the page beside token groups: the state is split over pages.
    spec = ModelKvSpec([KvGroup.full([0], 1, 64), KvGroup.recurrent_state([1, 2], 10_000)])
    assert spec.page_bytes == 4096
    assert spec.pages_per_slot(1) == 2 * 3 and spec.block_size(1) is None
    assert spec.state_packing(1) == ("pages_per_layer", 3)
    assert spec.pages_per_slot(0) is None and spec.state_packing(0) is None
    # A model of states only: one layer's state a page.
    spec = ModelKvSpec([KvGroup.recurrent_state([0, 1], 1000)])
    assert spec.page_bytes == 1024 and spec.state_packing(0) == ("layers_per_page", 1)


def test_spec_properties_and_geometry():
    spec = ModelKvSpec(
        [
            KvGroup.sliding_window([0, 2], 8, 1, 64),
            KvGroup.full([1], 1, 64),
            KvGroup.recurrent_state([3], 300),
        ],
        page_bytes=8192,
    )
    assert (spec.num_layers, spec.page_bytes, spec.num_groups) == (4, 8192, 3)
    assert [g.kind for g in spec.groups] == ["sliding_window", "full", "recurrent_state"]
    assert (spec.block_size(0), spec.block_size(1)) == (16, 32)
    assert spec.group_of_layer(2) == (0, 1) and spec.group_of_layer(3) == (2, 0)
    assert spec.used_bytes(0) == 8192 and spec.used_bytes(2) == 300
    # 40 tokens, queries from 30 on: the window group keeps tokens 23.. (page 1 on).
    assert spec.live_pages(0, 40, 30) == (1, 3)
    assert spec.live_pages(1, 40, 30) == (0, 2)
    assert spec.live_pages(2, 40, 30) == (0, 1)
    assert spec.pages_to_add(40) == 3 + 2 + 1
    # K of token 3, head 0, dim 1 of the second layer of group 0 in page 5.
    assert spec.attention_offset_bytes(0, 5, 1, "k", 3, 0, 1) == (
        5 * 8192 + 1 * 2 * 16 * 128 + 3 * 128 + 2
    )
    assert spec.attention_offset_bytes(0, 0, 0, "v", 0, 0, 0) == 16 * 128
    assert spec.state_location(2, 0, 299) == (0, 299)
    mla = ModelKvSpec([KvGroup.mla_latent([0, 1], 512, 64)], page_bytes=64 * 2 * 1152)
    assert mla.latent_offset_bytes(0, 0, 1, 0, 0) == 64 * 1152
    assert ModelKvSpec(spec.groups, 8192) == spec
    assert "page_bytes=8192" in repr(spec)


def test_uniform_spec_pages_are_the_layouts_blocks():
    layout = KvLayout(3, 2, 64, 5, "float16")
    spec = ModelKvSpec.uniform(layout)
    assert spec.page_bytes == layout.block_bytes and spec.block_size(0) == 5
    assert spec.num_groups == 1 and spec.groups[0] == KvGroup.full(range(3), 2, 64)


@pytest.mark.parametrize(
    ("groups", "kwargs", "needle"),
    [
        ([KvGroup.full([0], 1, 64), KvGroup.full([2], 1, 64)], {}, "layer 1 is in no group"),
        ([KvGroup.full([0, 1], 1, 64), KvGroup.full([1], 1, 64)], {}, "layer 1 is in group 0"),
        ([KvGroup.full([0], 1, 64)], {"num_layers": 2}, "layer 1 is in no group"),
        ([KvGroup.full([0, 3], 1, 64)], {"num_layers": 2}, "names layer 3"),
        ([], {}, "at least one KV group"),
        ([KvGroup.full([0], 1, 64)], {"page_bytes": 100}, "multiple of 256"),
        ([KvGroup.full([0], 1, 64)], {"page_bytes": 0}, "multiple of 256"),
        ([KvGroup.full([0], 8, 128)], {"page_bytes": 1024}, "more than a page"),
        ([KvGroup.full([0], 1, 64)], {"num_layers": 0}, "num_layers must be positive"),
    ],
)
def test_spec_refuses_layers_not_covered_once_and_bad_pages(groups, kwargs, needle):
    with pytest.raises(LayoutError, match=needle):
        ModelKvSpec(groups, **kwargs)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: KvGroup.sliding_window([0], 0, 1, 64), "window must be positive, got 0"),
        (lambda: KvGroup.chunked_local([0], 0, 1, 64), "chunk must be positive, got 0"),
        (lambda: KvGroup.full([0], 0, 64), "num_kv_heads must be positive"),
        (lambda: KvGroup.full([0], 1, -3), "head_dim must be >= 0, got -3"),
        (lambda: KvGroup.mla_latent([0], latent_dim=0), "latent_dim must be positive"),
        (lambda: KvGroup.recurrent_state([0], 0), "bytes_per_layer must be positive"),
        (lambda: KvGroup.full([], 1, 64), "at least one layer"),
        (lambda: KvGroup.full([0, 1, 0], 1, 64), "layer 0 is listed twice"),
        (lambda: KvGroup.full([0, -1], 1, 64), "item 1: layer -1 is negative"),
        (lambda: KvGroup.full(np.array([2, -1]), 1, 64), "item 1: layer -1 is negative"),
        (lambda: KvGroup.full([0], 1, 64, "int8"), "unsupported dtype"),
    ],
)
def test_group_constructors_refuse_bad_sizes(make, needle):
    with pytest.raises(LayoutError, match=needle):
        make()


@pytest.mark.parametrize(
    "make",
    [
        lambda: KvGroup.full([0], True, 64),
        lambda: KvGroup.full([0], 1.0, 64),
        lambda: KvGroup.full([0], 1, "64"),
        lambda: KvGroup.full([0], 1, 64, 16),
        lambda: KvGroup.full(3, 1, 64),
        lambda: KvGroup.full("01", 1, 64),
        lambda: KvGroup.full([0, None], 1, 64),
        lambda: KvGroup.full([True], 1, 64),
        lambda: KvGroup.full(np.array([0.0]), 1, 64),
        lambda: KvGroup.sliding_window([0], None, 1, 64),
        lambda: KvGroup.recurrent_state([0], 1.5),
        lambda: ModelKvSpec(KvGroup.full([0], 1, 64)),
        lambda: ModelKvSpec([KvGroup.full([0], 1, 64), "full"]),
        lambda: ModelKvSpec("groups"),
        lambda: ModelKvSpec([KvGroup.full([0], 1, 64)], page_bytes=4096.0),
        lambda: ModelKvSpec([KvGroup.full([0], 1, 64)], page_bytes=True),
        lambda: ModelKvSpec.uniform("layout"),
    ],
)
def test_wrong_types_are_type_errors(make):
    with pytest.raises(TypeError):
        make()


def test_spec_queries_refuse_a_group_index_it_does_not_have():
    spec = gpt_oss_like()
    for call in (spec.block_size, spec.pages_per_slot, spec.used_bytes):
        with pytest.raises(InvalidArgumentError, match="group 2 does not exist.*2 groups"):
            call(2)
        with pytest.raises(InvalidArgumentError, match="group must be >= 0, got -1"):
            call(-1)
        with pytest.raises(TypeError):
            call(True)
    with pytest.raises(InvalidArgumentError, match="group 5 does not exist"):
        spec.live_pages(5, 10, 0)
    with pytest.raises(InvalidArgumentError, match="layer 4 is out of range"):
        spec.group_of_layer(4)
    with pytest.raises(InvalidArgumentError, match="part must be 'k' or 'v'"):
        spec.attention_offset_bytes(0, 0, 0, "q", 0, 0, 0)
    with pytest.raises(InvalidArgumentError, match="kv_head 1 is out of range"):
        spec.attention_offset_bytes(0, 0, 0, "k", 0, 1, 0)
    with pytest.raises(InvalidArgumentError, match="not an MLA latent group"):
        spec.latent_offset_bytes(0, 0, 0, 0, 0)
    with pytest.raises(InvalidArgumentError, match="holds tokens, not a state"):
        spec.state_location(1, 0, 0)


# --- HybridTables -------------------------------------------------------------------------


def test_tables_add_append_fork_free():
    spec = gpt_oss_like(window=8)  # 64 tokens a page in both groups (2 layers of 512 bytes)
    assert spec.block_size(0) == spec.block_size(1) == 16
    pool = pool_for(spec, 64)
    t = HybridTables(pool, spec)
    assert t.pool is pool and t.spec == spec and len(t) == 0
    t.add(7, 40)
    assert 7 in t and 8 not in t and "x" not in t and t.num_tokens(7) == 40
    first, ids, n = t.table(7, 0)
    assert (first, n, ids.dtype, len(ids)) == (0, 40, np.int32, 3)
    assert t.num_pages(7) == 6
    # The next call moves the window past what the query at 40 (keys 33..40) does not see.
    copies = t.append_tokens(7, 1)
    assert copies.shape == (0, 3) and copies.dtype == np.int32
    first, window_ids, _ = t.table(7, 0)
    assert (first, len(window_ids)) == (2, 1)
    assert pool.num_used == 1 + 3
    slots = t.slot_mapping(7, 1, [0, 17, 40])
    full_ids = t.table(7, 1)[1]
    assert slots.dtype == np.int64
    assert slots.tolist() == [full_ids[0] * 16, full_ids[1] * 16 + 1, full_ids[2] * 16 + 8]
    assert t.slot_mapping(7, 0, np.array([40])).tolist() == [window_ids[0] * 16 + 8]
    # Fork, then a write to the partly filled shared page copies it first, in each group.
    t.fork(7, 8)
    copies = t.append_tokens(8, 1)
    assert copies.shape == (2, 3)
    assert copies[:, 0].tolist() == [0, 1]
    assert copies[0, 1] == window_ids[0] and copies[1, 1] == full_ids[2]
    assert t.table(8, 0)[1].tolist() == [copies[0, 2]]
    assert t.table(7, 0)[1].tolist() == window_ids.tolist()
    t.check_invariants()
    t.free(7)
    t.free(8)
    t.check_invariants()
    assert pool.num_used == 0 and len(t) == 0


def test_state_slots_and_their_copy_on_write():
    spec = ModelKvSpec([KvGroup.full([0], 1, 64), KvGroup.recurrent_state([1, 2], 5000)])
    assert spec.page_bytes == 4096 and spec.pages_per_slot(1) == 4
    t = HybridTables(pool_for(spec, 32), spec)
    t.add(1, 3)
    slot = t.state_slot(1, 1)
    assert slot.dtype == np.int32 and len(slot) == 4
    first, ids, n = t.table(1, 1)
    assert (first, ids.tolist(), n) == (0, slot.tolist(), 3)
    t.fork(1, 2)
    copies = t.append_tokens(2, 1)
    state_copies = copies[copies[:, 0] == 1]
    assert state_copies[:, 1].tolist() == slot.tolist()
    assert t.state_slot(2, 1).tolist() == state_copies[:, 2].tolist()
    with pytest.raises(InvalidArgumentError, match="holds a state, not tokens"):
        t.slot_mapping(1, 1, [0])
    with pytest.raises(InvalidArgumentError, match="holds tokens, not a state"):
        t.state_slot(1, 0)
    t.check_invariants()


def test_append_tokens_many_is_all_or_none():
    spec = gpt_oss_like(window=8)
    pool = pool_for(spec, 12)
    t = HybridTables(pool, spec)
    t.add(1, 16)
    t.add(2, 16)
    t.fork(2, 3)
    copies = t.append_tokens_many(np.array([1, 3]), [1, 16])
    assert copies.shape == (0, 3)  # whole pages: a new token starts a new page
    assert (t.num_tokens(1), t.num_tokens(3)) == (17, 32)
    t.check_invariants()
    before = snapshot(t, [1, 2, 3])
    for ids, counts, error, needle in [
        ([1, 2], [1, 2000], OutOfBlocksError, "out of blocks"),
        ([1, 9], 1, UnknownRequestError, "unknown request id 9"),
        ([1, 1], 1, InvalidArgumentError, "appears twice"),
        ([1, 2], [1], InvalidArgumentError, "2 request ids but 1 counts"),
        ([1, 2], [1, -1], InvalidArgumentError, "item 1: count must be >= 0, got -1"),
        ([1], [2**64], CapacityError, "item 0: count 18446744073709551616 is past any count"),
    ]:
        with pytest.raises(error, match=needle):
            t.append_tokens_many(ids, counts)
        assert snapshot(t, [1, 2, 3]) == before
    with pytest.raises(TypeError):
        t.append_tokens_many([1, 2], 1.0)
    with pytest.raises(TypeError):
        t.append_tokens_many([1, 2], [True, 1])
    with pytest.raises(TypeError):
        t.append_tokens_many("12", 1)
    assert snapshot(t, [1, 2, 3]) == before
    t.check_invariants()


def test_tables_refuse_a_pool_that_is_not_the_specs():
    spec = gpt_oss_like()
    other = Pool(KvLayout(1, 1, spec.page_bytes // 8, 1), 8, device="host")
    with pytest.raises(LayoutError, match=f"blocks are {spec.page_bytes // 2} bytes.*pages"):
        HybridTables(other, spec)
    # A caching pool is taken (the tables cache prefixes), and one spilling to a host tier.
    assert HybridTables(pool_for(spec, 8, enable_prefix_caching=True), spec).prefix_caching
    spilling = pool_for(spec, 8, enable_prefix_caching=True, prefix_cache_host_blocks=4)
    assert HybridTables(spilling, spec).prefix_caching
    # A state slot of 3 pages does not fit a pool of 2 blocks.
    state = ModelKvSpec([KvGroup.recurrent_state([0], 3 * 1024)], page_bytes=1024)
    with pytest.raises(LayoutError, match="needs 3 pages.*at most 2"):
        HybridTables(pool_for(state, 2), state)
    with pytest.raises(TypeError):
        HybridTables(spec, other)
    with pytest.raises(TypeError):
        HybridTables(other, [spec])


def test_failed_calls_name_what_was_wrong_and_change_nothing():
    spec = gpt_oss_like(window=8)
    pool = pool_for(spec, 8)
    t = HybridTables(pool, spec)
    t.add(1, 20)
    before = snapshot(t, [1, 2])
    refusals = [
        (lambda: t.add(1, 3), DuplicateRequestError, "request id 1 is already present"),
        (lambda: t.add(2, 1000), OutOfBlocksError, "out of blocks"),
        (lambda: t.add(2, -1), InvalidArgumentError, "num_tokens must be >= 0"),
        (lambda: t.add(-2, 1), InvalidArgumentError, "request id -2 is negative"),
        (lambda: t.append_tokens(2, 1), UnknownRequestError, "unknown request id 2"),
        (lambda: t.append_tokens(1, 1000), OutOfBlocksError, "out of blocks"),
        (lambda: t.append_tokens(1, 2**64), CapacityError, "n 18446744073709551616 is past any"),
        (lambda: t.append_tokens(1, 2**63 - 1), OutOfBlocksError, "out of blocks"),
        (lambda: t.fork(2, 3), UnknownRequestError, "unknown request id 2"),
        (lambda: t.fork(1, 1), DuplicateRequestError, "request id 1 is already present"),
        (lambda: t.free(2), UnknownRequestError, "unknown request id 2"),
        (lambda: t.table(1, 2), InvalidArgumentError, "group 2 does not exist"),
        (lambda: t.table(2, 0), UnknownRequestError, "unknown request id 2"),
        (lambda: t.slot_mapping(1, 2, [0]), InvalidArgumentError, "group 2 does not exist"),
        (lambda: t.slot_mapping(1, 1, [20]), InvalidArgumentError, "position 20 is not held"),
        (lambda: t.slot_mapping(1, 1, [-1]), InvalidArgumentError, "position -1 is negative"),
        (lambda: t.state_slot(1, 3), InvalidArgumentError, "group 3 does not exist"),
        (lambda: t.num_tokens(2), UnknownRequestError, "unknown request id 2"),
    ]
    for call, error, needle in refusals:
        with pytest.raises(error, match=needle):
            call()
        assert snapshot(t, [1, 2]) == before
    for call in [
        lambda: t.add(True, 1),
        lambda: t.add(2, 1.0),
        lambda: t.add("2", 1),
        lambda: t.append_tokens(1, None),
        lambda: t.fork(1, 2.0),
        lambda: t.table(1, False),
        lambda: t.slot_mapping(1, 1, 3),
        lambda: t.slot_mapping(1, 1, ["0"]),
        lambda: t.slot_mapping(1, 1, np.array([0.5])),
    ]:
        with pytest.raises(TypeError):
            call()
        assert snapshot(t, [1, 2]) == before
    t.check_invariants()
    # NumPy ints and __index__ objects are ints.
    t.add(np.uint64(2), np.int32(3))
    assert t.num_tokens(np.int64(2)) == 3
    t.check_invariants()


def test_a_growable_pool_grows_for_a_batch():
    spec = gpt_oss_like(window=8)
    layout = KvLayout(1, 1, spec.page_bytes // 4, 1)
    pool = Pool(layout, device="host", growable=True, max_num_blocks=64, initial_num_blocks=4)
    t = HybridTables(pool, spec)
    t.add(1, 16)
    t.add(2, 16)
    t.append_tokens_many([1, 2], 100)
    assert pool.num_blocks >= pool.num_used
    t.check_invariants()
    with pytest.raises(OutOfBlocksError):
        t.append_tokens_many([1, 2], 10_000)
    assert (t.num_tokens(1), t.num_tokens(2)) == (116, 116)
    t.check_invariants()


# --- Pool.for_spec, owner tags and the host tier ------------------------------------------


def test_a_pool_for_a_spec_has_its_pages_and_no_layout():
    spec = gpt_oss_like()
    pool = Pool.for_spec(spec, 16, device="host")
    assert (pool.block_bytes, pool.num_blocks, pool.device) == (spec.page_bytes, 16, "host")
    with pytest.raises(LayoutError, match="pages of a hybrid model"):
        pool.layout  # noqa: B018
    with pytest.raises(LayoutError, match="pages of a hybrid model"):
        pool.k_view(0)
    by_bytes = Pool.for_spec(spec, memory_bytes=4 * spec.page_bytes, device="host")
    assert by_bytes.num_blocks == 4
    grow = Pool.for_spec(spec, growable=True, max_num_blocks=32, device="host")
    t = HybridTables(grow, spec)
    t.add(1, 100)
    assert grow.num_blocks >= grow.num_used > 0
    t.check_invariants()
    with pytest.raises(InvalidArgumentError, match="exactly one of"):
        Pool.for_spec(spec, 4, memory_bytes=4096, device="host")
    with pytest.raises(TypeError):
        Pool.for_spec(KvLayout(1, 1, 64, 16), 4, device="host")
    with pytest.raises(TypeError):
        Pool.for_spec(spec, 4.0, device="host")


def test_table_pages_are_the_tables_own():
    spec = gpt_oss_like()
    pool = Pool.for_spec(spec, 16, device="host")
    t = HybridTables(pool, spec)
    t.add(1, 20)
    page = int(t.table(1, 0)[1][0])
    with pytest.raises(InvalidBlockError, match="held by hybrid tables"):
        pool.free(page)
    with pytest.raises(InvalidBlockError, match="held by hybrid tables"):
        pool.free_many([page])
    assert pool.ref_cnt(page) == 1
    t.check_invariants()


def test_a_swapped_request_comes_back_at_its_page_indices():
    spec = ModelKvSpec(
        [
            KvGroup.sliding_window([0], 8, 1, 64),
            KvGroup.full([1], 1, 64),
            KvGroup.recurrent_state([2], 5000),
        ]
    )
    pool = Pool.for_spec(spec, 32, device="host")
    t = HybridTables(pool, spec)
    tier = HybridHostTier(t, 12)
    assert tier.tables is t and tier.copy_stream is None and tier.pool.num_blocks == 12
    t.add(1, 40)
    t.append_tokens(1, 1)  # the window (keys 33..) keeps its third page only: first_page 2
    before = [t.table(1, g) for g in range(3)]
    assert before[0][0] == 2
    stats = tier.swap_out([1])
    assert stats == {"num_requests": 1, "num_blocks": t_pages(before), "num_copies": 1}
    assert 1 not in t and 1 in tier and tier.location(1) == "host" and len(tier) == 1
    n, next_query, rows = tier.swapped(1)
    assert (n, next_query, rows.shape) == (41, 40, (t_pages(before), 3))
    assert rows[:, :2].tolist() == [[0, 2], [1, 0], [1, 1], [1, 2], [2, 0], [2, 1]]
    assert pool.num_used == 0 and tier.pool.num_used == 6
    tier.check_invariants()
    t.add(2, 200)  # the device pages are reused meanwhile
    t.free(2)
    tier.swap_in([1])
    after = [t.table(1, g) for g in range(3)]
    assert [(f, len(ids), n) for f, ids, n in after] == [(f, len(ids), n) for f, ids, n in before]
    assert tier.location(1) == "device" and tier.request_ids() == []
    tier.check_invariants()
    t.check_invariants()


def t_pages(tables: list[tuple[int, np.ndarray, int]]) -> int:
    return sum(len(ids) for _, ids, _ in tables)


def test_host_tier_refusals_change_nothing():
    spec = gpt_oss_like()
    pool = Pool.for_spec(spec, 16, device="host")
    t = HybridTables(pool, spec)
    tier = HybridHostTier(t, 4)
    t.add(1, 40)  # 3 pages a group
    t.add(2, 10)
    with pytest.raises(HostTierFullError, match="needs 6 host blocks"):
        tier.swap_out([1])
    with pytest.raises(HostTierFullError):
        tier.swap_out([2, 1])
    assert 1 in t and 2 in t and len(tier) == 0 and tier.pool.num_used == 0
    with pytest.raises(WrongTierError, match="device"):
        tier.swap_in([2])
    with pytest.raises(WrongTierError):
        tier.free(2)
    with pytest.raises(UnknownRequestError):
        tier.swap_out([9])
    with pytest.raises(InvalidArgumentError, match="twice"):
        tier.swap_out([2, 2])
    tier.swap_out([2])
    with pytest.raises(WrongTierError, match="host"):
        tier.swap_out([2])
    # A swapped-out id is not free for the tables: adding or forking into it is refused
    # (before, the tables took it and only the swap-in noticed), and nothing changes.
    used = t.pool.num_used
    with pytest.raises(DuplicateRequestError):
        t.add(2, 1)
    with pytest.raises(DuplicateRequestError):
        t.fork(1, 2)
    assert 2 not in t and t.pool.num_used == used and tier.location(2) == "host"
    # A device pool too full for the swap-in.
    t.add(3, 65)  # 5 pages a group: the last 10 free pages
    with pytest.raises(OutOfBlocksError):
        tier.swap_in([2])
    assert tier.location(2) == "host" and 2 not in t
    t.free(3)
    tier.swap_in([2])
    for call in (lambda: tier.swap_out(1), lambda: tier.swap_in(["2"]), lambda: tier.free(1.0)):
        with pytest.raises(TypeError):
            call()
    with pytest.raises(InvalidArgumentError, match="exactly one of"):
        HybridHostTier(t)
    with pytest.raises(TypeError):
        HybridHostTier(pool, 4)
    tier.check_invariants()


def test_threads_share_one_tables():
    """Four threads add, grow and free their own requests through one HybridTables, the long
    calls with the GIL released; every thread is joined and nothing leaks."""
    import threading

    spec = gpt_oss_like(window=8)
    pool = Pool.for_spec(spec, 1024, device="host")
    t = HybridTables(pool, spec)
    errors: list[BaseException] = []

    def work(base: int) -> None:
        try:
            for i in range(20):
                rid = base * 100 + i
                t.add(rid, 1500 if i % 5 == 0 else 30)  # >= 1024 tokens: GIL released
                t.append_tokens(rid, 1)
                t.append_tokens_many([rid], 2)
                t.free(rid)
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(t) == 0 and pool.num_used == 0
    t.check_invariants()


class CallersOwnError(Exception):
    """Raised by the caller's iterables: must reach the caller unchanged."""


def raising_after(*items: object):
    yield from items
    raise CallersOwnError("from the caller's generator")


def test_the_callers_own_exceptions_propagate_and_change_nothing():
    spec = gpt_oss_like()
    pool = Pool.for_spec(spec, 16, device="host")
    t = HybridTables(pool, spec)
    t.add(1, 20)
    before = snapshot(t, [1])
    for call in [
        lambda: KvGroup.full(raising_after(0, 1), 1, 64),
        lambda: ModelKvSpec(raising_after(KvGroup.full([0], 1, 64))),
        lambda: t.append_tokens_many(raising_after(1), 1),
        lambda: t.append_tokens_many([1], raising_after(1)),
        lambda: t.slot_mapping(1, 1, raising_after(0)),
    ]:
        with pytest.raises(CallersOwnError):
            call()
        assert snapshot(t, [1]) == before
