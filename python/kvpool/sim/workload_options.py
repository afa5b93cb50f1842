"""The workload of `kvpool simulate` from its parsed options (after the CLI checked them):
the requests, with token ids, and the report's description of them."""

from __future__ import annotations

import argparse
import math
from typing import Any

from kvpool.scheduler.request import Request
from kvpool.sim.sharing import (
    DEFAULT_THINK_TIME_S,
    MULTITURN,
    generate_multiturn,
    with_token_streams,
)
from kvpool.sim.traces import read_trace
from kvpool.sim.workload import generate


def synthetic_workload(args: argparse.Namespace) -> tuple[list[Request], dict[str, Any]]:
    common = dict(
        seed=args.seed,
        rate=args.rate,
        arrival=args.arrival,
        burst_size=args.burst_size,
        max_model_len=args.max_model_len,
        num_prefixes=args.num_prefixes,
        prefix_tokens=args.prefix_tokens,
    )
    info: dict[str, Any] = {
        "kind": args.workload,
        "seed": args.seed,
        "arrival": args.arrival if args.rate else "all at t=0",
        "rate_per_s": args.rate if args.rate else math.inf,
        "num_prefixes": args.num_prefixes,
        "prefix_tokens": args.prefix_tokens,
    }
    if args.workload == MULTITURN:
        think = DEFAULT_THINK_TIME_S if args.think_time is None else args.think_time
        requests = generate_multiturn(
            args.num_requests, turns=args.turns, think_time_s=think, **common
        )
        info.update(
            turns=args.turns,
            think_time_s=think,
            conversations=len({r.conversation_id for r in requests}),
            turn_arrivals="open loop: a conversation starts at an arrival of the rate process, "
            "each later turn a think time after the one before",
        )
    else:
        requests = with_token_streams(
            generate(args.workload, args.num_requests, **common), args.seed
        )
    if args.rate and args.arrival == "burst":
        info["burst_size"] = args.burst_size
    return requests, info


def trace_workload(args: argparse.Namespace) -> tuple[list[Request], dict[str, Any]]:
    requests, read = read_trace(
        args.trace, args.trace_format or "auto", args.max_model_len, think_time_s=args.think_time
    )
    info: dict[str, Any] = {
        "kind": "trace",
        "trace": str(args.trace),
        "trace_format": read.format,
        "skipped_too_long": read.skipped_too_long,
        "skipped_failed": read.skipped_failed,
    }
    return requests, info
