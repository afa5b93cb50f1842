"""Many Python threads share one pool. Batches of >= 64 blocks release the GIL, so the
lock-free free list really runs concurrently. Each thread's choices are seeded (no timing in
the assertions); the interleaving is whatever the scheduler makes of it."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
from kvpool import KvLayout, OutOfBlocksError, Pool

LAYOUT = KvLayout(1, 1, 64, 4, dtype="float32")  # 2 KiB blocks
NUM_THREADS = 8
STEPS = 400


class Ledger:
    """Ids currently held by any thread. The lock is the test's, not the pool's."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner: dict[int, int] = {}
        self.errors: list[str] = []

    def take(self, thread: int, ids: list[int]) -> None:
        with self.lock:
            for i in ids:
                if i in self.owner:
                    self.errors.append(
                        f"thread {thread} got block {i}, held by thread {self.owner[i]}"
                    )
                self.owner[i] = thread

    def give_back(self, thread: int, ids: list[int]) -> None:
        # Called before the pool frees them, so nobody can be handed them while still listed.
        with self.lock:
            for i in ids:
                if self.owner.pop(i, None) != thread:
                    self.errors.append(f"thread {thread} returned block {i} it did not hold")


def worker(
    pool: Pool, ledger: Ledger, thread: int, start: threading.Barrier, failures: list[BaseException]
) -> None:
    rng = random.Random(1000 + thread)
    held: list[int] = []
    try:
        start.wait()
        for _ in range(STEPS):
            action = rng.random()
            try:
                if action < 0.35:
                    ids = pool.alloc_many(rng.choice((64, 96, 128))).tolist()
                    ledger.take(thread, ids)
                    held.extend(ids)
                elif action < 0.45:
                    i = pool.alloc()
                    ledger.take(thread, [i])
                    held.append(i)
                elif action < 0.55:
                    ids = pool.alloc_many(rng.randrange(1, 64)).tolist()
                    ledger.take(thread, ids)
                    held.extend(ids)
            except OutOfBlocksError:
                pass  # other threads hold the rest; nothing was taken
            if action >= 0.55 and held:
                rng.shuffle(held)
                if action < 0.65:
                    batch, held = held[:1], held[1:]
                    ledger.give_back(thread, batch)
                    pool.free(batch[0])
                else:
                    k = min(len(held), rng.choice((64, 100, 1 + rng.randrange(len(held)))))
                    batch, held = held[:k], held[k:]
                    ledger.give_back(thread, batch)
                    pool.free_many(np.asarray(batch, dtype=rng.choice((np.int32, np.int64))))
        ledger.give_back(thread, held)
        pool.free_many(held)
    except BaseException as e:  # reported by the main thread
        failures.append(e)


@pytest.mark.parametrize("num_blocks", [4096, 700])
def test_threads_share_a_pool(num_blocks: int) -> None:
    # 700 blocks for 8 threads: exhaustion (OutOfBlocksError) happens often.
    pool = Pool(LAYOUT, num_blocks, device="host")
    ledger = Ledger()
    failures: list[BaseException] = []
    start = threading.Barrier(NUM_THREADS)
    threads = [
        threading.Thread(target=worker, args=(pool, ledger, t, start, failures), name=f"kvpool-{t}")
        for t in range(NUM_THREADS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not failures, failures
    assert not ledger.errors, ledger.errors[:10]
    assert not ledger.owner
    assert pool.num_free == pool.num_blocks == num_blocks
    assert pool.num_used == 0
    assert 0 < pool.high_water <= num_blocks
    pool.check_invariants()
    # Everything is allocatable again, each id exactly once.
    everything = pool.alloc_many(num_blocks)
    assert sorted(everything.tolist()) == list(range(num_blocks))
    pool.free_many(everything)
    pool.check_invariants()
