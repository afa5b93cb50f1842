"""The core's edges through the binding: prefix-cache metadata under memory limits (in a
subprocess, so an abort shows as an exit code), a host tier dropped while it holds requests,
its private pool, chunk sizes, the limits errors name, and the tables' check while other
threads use the pool."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading

import kvpool
import pytest
from kvpool import BlockTables, HostTier, KvLayout, Pool

LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=4)  # 1 KiB blocks
BLOCK_BYTES = 1024
MAX_NUM_BLOCKS = 2**31 - 1

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="needs Linux rlimits and /proc"
)


def run_limited(body: str, *, data_limit: int | None = None) -> subprocess.CompletedProcess[str]:
    """Runs `body` in a fresh interpreter, under an RLIMIT_DATA of `data_limit` bytes."""
    prelude = textwrap.dedent(f"""
        import resource
        limit = {data_limit!r}
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        import kvpool
        from kvpool import KvLayout, Pool
        LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=4)
    """)
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@linux_only
def test_a_huge_growable_prefix_caching_pool_with_nothing_mapped_is_made() -> None:
    # The same pool without caching works; with caching, metadata for every block of the
    # capacity used to be allocated (and written) up front: an abort, exit 134.
    done = run_limited("""
        p = Pool(LAYOUT, growable=True, max_num_blocks=2**30, enable_prefix_caching=True, device="host")
        b = p.alloc()
        p.free(b)
        print("made", p.num_blocks)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("made")


@linux_only
def test_an_unbacked_prefix_cache_is_out_of_memory_not_an_abort() -> None:
    # The limit holds the slab (4 GiB of 1 KiB blocks) and the allocator's bookkeeping, not
    # the cache's metadata as well: that used to be an abort (exit 134), after the slab.
    done = run_limited(
        """
        try:
            p = Pool(LAYOUT, 2**22, enable_prefix_caching=True, device="host")
        except kvpool.OutOfMemoryError as e:
            print("refused:", e)
        else:
            print("made", p.num_blocks)
        """,
        data_limit=2**22 * BLOCK_BYTES + 200 * 2**20,
    )
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.startswith(("refused: cannot allocate", "made")), done.stdout


@linux_only
def test_a_growable_prefix_caching_pool_holds_memory_for_what_is_mapped() -> None:
    done = run_limited("""
        def rss():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
        before = rss()
        p = Pool(LAYOUT, growable=True, max_num_blocks=10**7, enable_prefix_caching=True, device="host")
        print(rss() - before)
    """)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) < 64 * 2**20, f"{int(done.stdout) / 2**20:.0f} MiB for 0 mapped blocks"


def tier_holding(request_id: int) -> tuple[Pool, BlockTables, HostTier]:
    pool = Pool(LAYOUT, 16, device="host")
    tables = BlockTables(pool, 4, 4)
    tables.add(request_id, 9)
    tier = HostTier(tables, 8)
    tier.swap_out([request_id])
    return pool, tables, tier


def test_dropping_a_host_tier_frees_the_ids_of_its_swapped_out_requests() -> None:
    pool, tables, tier = tier_holding(5)
    with pytest.raises(kvpool.DuplicateRequestError):
        tables.add(5, 1)
    del tier
    gc.collect()
    with pytest.raises(kvpool.UnknownRequestError):
        tables.free(5)
    tables.add(5, 9)
    tables.check_invariants()
    pool.check_invariants(exact_refs=True)
    assert HostTier(tables, 8).location(5) == "device"


def test_a_host_tiers_pool_refuses_the_plain_block_api() -> None:
    _, _, tier = tier_holding(1)
    free = tier.pool.num_free
    for call in (
        tier.pool.alloc,
        lambda: tier.pool.alloc_many(2),
        lambda: tier.pool.alloc_many(100),
    ):
        with pytest.raises(kvpool.InvalidArgumentError, match="host tier's"):
            call()
    assert tier.pool.num_free == free
    tier.check_invariants()


def test_chunk_bytes_is_capped_at_the_reservation_and_zero_is_refused() -> None:
    p = Pool(
        LAYOUT,
        growable=True,
        max_num_blocks=64,
        initial_num_blocks=1,
        chunk_bytes=2**31,
        device="host",
    )
    assert p.stats()["mapped_bytes"] == 64 * BLOCK_BYTES
    p.check_invariants()
    with pytest.raises(kvpool.InvalidArgumentError, match="chunk_bytes must be at least 1"):
        Pool(LAYOUT, growable=True, max_num_blocks=64, chunk_bytes=0, device="host")


@pytest.mark.parametrize("max_num_blocks", [2**31, 2**40, 2**62])
def test_max_num_blocks_past_the_limit_is_invalid_however_large(max_num_blocks: int) -> None:
    with pytest.raises(
        kvpool.InvalidArgumentError,
        match=rf"1\.\.={MAX_NUM_BLOCKS} \(MAX_NUM_BLOCKS\), got {max_num_blocks}",
    ):
        Pool(LAYOUT, growable=True, max_num_blocks=max_num_blocks, device="host")


@pytest.mark.parametrize("num_blocks", [2**31, 2**63, 2**64, 2**200])
def test_a_pool_too_large_names_max_num_blocks(num_blocks: int) -> None:
    with pytest.raises(kvpool.InvalidArgumentError) as e:
        Pool(LAYOUT, num_blocks, device="host")
    assert "MAX_NUM_BLOCKS" in str(e.value) and str(num_blocks) in str(e.value)
    assert "9223372036854775807" not in str(e.value)


def test_prefix_cache_host_blocks_of_zero_names_its_argument() -> None:
    with pytest.raises(kvpool.InvalidArgumentError, match="prefix_cache_host_blocks must be in 1"):
        Pool(LAYOUT, 8, enable_prefix_caching=True, prefix_cache_host_blocks=0, device="host")


def test_a_growable_pools_refusal_names_the_blocks_asked_for() -> None:
    for caching in (False, True):
        p = Pool(
            LAYOUT,
            growable=True,
            max_num_blocks=64,
            initial_num_blocks=8,
            chunk_bytes=4096,
            enable_prefix_caching=caching,
            device="host",
        )
        assert p.num_blocks == 8
        held = p.alloc_many(40)
        with pytest.raises(kvpool.OutOfBlocksError) as e:
            p.alloc_many(30)
        assert e.value.requested == 30, (caching, str(e.value))
        assert "leaves room for 24 more (40 mapped)" in str(e.value), str(e.value)
        p.free_many(held)
        p.check_invariants()


def test_tables_check_invariants_holds_while_other_threads_use_the_pool() -> None:
    rounds = 1500
    pool = Pool(LAYOUT, 256, device="host")
    checked, other = BlockTables(pool, 8, 8), BlockTables(pool, 8, 8)
    for r in range(4):
        checked.add(r, 9 + r)
    start = threading.Barrier(3)
    errors: list[BaseException] = []

    def raw_alloc_free() -> None:
        start.wait()
        for n in range(rounds):
            pool.free_many(pool.alloc_many(1 + n % 7))

    def other_tables() -> None:
        start.wait()
        for n in range(rounds):
            other.add(n, 1 + n % 13)
            other.free(n)

    def check() -> None:
        start.wait()
        for _ in range(rounds):
            try:
                checked.check_invariants()
            except kvpool.KvError as e:
                errors.append(e)

    threads = [threading.Thread(target=f) for f in (raw_alloc_free, other_tables, check)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"{len(errors)} false alarms, first: {errors[0]}"
    pool.check_invariants(exact_refs=True)
