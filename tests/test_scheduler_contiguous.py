"""The contiguous baseline's first-fit byte range: fragmentation is real."""

from __future__ import annotations

import pytest
from kvpool.scheduler import ContiguousKv, FirstFit, Request, Scheduler, SchedulerConfig, Seq


def test_first_fit_reuses_and_coalesces_holes():
    ff = FirstFit(100)
    a, b, c = ff.alloc(30), ff.alloc(30), ff.alloc(30)
    assert (a, b, c) == (0, 30, 60)
    ff.free(b, 30)
    assert ff.alloc(20) == 30  # first fit: the hole left by b
    ff.free(30, 20)
    ff.free(a, 30)
    ff.free(c, 30)
    assert (ff.starts, ff.sizes, ff.free_bytes) == ([0], [100], 100)
    ff.check_invariants()
    with pytest.raises(ValueError):
        ff.free(0, 10)  # already free


def test_free_bytes_suffice_but_no_hole_does():
    ff = FirstFit(100)
    regions = [ff.alloc(25) for _ in range(4)]
    ff.free(regions[0], 25)
    ff.free(regions[2], 25)
    assert ff.free_bytes == 50 and ff.largest_hole() == 25
    assert ff.alloc(40) is None  # 50 bytes free, no 40-byte hole
    ff.check_invariants()


def test_contiguous_admission_fails_on_fragmentation():
    # reserve what each request needs ("request" mode): sizes 20, 30, 20, 30 tokens in 100
    token_bytes = 1
    backend = ContiguousKv(100, token_bytes, max_model_len=60, reserve="request")
    requests = [
        Request(0, 0.0, 10, 10),  # [0, 20): finishes first
        Request(1, 0.0, 10, 20),  # [20, 50)
        Request(2, 0.0, 10, 10),  # [50, 70): finishes first
        Request(3, 0.0, 10, 20),  # [70, 100)
        Request(4, 0.1, 30, 10),  # needs 40: 40 bytes free at step 11, in two holes of 20
    ]
    config = SchedulerConfig(max_model_len=60, max_running_seqs=8, max_tokens_per_step=64)
    sched = Scheduler(backend, requests, config, record_events=True)
    for _ in range(1000):  # bounded: a regression must fail, not hang
        if any(e[1] == "finish" and e[2] == 2 for e in sched.events):
            break
        sched.step()
    else:
        pytest.fail("request 2 did not finish within 1000 steps")
    sched.step()
    assert backend.space.free_bytes >= 40 and backend.space.largest_hole() < 40
    assert backend.blocked_by_fragmentation > 0
    assert 4 not in {e[2] for e in sched.events if e[1] == "admit"}
    sched.run()  # once 1 and 3 finish, the holes merge and request 4 is served
    assert all(s.num_finishes == 1 for s in sched.seqs)
    backend.check_drained()


def test_first_fit_rejects_empty_frees_and_checks_without_assert():
    ff = FirstFit(100)
    a = ff.alloc(30)
    with pytest.raises(ValueError, match="nbytes must be > 0"):
        ff.free(a, 0)
    with pytest.raises(ValueError, match="nbytes must be > 0"):
        ff.free(a, -5)
    assert (ff.starts, ff.sizes, ff.free_bytes) == ([30], [70], 70)  # no empty hole was inserted
    ff.check_invariants()
    ff.starts.insert(0, 0)  # corrupt the state (an empty hole): the check raises even under -O
    ff.sizes.insert(0, 0)
    with pytest.raises(AssertionError, match="empty hole"):
        ff.check_invariants()


@pytest.mark.parametrize(
    ("reserve", "expected"),
    [("max_model_len", [64, 64, 64, 64]), ("pow2", [8, 16, 16, 64]), ("request", [5, 9, 16, 40])],
)
def test_reservation_modes(reserve, expected):
    backend = ContiguousKv(10**6, 1, max_model_len=64, reserve=reserve)
    lengths = [(3, 2), (4, 5), (10, 6), (30, 10)]  # prompt + output: 5, 9, 16, 40
    for i, (prompt, output) in enumerate(lengths):
        assert backend.try_admit(Seq(Request(i, 0.0, prompt, output)), prompt, 0)
    assert [tokens for _offset, tokens in backend.regions.values()] == expected
    assert backend.reserved_tokens == sum(expected)


def test_unknown_reservation_mode_is_refused():
    with pytest.raises(ValueError, match="reserve must be one of"):
        ContiguousKv(100, 1, 60, reserve="half")
