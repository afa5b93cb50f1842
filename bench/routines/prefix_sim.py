"""Prefix caching in the scheduler: the same workload with caching on and off at equal KV memory.

Two workloads that share prompt tokens, Llama-3-8B KV geometry, max_model_len 4096, the
paged scheduler on a host pool (the step time is the roofline model's, see
python/kvpool/sim/costmodel.py):

- system_prompts: ShareGPT-like requests (Poisson arrivals) whose prompts start with one of
  --num-prefixes system prompts of --prefix-tokens tokens;
- multiturn: conversations of --turns turns, each turn's prompt holding the earlier turns and
  their answers (ShareGPT lengths per message), turns --think-time s apart (open loop).

Each `simulate()` serves the workload paged without caching, contiguous (max_model_len
reserved) and paged with prefix caching; the JSON keeps the whole reports (without the time
series) and a PNG per workload shows the hit rate over time.

    python bench/kvbench.py --routine prefix_sim [--num-requests 4000] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from kvpool.scheduler import SchedulerConfig
from kvpool.sim import generate, get_preset, parse_bytes
from kvpool.sim.report import _finite, write_png
from kvpool.sim.runner import SimulationSpec, simulate
from kvpool.sim.sharing import generate_multiturn, with_token_streams
from provenance import provenance, write_json


def workloads(args: argparse.Namespace) -> dict[str, tuple[list, dict[str, Any]]]:
    common = dict(seed=args.seed, max_model_len=args.max_model_len)
    system = with_token_streams(
        generate(
            "sharegpt",
            args.num_requests,
            rate=args.rate,
            num_prefixes=args.num_prefixes,
            prefix_tokens=args.prefix_tokens,
            **common,
        ),
        args.seed,
    )
    multiturn = generate_multiturn(
        args.num_requests,
        turns=args.turns,
        think_time_s=args.think_time,
        rate=args.conversation_rate,
        **common,
    )
    return {
        "system_prompts": (
            system,
            {
                "kind": "sharegpt",
                "arrival": "poisson",
                "rate_per_s": args.rate,
                "num_prefixes": args.num_prefixes,
                "prefix_tokens": args.prefix_tokens,
            },
        ),
        "multiturn": (
            multiturn,
            {
                "kind": "multiturn",
                "turns": args.turns,
                "think_time_s": args.think_time,
                "conversation_rate_per_s": args.conversation_rate,
                "conversations": len({r.conversation_id for r in multiturn}),
            },
        ),
    }


def run(
    name: str, requests: list, info: dict[str, Any], args: argparse.Namespace, out_dir: Path
) -> dict[str, Any]:
    spec = SimulationSpec(
        preset=get_preset(args.model),
        kv_memory_bytes=parse_bytes(args.kv_memory),
        requests=requests,
        config=SchedulerConfig(max_model_len=args.max_model_len),
        device="host",
        workload_info={**info, "seed": args.seed},
        prefix_caching=True,
    )
    t0 = time.perf_counter()
    report = simulate(spec)
    report["total_wall_s"] = time.perf_counter() - t0
    png = write_png(report, out_dir / name, dpi=72)
    shutil.move(png, out_dir / f"prefix_sim_{name}.png")
    (out_dir / name).rmdir()
    for result in report["results"].values():
        result.pop("series")
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=4000)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--kv-memory", default="8GiB")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=20.0, help="system_prompts: requests/s")
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--think-time", type=float, default=10.0)
    ap.add_argument(
        "--conversation-rate", type=float, default=5.0, help="multiturn: new conversations/s"
    )
    ap.add_argument(
        "--out", type=Path, required=True, help="the JSON to write; the plots go beside it"
    )
    args = ap.parse_args(argv)
    prov = provenance("bench/routines/prefix_sim.py")
    out_dir = args.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = {
        name: run(name, reqs, info, args, out_dir) for name, (reqs, info) in workloads(args).items()
    }
    path = args.out
    write_json(path, _finite({"provenance": prov, "runs": runs}))
    summary = {
        name: {
            k: round(v, 4) if isinstance(v, float) else v for k, v in r["prefix_caching"].items()
        }
        for name, r in runs.items()
    }
    print(json.dumps({"path": str(path), **summary}, indent=1))
