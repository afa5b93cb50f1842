"""Prefix caching in the hybrid simulation: a hybrid model's hit rate on a shared-prompt
workload, served on the real `kvpool.HybridTables` with prefix caching, against the same
workload on a pure full-attention model (`kvpool.BlockTables` with prefix caching,
scheduler/prefix.py) at the same KV memory, and against vLLM's uniform page bytes (its
inflated attention block: 544 tokens for Qwen3-Next).

A model with recurrent-state groups hits only where a state was checkpointed
(rust/core/src/hybrid/hybrid.md, "State checkpoints"), so where the states are stored
decides its hit rate. `HybridPrefixCachedKv` stores one where the prompts branch, as a radix
cache of states does (SGLang's Mamba radix cache): at admission it finds the longest prefix
of the prompt that an earlier admitted prompt holds too (the prompts' 16-token chunk hashes,
kept beside the tables), and if no state of its own is stored there, the request is added up
to that point, checkpointed there (its prefill passes it: the kernel writes the state out at
that chunk boundary) and appended the rest of its prompt; the later requests sharing that
prefix resume from the checkpoint. The first prompt of a new prefix stores nothing, the
second stores the state at the branch, the third hits. The uniform-page scheme stores its
states the same way at multiples of its attention block only, so its hits are whole blocks,
as vLLM's are.

Admission, decode and the cache follow scheduler/prefix.py's `PrefixCachedKv`: the whole
prompt is added at admission (its pages cached at once, `cache_computed`, as the uniform
backend caches a prompt's blocks when it is added), admission counts no hit as room (all the
prompt's pages, one checkpoint and the hit's copies must fit in the free and evictable pages
beyond the watermark), and decode appends each token with its id.

    python -m kvpool.sim.hybrid_prefix --out RESULT.json   # the hit-rate comparison alone

(bench/routines/hybrid_sim.py runs `compare` on the same workloads; README.md's table comes
from that routine's JSON.)
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import kvpool
from kvpool.scheduler.core import Scheduler, SchedulerConfig
from kvpool.scheduler.hybrid import HybridKv
from kvpool.scheduler.metrics import summarize
from kvpool.scheduler.prefix import PrefixCachedKv, _private_ids
from kvpool.scheduler.request import Request
from kvpool.scheduler.seq import Seq
from kvpool.sim.costmodel import RooflineCost
from kvpool.sim.hybrid_cost import HybridStepCost
from kvpool.sim.hybrid_presets import FULL, HYBRID_PRESETS, HybridModel
from kvpool.sim.hybrid_schemes import (
    elem_bytes,
    hybrid_spec,
    proxy_spec,
    scheme_groups,
    uniform_page_plan,
    uniform_page_spec,
)
from kvpool.sim.presets import ModelPreset, parse_bytes
from kvpool.sim.runner import _check_served, proxy_layout
from kvpool.sim.sharing import with_token_streams
from kvpool.sim.workload import describe, generate

CHUNK = 16  # the hybrid tables' hash chunk: hits are whole chunks
SCHEMES = ("hybrid", "uniform_page", "full_attention")
TARGET_RELATIVE = 0.05  # the hybrid hit rate within 5 % of the full-attention model's


def chunk_hashes(ids: np.ndarray) -> list[bytes]:
    """The chain hash of every whole 16-token chunk of `ids` (each names its whole prefix)."""
    out: list[bytes] = []
    parent = b""
    data = np.ascontiguousarray(ids, dtype=np.int64)
    for i in range(len(data) // CHUNK):
        parent = hashlib.blake2b(
            parent + data[i * CHUNK : (i + 1) * CHUNK].tobytes(), digest_size=16
        ).digest()
        out.append(parent)
    return out


def checkpoint_pages(spec: kvpool.ModelKvSpec) -> int:
    """The pages one checkpoint of every state group of `spec` takes."""
    return sum(spec.pages_per_slot(g) or 0 for g in range(spec.num_groups))


def admission_pages(spec: kvpool.ModelKvSpec, num_tokens: int) -> int:
    """The free and evictable pages `HybridPrefixCachedKv` needs to admit a prompt of
    `num_tokens` tokens: all its pages, one checkpoint, and what a hit copies while the call
    runs (a page of each token group, the source of each resumed state slot)."""
    token_groups = sum(spec.block_size(g) is not None for g in range(spec.num_groups))
    return spec.pages_to_add(num_tokens) + 2 * checkpoint_pages(spec) + token_groups


class HybridPrefixCachedKv(HybridKv):
    """HybridKv over a pool with prefix caching; states checkpointed where prompts branch,
    at multiples of `checkpoint_multiple` tokens (the module docstring)."""

    name = "hybrid_prefix_caching"

    def __init__(
        self, pool: kvpool.Pool, spec: kvpool.ModelKvSpec, checkpoint_multiple: int = CHUNK
    ) -> None:
        if not pool.prefix_caching:
            raise ValueError("HybridPrefixCachedKv needs a pool made with enable_prefix_caching")
        if checkpoint_multiple <= 0 or checkpoint_multiple % CHUNK:
            raise ValueError(f"checkpoint_multiple must be a positive multiple of {CHUNK}")
        super().__init__(pool, spec)
        self.multiple = checkpoint_multiple
        groups = range(spec.num_groups)
        self.state_groups = [g for g in groups if spec.block_size(g) is None]
        self.checkpoint_pages = checkpoint_pages(spec)
        # Room a hit may need beyond the prompt's pages: each token group's copied page and
        # each resumed slot's source, held while the call runs.
        self.copy_margin = len(self.token_groups) + self.checkpoint_pages
        self._ids: dict[int, np.ndarray] = {}
        self.seen: set[bytes] = set()  # chunk hashes some admitted prompt holds
        self.checkpointed: set[bytes] = set()  # chunk hashes a state was stored at
        self.checkpoints_stored = 0
        self.checkpoints_lost = 0  # a stored state found evicted by a later request
        self.stats_at_end: dict[str, Any] = {}

    def validate(self, config: SchedulerConfig) -> None:
        self.max_chunk = config.max_tokens_per_step
        needed = self._pages_for(config.max_model_len)
        if needed > self.pool.num_blocks:
            raise ValueError(
                f"the pool has {self.pool.num_blocks} pages, fewer than the {needed} one "
                f"sequence of max_model_len {config.max_model_len} takes at admission"
            )

    def _pages_for(self, num_tokens: int) -> int:
        return admission_pages(self.spec, num_tokens)

    def _allocatable(self) -> int:
        return self.pool.num_free + self.pool.num_evictable

    def _token_ids(self, seq: Seq) -> np.ndarray:
        r = seq.request
        num_tokens = r.prompt_tokens + r.output_tokens
        if r.tokens is None:
            return _private_ids(r.request_id, num_tokens)
        return r.tokens.ids(num_tokens)

    def branch_point(self, hashes: list[bytes], num_tokens: int) -> int:
        """The longest prefix (a multiple of the checkpoint multiple, below the last token)
        that an earlier admitted prompt holds too."""
        seen = 0
        while seen < len(hashes) and hashes[seen] in self.seen:
            seen += 1
        at = min(seen * CHUNK, (num_tokens - 1) // CHUNK * CHUNK)
        return at // self.multiple * self.multiple

    def try_admit(self, seq: Seq, first_chunk: int, watermark_blocks: int) -> bool:
        n = seq.prefill_target
        if self._pages_for(n) + watermark_blocks > self._allocatable():
            return False
        rid = seq.request_id
        ids = self._token_ids(seq)
        prompt = ids[:n]
        hashes = chunk_hashes(prompt)
        branch = self.branch_point(hashes, n)
        at = hashes[branch // CHUNK - 1] if branch else None
        t0 = time.perf_counter()
        if self.state_groups and at is not None and at not in self.checkpointed:
            # Its prefill passes the branch, where no state is stored: store it there.
            hit = self.tables.add_request(rid, prompt[:branch]).num_cached_tokens
            self.tables.checkpoint(rid)
            self.tables.append_tokens(rid, n - branch, prompt[branch:])
            self.checkpointed.add(at)
            self.checkpoints_stored += 1
        else:
            hit = self.tables.add_request(rid, prompt).num_cached_tokens
            if self.state_groups and at is not None and hit < branch:
                # Its state (or the pages before it) was evicted: store it again next time.
                self.checkpointed.discard(at)
                self.checkpoints_lost += 1
        # The prompt is computed from here on in this step's prefill: cached at once, as
        # PrefixCachedKv caches a prompt's blocks when it adds them.
        self.tables.cache_computed(rid)
        self.alloc_s += time.perf_counter() - t0
        self.seen.update(hashes)
        self._ids[rid] = ids
        seq.num_cached_tokens = hit
        return True

    def prefill_shortfall(self, seq: Seq, n: int) -> int:
        return 0  # the whole prompt was added at admission: later chunks only compute

    def extend(self, seq: Seq, n: int) -> None:
        if seq.kv_tokens + n > self.tables.num_tokens(seq.request_id):
            raise AssertionError(
                f"request {seq.request_id}: prefill past the tokens added at admission"
            )

    def decode_shortfall(self, seqs: Sequence[Seq]) -> int:
        lens = np.fromiter((s.kv_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        need = int((lens[:, None] % self.block_sizes[None, :] == 0).sum())
        return max(0, need - self._allocatable())

    def decode(self, seqs: Sequence[Seq]) -> None:
        rids = np.fromiter((s.request_id for s in seqs), dtype=np.int64, count=len(seqs))
        new_ids = np.fromiter(
            (self._ids[s.request_id][s.kv_tokens] for s in seqs), dtype=np.int64, count=len(seqs)
        )
        t0 = time.perf_counter()
        self.tables.append_tokens_many(rids, 1, new_ids)
        self.alloc_s += time.perf_counter() - t0

    def release(self, seq: Seq) -> None:
        super().release(seq)
        del self._ids[seq.request_id]

    def check_drained(self) -> None:
        """After a run: no request left, every page free or evictable; a reset of the cache
        then returns every page to the free list, and the invariants hold throughout."""
        if len(self.tables) != 0 or self._ids:
            raise AssertionError(f"hybrid tables still hold {len(self.tables)} requests")
        self.tables.check_invariants()
        if self.pool.num_used != 0 or self._allocatable() != self.pool.num_blocks:
            raise AssertionError(f"{self.pool.num_used} pages still in use after the run")
        self.stats_at_end = {
            "pool": self.pool.prefix_cache_stats(),
            "groups": self.tables.cache_stats(),
        }
        self.pool.reset_prefix_cache()
        if self.pool.num_free != self.pool.num_blocks:
            raise AssertionError(f"{self.pool.num_blocks - self.pool.num_free} pages leaked")
        self.pool.check_invariants()


def full_attention_model(model: HybridModel) -> ModelPreset:
    """The pure full-attention model the target compares with: every layer of `model` a
    full-attention layer of its attention groups' shape (Qwen3-Next: 48 layers of 2 KV heads
    x 256)."""
    attention = [g for g in model.groups if g.kind == FULL]
    if not attention:
        raise ValueError(f"{model.name} has no full-attention group to take the shape of")
    g = attention[0]
    return ModelPreset(
        f"{model.name} shape, all layers full attention",
        model.num_layers,
        g.num_kv_heads,
        g.head_dim,
        model.num_q_heads,
        model.num_params,
    )


def _figures(sched: Scheduler, token_bytes: int) -> dict[str, Any]:
    f = summarize(sched.metrics, token_bytes)
    keep = (
        "prefix_hit_rate",
        "queried_tokens",
        "cached_tokens",
        "prefill_tokens",
        "mean_running",
        "peak_running",
        "preemptions",
        "modelled_output_tokens_per_s",
        "ttft_mean_s",
        "modelled_s",
    )
    out = {k: f[k] for k in keep if k in f}
    out["completed"] = sched.num_finished
    return out


def run_hybrid(
    model: HybridModel,
    scheme: str,
    kv_memory: int,
    requests: list[Request],
    config: SchedulerConfig,
    dtype: str = "bfloat16",
) -> dict[str, Any]:
    """`requests` served with `scheme` ("hybrid" or "uniform_page") and prefix caching."""
    real = (hybrid_spec if scheme == "hybrid" else uniform_page_spec)(model, dtype)
    num_pages = kv_memory // real.page_bytes
    proxy, scale = proxy_spec(scheme_groups(model, scheme, dtype), real, dtype)
    pool = kvpool.Pool.for_spec(proxy, num_pages, device="host", enable_prefix_caching=True)
    block = uniform_page_plan(model, dtype).block_size if scheme == "uniform_page" else CHUNK
    backend = HybridPrefixCachedKv(pool, proxy, checkpoint_multiple=block)
    backend.name = f"{scheme}_prefix_caching"
    cost = HybridStepCost(model, elem_bytes(dtype))
    sched = Scheduler(backend, requests, config, step_cost=cost)
    cost.bind(sched)
    t0 = time.perf_counter()
    sched.run()
    wall = time.perf_counter() - t0
    _check_served(sched)
    out = _figures(sched, 0)
    out.update(
        run_wall_s=wall,
        page_bytes=real.page_bytes,
        num_pages=num_pages,
        block_sizes=[real.block_size(g) for g in range(real.num_groups)],
        pages_per_slot=[real.pages_per_slot(g) for g in range(real.num_groups)],
        checkpoint_multiple=block,
        checkpoints_stored=backend.checkpoints_stored,
        checkpoints_lost=backend.checkpoints_lost,
        cache_at_end=backend.stats_at_end,
        pool_slab=f"proxy spec (allocator only): the real page bytes / {scale}",
    )
    return out


def run_full_attention(
    model: HybridModel, kv_memory: int, requests: list[Request], config: SchedulerConfig
) -> dict[str, Any]:
    """`requests` on the pure full-attention model of `model`'s shape, paged with prefix
    caching (16-token blocks) in the same KV memory."""
    full = full_attention_model(model)
    layout = full.layout(16, "bfloat16")
    num_blocks = kv_memory // layout.block_bytes
    pool = kvpool.Pool(proxy_layout(16), num_blocks, device="host", enable_prefix_caching=True)
    backend = PrefixCachedKv(pool, config.max_running_seqs, config.max_model_len)
    sched = Scheduler(backend, requests, config, step_cost=RooflineCost(full))
    t0 = time.perf_counter()
    sched.run()
    wall = time.perf_counter() - t0
    _check_served(sched)
    out = _figures(sched, full.token_bytes())
    out.update(
        run_wall_s=wall,
        model=full.name,
        block_bytes=layout.block_bytes,
        num_blocks=num_blocks,
        pool_slab="proxy layout (allocator only)",
    )
    return out


def shared_prompt_workload(
    num_requests: int, num_prefixes: int, prefix_tokens: int, rate: float, max_model_len: int
) -> tuple[list[Request], dict[str, Any]]:
    """ShareGPT-like requests at `rate` per second, each starting with one of `num_prefixes`
    system prompts of `prefix_tokens` tokens (the prefix_sim routine's workload), seed 0."""
    requests = with_token_streams(
        generate(
            "sharegpt",
            num_requests,
            rate=rate,
            num_prefixes=num_prefixes,
            prefix_tokens=prefix_tokens,
            seed=0,
            max_model_len=max_model_len,
        ),
        0,
    )
    info = {
        "kind": "sharegpt",
        "arrival": "poisson",
        "seed": 0,
        "num_requests": num_requests,
        "rate": rate,
        "num_prefixes": num_prefixes,
        "prefix_tokens": prefix_tokens,
    }
    return requests, {**info, **describe(requests)}


def compare(model: HybridModel, kv_memory: int, workload: dict[str, Any]) -> dict[str, Any]:
    """One shared-prompt workload served the three ways; the hit rates and the target."""
    config = SchedulerConfig(
        max_model_len=workload["max_model_len"], max_running_seqs=workload["max_running_seqs"]
    )
    requests, info = shared_prompt_workload(
        workload["num_requests"],
        workload["num_prefixes"],
        workload["prefix_tokens"],
        workload["rate"],
        config.max_model_len,
    )
    results = {
        "hybrid": run_hybrid(model, "hybrid", kv_memory, requests, config),
        "uniform_page": run_hybrid(model, "uniform_page", kv_memory, requests, config),
        "full_attention": run_full_attention(model, kv_memory, requests, config),
    }
    ours = results["hybrid"]["prefix_hit_rate"]
    full = results["full_attention"]["prefix_hit_rate"]
    page = results["uniform_page"]["prefix_hit_rate"]
    relative = (ours - full) / full if full else None
    return {
        "workload": info,
        "scheduler": {
            "max_model_len": config.max_model_len,
            "max_running_seqs": config.max_running_seqs,
            "max_tokens_per_step": config.max_tokens_per_step,
        },
        "results": results,
        "hit_rates": {"hybrid": ours, "uniform_page": page, "full_attention": full},
        "hybrid_relative_to_full_attention": relative,
        "target_within_5_percent_met": relative is not None and abs(relative) <= TARGET_RELATIVE,
    }


def _provenance() -> dict[str, Any]:
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        try:
            done = subprocess.run(
                ["git", "-C", str(here), *args], capture_output=True, text=True, check=True
            )
        except (OSError, subprocess.CalledProcessError):
            return ""
        return done.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {
        "script": "python -m kvpool.sim.hybrid_prefix",
        "commit": os.environ.get("KVPOOL_COMMIT") or head + ("-dirty" if dirty else ""),
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {
            "node": platform.node(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "load_average_1m_before": round(os.getloadavg()[0], 2),
        },
        "extension": kvpool._core.__file__,
    }


# The prefix-cache target's workload (bench/routines/hybrid_sim.py's SHARED_PROMPT): 8 system
# prompts of 1,024 tokens; and the same with 512-token prompts, below one of vLLM's 544-token
# blocks for Qwen3-Next.
WORKLOADS = {
    "shared 1024-token prompts": {"prefix_tokens": 1024},
    "shared 512-token prompts": {"prefix_tokens": 512},
}


def readme_table(data: dict[str, Any]) -> str:
    lines = [
        "| workload | hit rate: hybrid pages / full-attention model / uniform page "
        "| hybrid vs full attention | within 5 % |",
        "|---|---|---|---|",
    ]
    for name, run in data["runs"].items():
        h = run["hit_rates"]
        rel = run["hybrid_relative_to_full_attention"]
        met = "met" if run["target_within_5_percent_met"] else "not met"
        lines.append(
            f"| {name} | {h['hybrid']:.3f} / {h['full_attention']:.3f} / {h['uniform_page']:.3f} "
            f"| {rel:+.1%} | {met} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-next-80b-a3b", choices=sorted(HYBRID_PRESETS))
    ap.add_argument("--kv-memory", default="40GiB")
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-running-seqs", type=int, default=256)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--table", type=Path, help="print the README table of this result and exit")
    ap.add_argument("--out", type=Path, help="the JSON to write")
    args = ap.parse_args(argv)
    if args.table is not None:
        print(readme_table(json.loads(args.table.read_text())))
        return
    if args.out is None:
        ap.error("--out is required (or --table)")
    prov = _provenance()
    model = HYBRID_PRESETS[args.model]
    kv_memory = parse_bytes(args.kv_memory)
    runs = {}
    for name in args.workloads.split(","):
        workload = {
            "num_requests": args.num_requests,
            "rate": args.rate,
            "num_prefixes": args.num_prefixes,
            "max_model_len": args.max_model_len,
            "max_running_seqs": args.max_running_seqs,
            **WORKLOADS[name],
        }
        t0 = time.perf_counter()
        runs[name] = compare(model, kv_memory, workload)
        h = runs[name]["hit_rates"]
        print(
            f"{name}: hit rate hybrid {h['hybrid']:.4f}, full attention "
            f"{h['full_attention']:.4f}, uniform page {h['uniform_page']:.4f} "
            f"({time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
        )
    data = {
        "provenance": prov,
        "model": args.model,
        "kv_memory_bytes": kv_memory,
        "config": {k: str(v) for k, v in vars(args).items() if k not in ("out", "table")},
        "target": "hybrid hit rate within 5 % of the same workload on a pure full-attention "
        "model of the same attention shape (uniform page bytes: near 0 below one block)",
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(readme_table(data))


if __name__ == "__main__":
    main()
