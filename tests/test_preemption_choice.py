"""The swap-or-recompute choice, on hand-computed cases."""

from __future__ import annotations

import math

import pytest
from kvpool.scheduler.preemption import HostLink, choose_preemption, swap_seconds
from kvpool.sim.costmodel import RooflineCost
from kvpool.sim.presets import get_preset

LINK = HostLink(bytes_per_s=10e9, latency_s=0.0)


def choose(
    mode="auto", *, kv_tokens, swap_bytes=1_000_000, needed=1, free=10, link=LINK, per_token=1e-5
):
    return choose_preemption(
        mode,
        kv_tokens=kv_tokens,
        swap_bytes=swap_bytes,
        host_blocks_needed=needed,
        host_blocks_free=free,
        link=link,
        prefill_s_per_token=per_token,
    )


def test_swap_cost_is_out_and_in():
    # 1e6 bytes at 10 GB/s is 100 us each way; plus 50 us per call.
    assert swap_seconds(1_000_000, HostLink(10e9, 50e-6)) == pytest.approx(2 * (100e-6 + 50e-6))


def test_auto_takes_swap_when_cheaper():
    # swap: 2 x 1e6 / 1e10 = 200 us; recompute: 100 tokens x 10 us = 1000 us.
    c = choose(kv_tokens=100)
    assert (c.kind, c.reason) == ("swap", "cheaper")
    assert c.swap_s == pytest.approx(200e-6) and c.recompute_s == pytest.approx(1000e-6)


def test_auto_takes_recompute_when_cheaper():
    # swap 200 us; recompute: 10 tokens x 10 us = 100 us.
    c = choose(kv_tokens=10)
    assert (c.kind, c.reason) == ("recompute", "cheaper")


def test_latency_tips_the_balance():
    link = HostLink(10e9, 100e-6)  # swap: 2 x (100 + 100) us = 400 us
    assert choose(kv_tokens=39, link=link).kind == "recompute"  # 390 us
    assert choose(kv_tokens=41, link=link).kind == "swap"  # 410 us


def test_a_full_tier_falls_back_to_recompute_in_every_swapping_mode():
    for mode in ("auto", "swap"):
        c = choose(mode, kv_tokens=100, needed=5, free=4)
        assert (c.kind, c.reason) == ("recompute", "tier full")
        assert choose(mode, kv_tokens=100, needed=5, free=5).kind == "swap"  # exactly enough room


def test_forced_modes():
    assert (choose("swap", kv_tokens=1).kind, choose("swap", kv_tokens=1).reason) == (
        "swap",
        "forced",
    )
    c = choose("recompute", kv_tokens=10_000)
    assert (c.kind, c.reason) == ("recompute", "forced")


def test_nothing_to_save_is_recomputed():
    assert (choose("swap", kv_tokens=0).kind, choose("swap", kv_tokens=0).reason) == (
        "recompute",
        "no KV",
    )


def test_llama_3_8b_on_the_h200_link():
    # One 2 MiB block (16 tokens) out and back at 55 GB/s + 15 us per call: 106.3 us; recompute
    # at 2 x 8.03e9 FLOPs per token / (989 TFLOP/s x 0.6): 27.06 us per token.
    preset = get_preset("llama-3-8b")
    per_token = RooflineCost(preset).prefill_seconds(1)
    assert per_token == pytest.approx(2 * 8.03e9 / (989e12 * 0.6))
    block = preset.layout(16).block_bytes
    assert block == 2 * 2**20
    h200 = HostLink()
    assert choose(kv_tokens=3, swap_bytes=block, link=h200, per_token=per_token).kind == "recompute"
    assert choose(kv_tokens=4, swap_bytes=block, link=h200, per_token=per_token).kind == "swap"
    # Below about 9.7 GB/s recompute wins even for a full block.
    slow = HostLink(9e9, 15e-6)
    assert (
        choose(kv_tokens=16, swap_bytes=block, link=slow, per_token=per_token).kind == "recompute"
    )
    assert (
        choose(kv_tokens=16, swap_bytes=block, link=HostLink(10.5e9, 0.0), per_token=per_token).kind
        == "swap"
    )


def test_bad_arguments():
    with pytest.raises(ValueError, match="preemption mode must be one of auto, swap, recompute"):
        choose("sometimes", kv_tokens=1)
    for bandwidth in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="bandwidth"):
            HostLink(bandwidth, 0.0)
    for latency in (-1e-6, math.inf, math.nan):
        with pytest.raises(ValueError, match="latency"):
            HostLink(1e9, latency)
