"""Every figure README.md, bench/README.md and bench/FIGURES.md quote, recomputed from the benchmark JSONs and logs.

For re-quoting the docs after a new measurement: it prints, section by section in the order the
READMEs quote them, each figure inside the README phrase it fills, rounded as the README rounds,
with the file and key it came from, then bench/README.md's Results tables regenerated from the
JSON (same rows and columns, ready to paste). Each phrase and table row is looked up in the
README's text (whitespace collapsed): `ok` means the README already says exactly that,
`DIFFERS` means the README must be edited there (or the phrase around the number changed).

    python tools/quote_figures.py --gpu DIR [--gpu2 DIR] --vm DIR

  --gpu   a run folder of bench/gpu.sh (decode.json, prefill.json, fp8.json, swap.json,
          pool_cuda.json, tables_cuda.json, growable.json, generate.json, sim_cuda.json, the test
          and sanitizer logs) with free_list.json and pool.json from bench/cpu.sh on the same
          machine; or a run folder of 2026-12-01 by its names then (NAMES below)
  --gpu2  the run folder holding transfer.json and tp_decode.json (two GPUs; without it that
          section is skipped); on one machine with two GPUs the same folder as --gpu
  --vm    a run folder of bench/cpu.sh on a machine without a GPU
Single files or folders can be named apart (they override the folders above): --free-list DIR,
--sim-cuda FILE, --sim-host FILE, --prefix-sim FILE, --prefix-cache FILE, --swap-sim FILE,
--pool-python FILE. The figures quoted now (commit 0da9aa7) come from

    python tools/quote_figures.py --gpu bench/results/2026-12-01_0da9aa7_h200x2 \\
      --gpu2 bench/results/2026-12-01_0da9aa7_h200x2 --vm bench/results/2026-12-01_0da9aa7_dev-vm \\
      --free-list bench/results/2026-12-01_0da9aa7_h200x2/free_list_alone

Re-quoting: run it on the new folders; every `DIFFERS` line is the README phrase with the new
numbers, to paste over the old one (the tables whole). `--write` does that paste where only
numbers changed (the old wording found with any number in each number's place, line breaks
kept) and lists the phrases left for a hand edit; run it again until none differ. The folder
names in the READMEs' file paths, and the commit they name the run by, are edited by hand (the
commits are printed under "Inputs").

Rounding: half up on the number as stored (0.575 -> 0.58), ratios from the raw times (not from
a ratio the JSON stored rounded). Figures that come from no single JSON (other runs, plots,
model constants) are not printed; they are listed at the end. A section whose file is missing
prints why and the rest go on; a benchmark row that failed is named and left out.
Standard library only; not part of the test suite.
"""

import argparse
import json
import math
import re
import statistics
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- number formatting


def rnd(x, nd=0):
    """x rounded half up to nd decimals, as a string (the README's rounding)."""
    return str(Decimal(repr(float(x))).quantize(Decimal(1).scaleb(-nd), rounding=ROUND_HALF_UP))


def thou(x, nd=0):
    """x with thousands separators (10,000; 1,024)."""
    return format(Decimal(rnd(x, nd)), ",")


def sig(x, n=3):
    """x to n significant figures (29.4, 179, 2.02)."""
    if x == 0:
        return "0"
    return rnd(x, max(n - 1 - math.floor(math.log10(abs(x))), 0))


def rng(values, nd=2, fmt=None):
    """'min-max' of values ('0.91-0.98'); one value when both ends print the same."""
    fmt = fmt or (lambda v: rnd(v, nd))
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def pct(x, nd=0):
    return rnd(100 * x, nd)


def ratio2(x):
    """Free-list table: 2 significant figures below 10, whole numbers above."""
    return rnd(x, 2) if x < 1 else rnd(x, 1) if x < 10 else rnd(x, 0)


def status(ok):
    return "met" if ok else "missed"


def join_and(items):
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# ---------------------------------------------------------------- files and README checks


# The files of a run folder written by bench/gpu.sh and bench/cpu.sh, by the names the runs of
# 2026-12-01 gave them (the GPU and CPU scripts of then, since folded into those two).
NAMES = {
    "decode/decode_h200_v4.json": "decode.json",
    "fp8/fp8_h200.json": "fp8.json",
    "fp8/fp8_prefill_h200.json": "fp8_prefill.json",
    "prefill_h200.json": "prefill.json",
    "hosttier/swap_h200.json": "swap.json",
    "transformers/generate_h200.json": "generate.json",
    "growable_h200.json": "growable.json",
    "transformers/transformers_gpu_report.json": "transformers_gpu_report.json",
    "fp8/gpu_tests.log": "fp8_tests.log",
    "hosttier/gpu_tests.log": "host_tier_tests.log",
    "transformers/tests.log": "transformers_tests.log",
    "transformers/cpu_tests.log": "transformers_cpu_tests.log",
    "multigpu/gpu2_tests.log": "gpu2_tests.log",
    "hosttier/sanitizer.log": "host_tier_memcheck.log",
    "multigpu/transfer_h200x2.json": "transfer.json",
    "multigpu/tp_decode_h200x2.json": "tp_decode.json",
    "free_list_h200.json": "free_list.json",
    "pool_python_h200.json": "pool.json",
    "simulate_sharegpt_llama-3-8b_cuda.json": "sim_cuda.json",
    "simulate_sharegpt_llama-3-8b_host.json": "sim.json",
    "prefix_cache_host.json": "prefix.json",
    "swap_sim_llama-3-8b.json": "swap_sim.json",
    "pool_python.json": "pool.json",
}


def pick(folder, legacy):
    """folder's file of that content: by its bench/gpu.sh or bench/cpu.sh name when present,
    else by its name in the runs of record."""
    new = folder / NAMES.get(legacy, legacy)
    return new if new.exists() else folder / legacy


def load(path):
    return json.loads(Path(path).read_text())


def passed(log):
    """('271', '0'): the counts of pytest's last summary line."""
    text = Path(log).read_text()
    p = re.findall(r"(\d+) passed", text)
    f = re.findall(r"(\d+) failed", text)
    return (p[-1] if p else "0"), (f[-1] if f else "0")


def sanitizer_errors(*logs):
    """Errors summed over compute-sanitizer logs (memcheck 'ERROR SUMMARY', racecheck summary)."""
    total = 0
    for log in logs:
        text = Path(log).read_text()
        found = re.findall(r"ERROR SUMMARY: (\d+) error", text) + re.findall(
            r"RACECHECK SUMMARY: .*?\((\d+) errors", text
        )
        if not found:
            raise ValueError(f"no sanitizer summary in {log}")
        total += sum(int(n) for n in found)
    return total


def section_text(path, heading):
    """The README section under `## heading`, whitespace collapsed (for phrase lookups)."""
    text = Path(path).read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return " ".join(text[start : end if end > 0 else None].split())


NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"  # 7, 0.98, 18,006, 4.66 (not the comma of "1, 16")


def phrase_pattern(phrase):
    """A regex for `phrase` with any number in place of each of its numbers (captured) and any
    run of whitespace for each space: it finds the old wording of a re-measured phrase, however
    the README wraps it."""
    parts = re.split(f"({NUMBER})", " ".join(phrase.split()))
    return re.compile(
        "".join(
            f"({NUMBER})" if i % 2 else r"\s+".join(map(re.escape, part.split(" ")))
            for i, part in enumerate(parts)
        )
    )


def requote(text, start, end, phrase):
    """`text` with the old wording of `phrase` inside text[start:end] given the phrase's numbers,
    whitespace and line breaks kept; None when no single place fits. Where several places fit
    (table rows of one shape), the one sharing most numbers with the phrase is taken (the row's
    label cells), and a tie is no answer."""
    new = re.findall(NUMBER, " ".join(phrase.split()))
    found = list(phrase_pattern(phrase).finditer(text, start, end))
    if not found:
        return None

    def shared(m):
        return sum(old == n for old, n in zip(m.groups(), new))

    found.sort(key=shared, reverse=True)
    if len(found) > 1 and shared(found[0]) == shared(found[1]):
        return None
    m = found[0]
    for i in reversed(range(len(new))):
        text = text[: m.start(i + 1)] + new[i] + text[m.end(i + 1) :]
    return text


class Report:
    """Prints figures and tables and looks each one up in the README it belongs to."""

    def __init__(self, check):
        self.check = check
        self.docs = {}
        self.places = {}  # doc name -> (path, heading or None): where --write edits it
        self.doc = None
        self.counts = {"ok": 0, "DIFFERS": 0}
        self.differs = []
        self.stale = []  # (doc name, phrase) for every DIFFERS

    def add_doc(self, name, path, heading=None):
        text = Path(path).read_text()
        self.places[name] = (Path(path), heading)
        if heading:
            self.docs[name] = section_text(path, heading)
        else:
            self.docs[name] = " ".join(text.split())

    def write(self):
        """Puts every DIFFERS phrase in place of its old wording (numbers only: a changed word
        is left for a hand edit). Returns the phrases it could not place."""
        texts = {path: path.read_text() for path, _ in self.places.values()}
        left = []
        for doc, phrase in self.stale:
            path, heading = self.places[doc]
            text = texts[path]
            start, end = 0, len(text)
            if heading:
                start = text.index(f"\n## {heading}\n")
                end = text.find("\n## ", start + 1)
                end = len(text) if end < 0 else end
            new = requote(text, start, end, phrase)
            if new is None:
                left.append(f"{doc}: {phrase}")
            else:
                texts[path] = new
        for path, text in texts.items():
            path.write_text(text)
        return left

    def section(self, doc, title):
        self.doc = doc
        print(f"\n=== {doc}: {title}")

    def mark(self, text):
        if not self.check:
            return ""
        key = "ok" if " ".join(text.split()) in self.docs[self.doc] else "DIFFERS"
        self.counts[key] += 1
        if key == "DIFFERS":
            self.differs.append(f"{self.doc}: {text}")
            self.stale.append((self.doc, text))
        return f"[{key:7}] "

    def fig(self, template, *values, src):
        text = template.format(*values)
        print(f"  {self.mark(text)}{text}\n             <- {src}")

    def info(self, text, src):
        """A figure whose README wording is free prose (not looked up)."""
        print(f"  [info   ] {text}\n             <- {src}")

    def table(self, src, header, rows):
        print(f"\n  table from {src}:\n")
        print("    " + header)
        print("    " + "|---" * (header.count("|") - 1) + "|")
        for cells in rows:
            line = " ".join(("| " + " | ".join(cells) + " |").split())  # an empty cell as "| |"
            print(f"    {self.mark(line)}{line}")
        print()


# ---------------------------------------------------------------- the sections


def readme_scheduler(rep, f):
    d = load(f["sim_host"])["runs_by_reserve"]
    rep.section("README.md Results", "scheduler, paged vs contiguous (a shared 2-core CPU machine)")
    src = "sim_host runs_by_reserve.<reserve>"
    mm, p2, rq = d["max_model_len"], d["pow2"], d["request"]
    paged = mm["results"]["paged"]
    rep.fig(
        "scheduler, {} ShareGPT-like requests in {} GiB of Llama-3-8B KV",
        thou(mm["workload"]["num_requests"]),
        rnd(mm["kv_memory_bytes"] / 2**30),
        src=src + ".workload.num_requests, .kv_memory_bytes",
    )
    rep.fig(
        "KV utilization {}, {} requests running on average",
        rnd(paged["kv_utilization"], 3),
        rnd(paged["mean_running"], 1),
        src=src + ".results.paged.kv_utilization, .mean_running",
    )
    for run, template in (
        (mm, "max_model_len per request: {}, {}x fewer running"),
        (p2, "power of two: {}, {}x fewer"),
        (rq, "known in advance: {}, {}x fewer"),
    ):
        rep.fig(
            template,
            rnd(run["results"]["contiguous"]["kv_utilization"], 3),
            rnd(run["comparison"]["mean_concurrency_ratio"], 1),
            src=f"sim_host runs_by_reserve.{run['contiguous_reserve']}.results.contiguous."
            "kv_utilization, .comparison.mean_concurrency_ratio",
        )


def readme_pool_tables(rep, f):
    g = f["gpu"]
    pool = {c["name"]: c for c in load(g / "pool_cuda.json")["cases"]}
    rep.section("README.md Results", "allocator, block tables (H200)")
    cuda = pool["cuda_alloc_free_single"]
    c16 = pool["alloc_many16_free_many"]
    rep.fig(
        "| block alloc+free from Python, CUDA | {} us: {}x, {}x, {}x; 16 blocks: {}x | CuPy's "
        "memory pool, torch's caching allocator, `cudaMalloc`+`cudaFree`; a pure-Python free "
        "list |",
        rnd(cuda["ours_us"], 2),
        rnd(
            pool["cuda_alloc_free_single_vs_cupy_pool"]["baseline_us"]
            / pool["cuda_alloc_free_single_vs_cupy_pool"]["ours_us"],
            1,
        ),
        rnd(
            pool["cuda_alloc_free_single_vs_torch_caching"]["baseline_us"]
            / pool["cuda_alloc_free_single_vs_torch_caching"]["ours_us"],
            0,
        ),
        rnd(cuda["baseline_us"] / cuda["ours_us"], 0),
        rnd(c16["baseline_us"] / c16["ours_us"], 1),
        src="pool_cuda.json cases[cuda_alloc_free_single*, alloc_many16_free_many] baseline_us "
        "/ ours_us",
    )
    res = load(pick(f["free_list"], "free_list_h200.json"))["results"]
    speedups = {
        (r["group"], r["threads"]): r["mutex_ns_per_block"] / r["ours_ns_per_block"] for r in res
    }
    many = [x for (_, t), x in speedups.items() if t in (8, 16)]
    single = [x for (_, t), x in speedups.items() if t == 1]
    rep.fig(
        "| free list in Rust | {}-{}x at 8-16 threads, {}-{}x single-threaded | "
        "`Mutex<Vec<u32>>` |",
        rnd(min(many), 1),
        rnd(max(many)),
        rnd(min(single), 2),
        rnd(max(single), 2),
        src="free_list_h200.json results: mutex_ns_per_block / ours_ns_per_block, threads 8 and 16, "
        "and 1",
    )
    t = load(g / "tables_cuda.json")
    paths = t["paths"]
    ours = paths["ours_append_sync_cuda"]["median_us"]
    rep.fig(
        "| block tables, {} requests | {} us per step: {}x, {}x | an incremental NumPy table "
        "with a pinned asynchronous upload; a rebuild |",
        t["config"]["num_requests"],
        rnd(ours, 1),
        rnd(paths["incremental_numpy_pinned_async"]["median_us"] / ours, 1),
        rnd(paths["rebuild_numpy_cupy_asarray"]["median_us"] / ours, 0),
        src="tables_cuda.json paths.*.median_us",
    )


def readme_kernels(rep, f):
    g = f["gpu"]
    rep.section("README.md Results", "decode, fp8, prefill (H200)")
    dec = decode_groups(measured(load(pick(g, "decode/decode_h200_v4.json"))["rows"], "kvpool_us"))
    rep.fig(
        "| decode attention | D=128, 128k+ tokens: {} of the measured read ceiling, {}x, {}x; "
        "small shapes: {}x | the best FlashInfer mode, cuDNN SDPA; the best peer |",
        rng([r["kvpool_frac"] for r in dec["large"]]),
        rng([best_fi(r) / r["kvpool_us"] for r in dec["large"] if best_fi(r)]),
        rng([r["sdpa_cudnn_us"] / r["kvpool_us"] for r in dec["large"] if r.get("sdpa_cudnn_us")]),
        rng([r["best_peer_us"] / r["kvpool_us"] for r in dec["small"]]),
        src="decode/decode_h200_v4.json rows: large = D=128 fp16 Hq32 block16 B*L>=128k, "
        "small = every unragged row with B*L<128k; kvpool_frac, peer_us / kvpool_us",
    )
    fp8 = measured(load(pick(g, "fp8/fp8_h200.json"))["rows"], "kvpool_fp8_us")
    fp8p = load(pick(g, "fp8/fp8_prefill_h200.json"))["rows"]
    low = min(fp8, key=fp8_vs_fp16)
    rep.fig(
        "| fp8 decode and prefill | decode {}x on large shapes, {}x on {}, {}x on every shape; "
        "prefill {}x | our fp16 decode, FlashInfer's best fp8 decode; our fp16 prefill |",
        rng([fp8_vs_fp16(r) for r in fp8 if is_large(r)]),
        rnd(fp8_vs_fp16(low), 2),
        low["shape"],
        rng([fp8_vs_fi(r) for r in fp8]),
        rng([r["kvpool_fp16_us"] / r["kvpool_fp8_us"] for r in fp8p]),
        src="fp8/fp8_h200.json rows (large: B*L>=128k) kvpool_fp16_us / kvpool_fp8_us, "
        "min(flashinfer*_fp8_us) / kvpool_fp8_us; fp8/fp8_prefill_h200.json rows",
    )
    pre = measured(load(pick(g, "prefill_h200.json"))["rows"], "kvpool_us")
    full = [
        r for r in pre if "spec" not in r["shape"]
    ]  # full-size: every row but 64 x 4 spec, both dtypes
    rep.fig(
        "| prefill, full-size shapes | {} TFLOP/s: {}x, {}x | FlashInfer fa2; the best peer "
        "(FlashInfer fa3 or cuDNN) |",
        rng([r["kvpool_tflops"] for r in full], 0),
        rng([r["flashinfer_fa2_us"] / r["kvpool_us"] for r in full]),
        rng([prefill_best_peer(r)[1] / r["kvpool_us"] for r in full]),
        src="prefill_h200.json rows but '64 x 4 spec', fp16 and bf16: kvpool_tflops, "
        "*_us / kvpool_us",
    )
    rep.info(
        "best peer per full-size row: "
        + ", ".join(f"{r['shape']} {r['dtype']}: {prefill_best_peer(r)[0]}" for r in full),
        src="prefill_h200.json rows, fastest of fa2, fa3, sdpa_flash, sdpa_cudnn",
    )


def prefix_sim_runs(f):
    """The prefix_sim workloads (system prompts, multiturn) and their prefix-caching results."""
    runs = load(f["prefix_sim"])["runs"]
    sp, mt = runs["system_prompts"], runs["multiturn"]
    return sp, mt, sp["prefix_caching"], mt["prefix_caching"]


def readme_cpu_machine(rep, f):
    rep.section(
        "README.md Results", "prefix caching in the scheduler (a shared 2-core CPU machine)"
    )
    sp, mt, spc, mtc = prefix_sim_runs(f)
    rep.fig(
        "{} shared {}-token system prompts: hit {} of prompt tokens, {} % less prefill, {}x "
        "output tokens/s; {}-turn conversations: hit {}, {} % less prefill, {}x | caching off, "
        "same KV memory |",
        sp["workload"]["num_prefixes"],
        thou(sp["workload"]["prefix_tokens"]),
        rnd(spc["hit_rate_tokens"], 3),
        pct(spc["prefill_tokens_saved_fraction"]),
        rnd(spc["modelled_throughput_ratio"], 2),
        mt["workload"]["turns"],
        rnd(mtc["hit_rate_tokens"], 3),
        pct(mtc["prefill_tokens_saved_fraction"]),
        rnd(mtc["modelled_throughput_ratio"], 2),
        src="prefix_sim runs.{system_prompts,multiturn}.prefix_caching.hit_rate_tokens, "
        "prefill_tokens_saved_fraction, modelled_throughput_ratio",
    )
    rep.section("README.md Results", "prefix caching from Python (a shared 2-core CPU machine)")
    pc = load(f["prefix_cache"])
    miss, hit, step = pc["add_miss"], pc["add_hit"], pc["decode_step"]
    rep.fig(
        "| prefix caching from Python, a {}-token prompt | adding it {}x (miss), {}x (full hit, "
        "{} us); caching adds {} % to a {}-request decode step's append | the same algorithm in "
        "pure Python; caching off |",
        pc["prompt_tokens"],
        rnd(miss["python"]["median_us"] / miss["ours"]["median_us"], 1),
        rnd(hit["python"]["median_us"] / hit["ours"]["median_us"], 1),
        rnd(hit["ours"]["median_us"], 0),
        pct(step["caching_overhead"]),
        pc["decode_requests"],
        src="prefix_cache add_{miss,hit}.{python,ours}.median_us, decode_step.caching_overhead",
    )


def readme_hosttier(rep, f):
    g = f["gpu"]
    rep.section("README.md Results", "host tier (H200)")
    h = hosttier(load(pick(g, "hosttier/swap_h200.json")))
    rep.fig(
        "| host tier swaps | 2 MiB blocks {}x, 64 KiB fragmented blocks {}x | a 1 GiB pinned "
        "copy ({} GB/s) |",
        h["big"],
        h["small_frag"],
        h["ceiling"],
        src="hosttier/swap_h200.json rows method=batch, num_blocks>=64: swap_{out,in}"
        "_vs_ceiling; ceiling_1gib",
    )


def readme_gpu_tail(rep, f):
    g = f["gpu"]
    if f.get("gpu2"):
        rep.section("README.md Results", "two GPUs")
        tr = transfer(f)
        tp = tp_rows(f)
        rep.fig(
            "| two GPUs | KV transfer {}x (1 block) to {}x (4096 blocks), {}; TP decode {}x | one "
            "contiguous NCCL send/recv; one GPU |",
            rnd(tr[1]["ratio"], 2),
            rnd(tr[4096]["ratio"], 2),
            "byte-exact" if tr["byte_exact"] else "NOT byte-exact",
            rng([r["one_gpu_us"] / r["tp2_us"] for r in tp]),
            src="multigpu/transfer_h200x2.json summary nccl_contiguous_us / best_us; "
            "tp_decode_h200x2.json rows one_gpu_us / tp2_us",
        )
    rep.section("README.md Results", "generation through transformers, growable pool")
    gen = load(pick(g, "transformers/generate_h200.json"))
    rows, ra = gen["rows"], gen["ratios"]
    rep.fig(
        "| generation, random-weight {}-layer model, {} requests | {} tokens/s with CUDA graphs, "
        "{} eager: {}x and {}x, {}x and {}x; batch 1: {} ms/token with graphs | transformers' "
        "continuous batching; its dynamic cache ({} ms/token at batch 1) |",
        gen["model"]["num_hidden_layers"],
        gen["workload"]["num_requests"],
        thou(rows["kvpool_loop_graphs"]["tokens_per_s"]),
        thou(rows["kvpool_loop"]["tokens_per_s"]),
        rnd(ra["kvpool_loop_graphs_over_hf_continuous_batching_tokens_per_s"], 0),
        rnd(ra["kvpool_loop_over_hf_continuous_batching_tokens_per_s"], 1),
        rnd(ra["kvpool_loop_graphs_over_hf_dynamic_sdpa_tokens_per_s"], 0),
        rnd(ra["kvpool_loop_over_hf_dynamic_sdpa_tokens_per_s"], 1),
        sig(ra["fixed_b1_ms_per_step"]["kvpool_graphs"]),
        sig(ra["fixed_b1_ms_per_step"]["hf_dynamic"]),
        src="transformers/generate_h200.json rows.*.tokens_per_s, ratios.*",
    )
    gr = load(pick(g, "growable_h200.json"))
    grow = {v["chunk_bytes"] >> 20: v for v in gr["vmm"] if v["how"] == "pool.grow"}
    # README.md rounds these two speedups down ("28x" for 28.5x).
    rep.fig(
        "| growing a pool holding {} GiB by {} GiB in place | {}x at 256 MiB chunks, {}x at 32 "
        "MiB chunks | allocate-copy-free |",
        rnd(gr["live_bytes"] / 2**30),
        rnd(gr["grow_bytes"] / 2**30),
        int(grow[256]["speedup_vs_copy"]),
        int(grow[32]["speedup_vs_copy"]),
        src="growable_h200.json vmm[how=pool.grow].speedup_vs_copy (rounded down)",
    )


def figures_swap_table(rep, f):
    """bench/FIGURES.md, the measurement notes moved out of README.md: the swap table, then the
    prefix-caching paragraph and the greedy test (below)."""
    rep.section("bench/FIGURES.md", "swap table")
    d = load(f["swap_sim"])
    rows = d["rows"]
    first = rows[0]
    rep.fig(
        "{} ShareGPT-like requests at t=0, Llama-3-8B, {} of GPU KV ({} blocks), {} tier;",
        thou(d["args"]["num_requests"]),
        gib_label(d["args"]["kv_memory"]),
        thou(d["reports"][0]["num_blocks"]),
        gib_label(first["cpu_kv_memory"]),
        src="swap_sim args, reports[0].num_blocks, rows[0].cpu_kv_memory",
    )
    head = f"recomputed tokens (no tier: {thou(first['recomputed_tokens_no_tier'])})"
    picked = [
        (55.0, "auto"),
        (10.0, "auto"),
        (5.0, "auto"),
        (2.0, "swap"),
    ]  # the README's four rows
    out = []
    for link, mode in picked:
        r = [
            x
            for x in rows
            if x["host_link_gbps"] == link
            and x["mode"] == mode
            and x["cpu_kv_memory"] == first["cpu_kv_memory"]
        ][0]
        out.append(
            [
                f"{link:g} GB/s, {mode if mode == 'auto' else 'swap forced'}",
                f"{thou(r['by_swap'])} / {thou(r['by_recompute'])}",
                thou(r["recomputed_tokens_tier"]),
                rnd(r["throughput_ratio"], 3) + "x",
                rnd(r["ttft_mean_ratio"], 3) + "x",
            ]
        )
    rep.table(
        "swap_sim rows (55/10/5 GB/s auto, 2 GB/s swap; 64 GiB tier)",
        f"| host link, mode | swap / recompute preemptions | {head} | throughput | TTFT mean |",
        out,
    )
    r10 = [x for x in rows if x["host_link_gbps"] == 10.0 and x["mode"] == "auto"][0]
    rep.fig(
        "At 10 GB/s `auto` loses {} %",
        pct(1 - r10["throughput_ratio"], 1),
        src="swap_sim rows[10 GB/s auto].throughput_ratio",
    )


def figures_prefix_paragraph(rep, f):
    rep.section("bench/FIGURES.md", "prefix caching paragraph")
    sp, mt, spc, mtc = prefix_sim_runs(f)
    rep.fig(
        "(Llama-3-8B geometry, {} GiB of KV, {} requests, modelled H200 step times;",
        rnd(sp["kv_memory_bytes"] / 2**30),
        thou(sp["workload"]["num_requests"]),
        src="prefix_sim runs.system_prompts.kv_memory_bytes, workload.num_requests",
    )
    rep.fig(
        "with {} system prompts of {} tokens at {} requests/s, caching hits {} of prompt tokens, "
        "saves {} % of the prefill tokens and serves {}x the output tokens/s (the run without "
        "caching falls behind its arrivals: mean TTFT {} s against {} s); on conversations of "
        "{} turns ({} new conversations/s, {} s think time) it hits {}",
        sp["workload"]["num_prefixes"],
        thou(sp["workload"]["prefix_tokens"]),
        rnd(sp["workload"]["rate_per_s"]),
        rnd(spc["hit_rate_tokens"], 3),
        pct(spc["prefill_tokens_saved_fraction"]),
        rnd(spc["modelled_throughput_ratio"], 2),
        secs(sp["results"]["paged"]["ttft_mean_s"]),
        secs(sp["results"]["paged_prefix_caching"]["ttft_mean_s"]),
        mt["workload"]["turns"],
        rnd(mt["workload"]["conversation_rate_per_s"]),
        rnd(mt["workload"]["think_time_s"]),
        rnd(mtc["hit_rate_tokens"], 3),
        src="prefix_sim runs.*.workload, .prefix_caching, .results.*.ttft_mean_s",
    )
    rep.fig(
        "saves {} % of the prefill and serves {}x, mean TTFT {}x",
        pct(mtc["prefill_tokens_saved_fraction"]),
        rnd(mtc["modelled_throughput_ratio"], 2),
        rnd(mtc["ttft_mean_ratio"], 2),
        src="prefix_sim runs.multiturn.prefix_caching",
    )


def figures_greedy_paragraph(rep, f):
    rep.section("bench/FIGURES.md", "greedy divergence paragraph")
    greedy_paragraph(rep, f, readme=True)


def greedy_paragraph(rep, f, readme):
    g = load(pick(f["gpu"], "transformers/transformers_gpu_report.json"))["greedy_64"]
    div = g["divergences"]
    total = len(div) + len(g["agreeing_last_step"])
    same = round(g["identical_fraction"] * total)
    sig_rng = rng([x["gap_sigmas"] for x in div], fmt=lambda v: "0" if v == 0 else rnd(v, 2))
    src = (
        "transformers/transformers_gpu_report.json greedy_64: identical_fraction x (divergences"
        " + agreeing_last_step), max ref_gap, gap_sigmas, bounds.gap_sigmas"
    )
    if readme:  # the wording README.md had, now in bench/FIGURES.md; else bench/README.md's
        rep.fig(
            "{} of {} greedy outputs (`identical_fraction` {}) were identical over 64 tokens; "
            "the other {} parted where the top-2 gap looked large (up to {} logit units)",
            same,
            total,
            g["identical_fraction"],
            len(div),
            rnd(max(x["ref_gap"] for x in div)),
            src=src,
        )
        rep.fig(
            "up to {} off float32 logits of the same weights",
            rnd(max(max(x["max_abs_err_ours"], x["max_abs_err_ref"]) for x in div)),
            src="greedy_64.divergences max(max_abs_err_ours, max_abs_err_ref)",
        )
        rep.fig(
            "the {} divergences lie {} of that error (`gap_sigmas`) from a tie, within the "
            "bound of {}",
            len(div),
            sig_rng,
            rnd(g["bounds"]["gap_sigmas"]),
            src=src,
        )
    else:
        rep.fig(
            "(`greedy_64`) {} of {} requests' 64 greedy tokens are identical "
            "(`identical_fraction` {}); the other {} part where the top-2 gap (`ref_gap`) "
            "reaches up to {} logit units, but each lies {} measured logit errors",
            same,
            total,
            g["identical_fraction"],
            len(div),
            rnd(max(x["ref_gap"] for x in div)),
            sig_rng,
            src=src,
        )
        rep.fig("within the test's bound of {}", rnd(g["bounds"]["gap_sigmas"]), src=src)


# ---------------------------------------------------------------- bench/README.md


def bench_scheduler(rep, f):
    rep.section("bench/README.md Results", "scheduler, paged vs contiguous")
    d = load(f["sim_host"])
    runs = d["runs_by_reserve"]
    order = ["max_model_len", "pow2", "request"]
    mm = runs["max_model_len"]
    rep.fig(
        "{} ShareGPT-like requests at t=0, Llama-3-8B geometry, max_model_len {}, {} GiB of KV "
        "for both",
        thou(mm["workload"]["num_requests"]),
        mm["scheduler"]["max_model_len"],
        rnd(mm["kv_memory_bytes"] / 2**30),
        src="sim_host runs_by_reserve.max_model_len",
    )
    paged = mm["results"]["paged"]
    c = [runs[k]["results"]["contiguous"] for k in order]
    cmp_ = [runs[k]["comparison"] for k in order]
    rows = [
        [
            "mean / peak running requests",
            f"{rnd(paged['mean_running'], 1)} / {paged['peak_running']}",
        ]
        + [f"{rnd(x['mean_running'], 1)} / {x['peak_running']}" for x in c],
        ["paged mean running / contiguous", ""]
        + [rnd(x["mean_concurrency_ratio"], 1) + "x" for x in cmp_],
        ["KV utilization (tokens stored / slots allocated)", rnd(paged["kv_utilization"], 3)]
        + [rnd(x["kv_utilization"], 3) for x in c],
        ["modelled output throughput, paged / contiguous", ""]
        + [rnd(x["modelled_throughput_ratio"], 1) + "x" for x in cmp_],
        # the paged run is repeated once per reservation: its share as a range over the three
        [
            "allocator share of the paged run",
            rng([runs[k]["results"]["paged"]["alloc_share"] * 100 for k in order], 1) + " %",
            "",
            "",
            "",
        ],
        ["whole simulation (paged + contiguous), wall", ""]
        + [rnd(runs[k]["total_wall_s"], 1) + " s" for k in order],
    ]
    rep.table(
        "sim_host runs_by_reserve.{max_model_len,pow2,request}",
        "| | paged (kvpool) | contiguous, max_model_len | contiguous, pow2 | contiguous, request |",
        rows,
    )
    met = [k for k in order if runs[k]["targets"]["mean_concurrency_ratio >= 3"]]
    rep.fig(
        "The paged scheduler preempts ({} times, recomputing)",
        paged["preemptions"],
        src="sim_host runs_by_reserve.max_model_len.results.paged.preemptions",
    )
    rep.fig(
        "target of >= 3x the contiguous concurrency is met against {} only",
        join_and(met),
        src="sim_host runs_by_reserve.*.targets['mean_concurrency_ratio >= 3']",
    )
    rep.fig(
        "(load average {} before the run)",
        rnd(d["provenance"]["machine"]["load_average_1m_before"], 1),
        src="sim_host provenance.machine.load_average_1m_before",
    )
    rep.fig(
        "the allocator share target (< 5 %) is {} there",
        status(all(runs[k]["targets"]["paged_alloc_share < 0.05"] for k in order)),
        src="sim_host runs_by_reserve.*.targets['paged_alloc_share < 0.05']",
    )
    s = load(f["sim_cuda"])
    # the `sim` routine writes one run per contiguous reservation; an older file held one run.
    s = s["runs_by_reserve"]["max_model_len"] if "runs_by_reserve" in s else s
    md = s["comparison"]["measured_decode_tokens_per_s"]
    rep.fig(
        "{} requests, `--device cuda`, contiguous reserving {}): measured decode attention {} "
        "tokens/s paged against {} contiguous; allocator share of the paged run {} %",
        thou(s["workload"]["num_requests"]),
        s["contiguous_reserve"],
        thou(md["paged"]),
        thou(md["contiguous"]),
        pct(s["results"]["paged"]["alloc_share"], 1),
        src=f"sim_cuda ({f['sim_cuda']}) comparison.measured_decode_tokens_per_s, "
        "results.paged.alloc_share",
    )


def bench_gpu_intro(rep, f):
    g = f["gpu"]
    rep.section("bench/README.md Results", "the H200 run: tests and sanitizers")
    logs = {
        "gpu": g / "gpu_tests.log",
        "prefill": g / "prefill_tests.log",
        "fp8": pick(g, "fp8/gpu_tests.log"),
        "host tier": pick(g, "hosttier/gpu_tests.log"),
        "transformers": pick(g, "transformers/tests.log"),
        "cpu": pick(g, "transformers/cpu_tests.log"),
    }
    if f["gpu2"]:
        logs["two-GPU"] = pick(f["gpu2"], "multigpu/gpu2_tests.log")
    counts = {name: passed(log) for name, log in logs.items()}
    errors = sanitizer_errors(
        g / "decode_memcheck.log",
        g / "decode_racecheck.log",
        g / "prefill_memcheck.log",
        g / "prefill_racecheck.log",
    )
    rep.fig(
        "tests ({} GPU tests, {} prefill, {} fp8, {} host tier, {} transformers GPU and {} host, "
        "{} two-GPU tests passed), memcheck and racecheck ({} errors)",
        *[
            counts[name][0] if name in counts else "(no --gpu2)"
            for name in ("gpu", "prefill", "fp8", "host tier", "transformers", "cpu", "two-GPU")
        ],
        errors,
        src="'N passed' of gpu_tests.log, prefill_tests.log, fp8/gpu_tests.log, "
        "hosttier/gpu_tests.log, transformers/tests.log, transformers/cpu_tests.log, "
        "--gpu2 multigpu/gpu2_tests.log; {decode,prefill}_{memcheck,racecheck}.log summaries",
    )
    failed = [name for name, (_, n) in counts.items() if n != "0"]
    if failed:
        rep.info("FAILED tests in: " + ", ".join(failed), src="test logs")
    rep.info(
        f"commit {prov_commit(g / 'pool_cuda.json')} (the READMEs name the GPU run by it)",
        src="pool_cuda.json provenance.commit",
    )


def bench_allocator(rep, f):
    g = f["gpu"]
    rep.section("bench/README.md Results", "allocator")
    pc = load(g / "pool_cuda.json")
    c = {x["name"]: x for x in pc["cases"]}
    tg = pc["targets"]
    vm = {x["name"]: x for x in load(f["pool_python"])["cases"]}

    def r(name, nd_ours, nd_base, nd_ratio, label, base_label, target=""):
        x = c[name]
        # a per-block case stores its times rounded to 4 decimals: its ratio from the round trip
        y = c[name.removesuffix("_per_block")]
        return [
            label,
            rnd(x["ours_us"], nd_ours) + " us",
            f"{base_label}{rnd(x['baseline_us'], nd_base)} us",
            rnd(y["baseline_us"] / y["ours_us"], nd_ratio) + "x",
            target,
        ]

    t16 = all(t["pass"] for t in tg if "16" in t["target"] and "256" not in t["target"])
    t256 = [t for t in tg if "n=256" in t["target"]][0]["pass"]
    v16 = vm["alloc_many16_free_many"]
    rows = [
        r(
            "alloc_many16_free_many",
            2,
            2,
            2,
            "`alloc_many(16)` + `free_many`, Python, H200 host",
            "pure-Python free list, same checks: ",
            f"< 0.4 us and >= 10x: **{status(t16)}**",
        ),
        r(
            "alloc_many256_free_many_per_block",
            3,
            3,
            2,
            "256-block round trip, per block, H200 host",
            "",
            f">= 10x: **{status(t256)}**",
        ),
        r(
            "cuda_alloc_free_single",
            3,
            1,
            0,
            "one block alloc+free on a CUDA pool",
            "`cudaMalloc`+`cudaFree`: ",
        ),
        r("cuda_alloc_free_single_vs_cupy_pool", 3, 3, 2, "the same", "CuPy `MemoryPool`: "),
        r(
            "cuda_alloc_free_single_vs_torch_caching",
            3,
            2,
            1,
            "the same",
            "torch caching allocator: ",
        ),
        r(
            "cuda_alloc_many16_vs_cupy_pool",
            2,
            2,
            1,
            "16 blocks on a CUDA pool",
            "CuPy `MemoryPool` x16: ",
        ),
        r(
            "cuda_alloc_many16_vs_torch_caching",
            2,
            1,
            1,
            "the same",
            "torch caching allocator x16: ",
        ),
        [
            "`alloc_many(16)` + `free_many`, Python, 2-core VM",
            rnd(v16["ours_us"], 2) + " us",
            rnd(v16["baseline_us"], 2) + " us",
            rnd(v16["baseline_us"] / v16["ours_us"], 1) + "x",
            "met (10x)" if v16["baseline_us"] / v16["ours_us"] >= 10 else "**missed** (10x)",
        ],
    ]
    # "**met**" is spelled plainly in the README; keep the bold only on missed
    for row in rows:
        row[4] = row[4].replace("**met**", "met")
    rep.table(
        f"pool_cuda.json cases (ratio = baseline_us / ours_us); CPU-machine row {f['pool_python']}",
        "| | kvpool | baseline | ratio | target |",
        rows,
    )
    alone = pick(g, "pool_python_h200.json")  # the same Python cases, run alone on the host
    if alone.exists():
        a16 = {x["name"]: x for x in load(alone)["cases"]}["alloc_many16_free_many"]
        rep.info(
            f"pool_python_h200.json (not quoted): alloc_many(16) + free_many "
            f"{rnd(a16['ours_us'], 2)} us vs {rnd(a16['baseline_us'], 2)} us, "
            f"{rnd(a16['baseline_us'] / a16['ours_us'], 2)}x",
            src=str(alone),
        )


# The criterion groups of rust/core/benches/free_list.rs: blocks per call, and the table's label.
GROUP_BLOCKS = {"single": 1, "batch16": 16, "batch16_scattered": 16, "batch256": 256}
GROUP_OF_BLOCKS = {1: "single", 16: "batch16", 256: "batch256"}
GROUP_LABELS = {"batch16_scattered": "16, ids scattered"}


def bench_free_list(rep, f):
    rep.section("bench/README.md Results", "Rust free list")
    d = load(pick(f["free_list"], "free_list_h200.json"))
    res = d["results"]
    threads = sorted({r["threads"] for r in res})
    rows = []
    # One row per benchmark group (batch16_scattered shares its batch size with batch16).
    for group in sorted({r["group"] for r in res}, key=lambda g: (GROUP_BLOCKS[g], g)):
        by_t = {r["threads"]: r for r in res if r["group"] == group}
        cells = [GROUP_LABELS.get(group, str(GROUP_BLOCKS[group]))]
        for t in threads:
            r = by_t[t]
            x = ratio2(r["mutex_ns_per_block"] / r["ours_ns_per_block"])  # from the raw ns
            if t == 1:
                x += f" ({rnd(r['ours_ns_per_block'], 1)} vs {rnd(r['mutex_ns_per_block'], 1)} ns)"
            cells.append(x)
        rows.append(cells)
    rep.table(
        f"{f['free_list']}/free_list_h200.json results: mutex_ns_per_block / ours_ns_per_block",
        "| blocks per call | "
        + " | ".join(("1 thread" if t == 1 else str(t)) for t in threads)
        + " |",
        rows,
    )

    def speed(bpc, t):
        r = [x for x in res if x["group"] == GROUP_OF_BLOCKS[bpc] and x["threads"] == t][0]
        return r["mutex_ns_per_block"] / r["ours_ns_per_block"]

    many = all(speed(b, t) >= 3 for b in (1, 16, 256) for t in (8, 16))
    rep.fig(
        "Targets: >= 3x the mutex at 8 and 16 threads for every batch size: **{}**",
        status(many),
        src="results threads 8, 16",
    )
    single_ok = all(1 / speed(b, 1) <= 1.2 for b in (1, 16))
    rep.fig(
        "Single-threaded within 1.2x of the mutex for 1 and 16 blocks per call: **{}** ({}x and "
        "{}x slower",
        status(single_ok),
        rnd(1 / speed(1, 1), 2),
        rnd(1 / speed(16, 1), 1),
        src="results threads 1: ours_ns_per_block / mutex_ns_per_block",
    )
    rep.info(
        f"commit {prov_commit(f['free_list'] / 'free_list_h200.json')}",
        src="free_list_h200.json provenance.commit",
    )


def bench_tables_growable(rep, f):
    g = f["gpu"]
    rep.section("bench/README.md Results", "block tables")
    t = load(g / "tables_cuda.json")
    p = t["paths"]
    ours = p["ours_append_sync_cuda"]["median_us"]
    inc = p["incremental_numpy_pinned_async"]["median_us"]
    reb = p["rebuild_numpy_cupy_asarray"]["median_us"]
    rep.fig(
        "{} requests growing one token per step",
        t["config"]["num_requests"],
        src="tables_cuda.json config.num_requests",
    )
    rep.fig(
        "`append_tokens_many` + asynchronous `sync` {} us host time per step (median), against "
        "{} us for an incremental NumPy table with a pinned, asynchronous upload ({}x) and {} us "
        "for a NumPy rebuild + `cupy.asarray` ({}x). Targets < 20 us per step and >= 5x the "
        "rebuild: **{}**",
        rnd(ours, 1),
        rnd(inc, 1),
        rnd(inc / ours, 2),
        rnd(reb, 0),
        rnd(reb / ours, 1),
        status(all(x["pass"] for x in t["targets"])),
        src="tables_cuda.json paths.*.median_us, targets",
    )

    rep.section("bench/README.md Results", "elastic pool")
    gr = load(pick(g, "growable_h200.json"))
    cp = gr["copy_path"]
    rep.fig(
        "{} GiB live, grow by {} GiB; allocate-larger + copy + free {} ms in the same run; "
        "target >= {}x",
        rnd(gr["live_bytes"] / 2**30),
        rnd(gr["grow_bytes"] / 2**30),
        rnd(cp["grow_ms"], 2),
        rnd(gr["target_speedup"]),
        src="growable_h200.json copy_path",
    )
    rows = []
    for mib in (256, 128, 32):  # the README's order
        grow = [v for v in gr["vmm"] if v["chunk_bytes"] >> 20 == mib and v["how"] == "pool.grow"][
            0
        ]
        dem = [v for v in gr["vmm"] if v["chunk_bytes"] >> 20 == mib and v["how"] != "pool.grow"][0]
        ok = grow["meets_target"] and dem["meets_target"]
        rows.append(
            [
                f"{mib} MiB" + (" (default)" if mib == 256 else ""),
                rnd(grow["grow_ms"], 2) + " ms",
                rnd(grow["speedup_vs_copy"], 1) + "x",
                rnd(dem["grow_ms"], 2) + " ms",
                rnd(dem["speedup_vs_copy"], 1) + "x",
                "met" if ok else "**missed**",
            ]
        )
    rep.table(
        "growable_h200.json vmm (pool.grow, alloc_many on demand)",
        "| chunk | `grow()` | ratio | `alloc_many` on demand | ratio | target |",
        rows,
    )
    g256 = [v for v in gr["vmm"] if v["chunk_bytes"] >> 20 == 256 and v["how"] == "pool.grow"][0]
    rep.fig(
        "Each figure is the median of {} (all five in the JSON's `grow_ms_all`; {} ms for "
        "`grow()` at 256 MiB)",
        gr["reps"],
        rng(g256["grow_ms_all"]),
        src="growable_h200.json reps, vmm[256 MiB pool.grow].grow_ms_all",
    )


# decode rows: B*L >= 128k is "large" (the ceiling target), below it "small"
LARGE_TOKENS = 128 * 1024
SMALL_ORDER = ["1x4096", "16x512", "8x8192", "1x32768"]  # the order bench/README lists them in


def is_large(r):
    return r["batch"] * r["seq_len"] >= LARGE_TOKENS


def is_default(r):
    """The decode grid's reference configuration: fp16, D=128, Hq 32, Hkv 8, block 16, unragged."""
    return (
        r.get("dtype", "float16") == "float16"
        and r["head_dim"] == 128
        and r["num_q_heads"] == 32
        and r.get("num_kv_heads", 8) == 8
        and r["block_size"] == 16
        and not r.get("ragged", False)
    )


def decode_groups(rows):
    return {
        # "batches of 128k+ tokens (D=128)" / "Large shapes": the reference configuration only
        "large": [r for r in rows if is_default(r) and is_large(r)],
        # "small shapes" / "Small and single-request shapes": every unragged row below 128k
        # tokens, whatever its dtype, D, Hq or block size
        "small": [r for r in rows if not r["ragged"] and not is_large(r)],
    }


def best_fi(r):
    """The faster FlashInfer mode's time, None where neither ran."""
    times = [t for t in (r.get("flashinfer_us"), r.get("flashinfer_tc_us")) if t]
    return min(times) if times else None


def measured(rows, key):
    """Rows the benchmark measured (a row that failed has an 'error' and no time); the rest named."""
    bad = [r for r in rows if "error" in r or not r.get(key)]
    for r in bad:
        print(
            f"  !! row {r.get('shape')} {r.get('dtype', '')} D={r.get('head_dim')} left out: "
            f"{r.get('error', 'no ' + key)}"
        )
    return [r for r in rows if r not in bad]


def variant(r, with_shape):
    """'D=256 1 x 4096', 'Hq=8', '32x8192 ragged': how a decode row differs from the default."""
    parts = []
    if r["dtype"] != "float16":
        parts.append("bf16")
    if r["head_dim"] != 128:
        parts.append(f"D={r['head_dim']}")
    if r["num_q_heads"] != 32:
        parts.append(f"Hq={r['num_q_heads']}")
    if r["block_size"] != 16:
        parts.append(f"block {r['block_size']}")
    shape = f"{r['batch']} x {r['seq_len']}"
    if r["ragged"]:
        return f"{r['batch']}x{r['seq_len']} ragged" + "".join(" " + p for p in parts)
    if with_shape or not parts:
        parts.append(shape)
    return " ".join(parts)


def decode_table_rows(rows):
    """The rows bench/README.md's decode table shows, in its order (the rest are in the JSON)."""

    def pick(shape, D=128, Hq=32, ragged=False):
        found = [
            r
            for r in rows
            if r["shape"].rstrip("r") == shape
            and r["head_dim"] == D
            and r["num_q_heads"] == Hq
            and r["dtype"] == "float16"
            and r["block_size"] == 16
            and r["ragged"] == ragged
        ]
        if not found:
            print(f"  !! decode row {shape} D={D} Hq={Hq} ragged={ragged} is not in the JSON")
        return found

    main = [r for r in rows if is_default(r)]  # every shape at the reference configuration
    return main + [
        r
        for p in (
            pick("1x4096", 64),
            pick("32x4096", 64),
            pick("32x4096", 192),
            pick("32x4096", 80),
            pick("1x4096", Hq=64),
            pick("32x8192", ragged=True),
        )
        for r in p[:1]
    ]


def bench_decode(rep, f):
    rep.section("bench/README.md Results", "paged decode attention, v4")
    d = load(pick(f["gpu"], "decode/decode_h200_v4.json"))
    rows = measured(d["rows"], "kvpool_us")
    rep.fig(
        "decode/decode_h200_v4.json` (`decode/bench.log`), {} rows; read ceiling {} TB/s",
        len(d["rows"]),
        rnd(d["ceiling_tb_s"], 2),
        src="decode_h200_v4.json rows, ceiling_tb_s",
    )
    out = []
    for r in decode_table_rows(rows):
        fi = best_fi(r)
        out.append(
            [
                f"{r['batch']}x{r['seq_len']}" + (" ragged" if r["ragged"] else ""),
                "fp16" if r["dtype"] == "float16" else "bf16",
                str(r["head_dim"]),
                str(r["num_q_heads"]),
                f"{rnd(r['kvpool_us'], 1)} ({rnd(r['kvpool_frac'], 2)})",
                "not run"
                if r.get("sdpa_cudnn_us") is None
                else f"{rnd(r['sdpa_cudnn_us'], 1)} ({rnd(r['sdpa_cudnn_frac'], 2)})",
                rnd(r["flashinfer_us"], 1) if r.get("flashinfer_us") else "n/a",
                rnd(r["flashinfer_tc_us"], 1) if r.get("flashinfer_tc_us") else "n/a",
                "" if fi is None else rnd(best_fi(r) / r["kvpool_us"], 2),
                rnd(r["best_peer_us"] / r["kvpool_us"], 2),
            ]
        )
    rep.table(
        "decode_h200_v4.json rows: every fp16 D=128 Hq32 block-16 shape, then D=64 1x4096 and "
        "32x4096, D=192, D=80, Hq=64 1x4096, 32x8192 ragged; frac = kvpool_frac, ratios "
        "from the raw us",
        "| B x L | dtype | D | Hq | kvpool us | SDPA cuDNN | FlashInfer | FlashInfer TC | "
        "x best FI | x best peer |",
        out,
    )
    rep.fig(
        "FlashInfer {} decode supports only head dims",
        load(pick(f["gpu"], "prefill_h200.json"))["flashinfer"],
        src="prefill_h200.json flashinfer (the decode JSON does not name its version)",
    )
    shown = [id(r) for r in decode_table_rows(rows)]
    rep.info(
        "rows only in the JSON (README: 'D=96/112/256, block sizes 1/64/128, bf16, Hq=8 and "
        "64, the other ragged rows'): "
        + ", ".join(variant(r, True) for r in rows if id(r) not in shown),
        src="decode_h200_v4.json rows",
    )
    grp = decode_groups(rows)
    large, small = grp["large"], grp["small"]
    reach = [r["shape"] for r in large if r["kvpool_frac"] >= 0.95]
    miss = [r["shape"] for r in large if r["kvpool_frac"] < 0.95]
    rep.fig(
        "Large shapes: {} of the ceiling; only {} reach the 0.95 target (**missed** on {}); {}x "
        "the best FlashInfer mode and {}x cuDNN.",
        rng([r["kvpool_frac"] for r in large]),
        join_and(reach),
        ", ".join(miss),
        rng([best_fi(r) / r["kvpool_us"] for r in large if best_fi(r)]),
        rng([r["sdpa_cudnn_us"] / r["kvpool_us"] for r in large if r.get("sdpa_cudnn_us")]),
        src="large = fp16 D=128 Hq32 block16 unragged rows with B*L >= 128k",
    )
    shapes = sorted(
        {r["shape"] for r in small},
        key=lambda s: SMALL_ORDER.index(s) if s in SMALL_ORDER else len(SMALL_ORDER),
    )
    best = max(small, key=lambda r: r["best_peer_us"] / r["kvpool_us"])
    vs = [r["best_peer_us"] / r["kvpool_us"] for r in small]
    rep.fig(
        "Small and single-request shapes ({}): {}x the best peer",
        ", ".join(s.replace("x", " x ") for s in shapes),
        rng(vs),
        src="small = every unragged row (any dtype, D, Hq, block) with B*L < 128k: "
        "best_peer_us / kvpool_us",
    )
    rep.fig(
        "target is **{}** (best: {}, {}x)",
        status(min(vs) >= 1.3),
        variant(best, True),
        rnd(max(vs), 2),
        src="small rows, the highest best_peer_us / kvpool_us",
    )
    peers = {}
    for r in small:
        cand = {
            "cuDNN": r.get("sdpa_cudnn_us"),
            "SDPA flash": r.get("sdpa_flash_us"),
            "FlashInfer": r.get("flashinfer_us"),
            "FlashInfer TC": r.get("flashinfer_tc_us"),
        }
        name = min((v, k) for k, v in cand.items() if v is not None)[1]
        peers.setdefault(name, []).append(variant(r, True))
    rep.info(
        "best peer on the small rows (README: 'cuDNN, or FlashInfer at D=256'): "
        + "; ".join(f"{k}: {', '.join(v)}" for k, v in peers.items()),
        src="small rows",
    )
    unsplit = [r for r in rows if r["num_splits"] == 1]
    split = [r for r in rows if r["num_splits"] > 1]
    exc = sorted(
        [r for r in unsplit if r["kvpool_host_us"] >= 20], key=lambda r: r["kvpool_host_us"]
    )
    rep.fig(
        "Host time per call (`kvpool_host_us`) is {} us unsplit (exceptions: {}",
        rng([r["kvpool_host_us"] for r in unsplit if r["kvpool_host_us"] < 20], 1),
        join_and(f"{variant(r, False)} {rnd(r['kvpool_host_us'], 1)} us" for r in exc),
        src="rows num_splits == 1, kvpool_host_us; exceptions: those at or above the 20 us target",
    )
    rep.fig(
        "and {} us with a split",
        rng([r["kvpool_host_us"] for r in split], 1),
        src="rows num_splits > 1, kvpool_host_us",
    )
    vs_fi = [
        r["kvpool_host_us"] / r["flashinfer_tc_host_us"]
        for r in rows
        if r.get("flashinfer_tc_host_us")
    ]
    rep.fig(
        "Within one run, ours is {}x the host time of FlashInfer's tensor-core `run`, median {}",
        rng(vs_fi),
        rnd(statistics.median(vs_fi), 2),
        src="rows kvpool_host_us / flashinfer_tc_host_us",
    )
    rep.info(
        f"< 20 us host target met on {sum(r['kvpool_host_us'] < 20 for r in unsplit)} of "
        f"{len(unsplit)} unsplit rows, {sum(r['kvpool_host_us'] < 20 for r in split)} of "
        f"{len(split)} split rows (README: 'met on most unsplit shapes and **missed** on most "
        "split shapes')",
        src="rows kvpool_host_us",
    )
    rep.info(
        "sanitizers: {} errors in decode_memcheck.log + decode_racecheck.log".format(
            sanitizer_errors(f["gpu"] / "decode_memcheck.log", f["gpu"] / "decode_racecheck.log")
        ),
        src="compute-sanitizer summaries",
    )


def fp8_vs_fp16(r):
    return r["kvpool_fp16_us"] / r["kvpool_fp8_us"]


def fp8_vs_fi(r):
    return min(r["flashinfer_fp8_us"], r["flashinfer_tc_fp8_us"]) / r["kvpool_fp8_us"]


def bench_fp8(rep, f):
    g = f["gpu"]
    rep.section("bench/README.md Results", "fp8 decode and prefill")
    d = load(pick(g, "fp8/fp8_h200.json"))
    rows = measured(d["rows"], "kvpool_fp8_us")
    rep.fig(
        "bytes, ceiling {} TB/s", rnd(d["ceiling_tb_s"], 2), src="fp8/fp8_h200.json ceiling_tb_s"
    )
    out = [
        [
            r["shape"],
            rnd(r["kvpool_fp16_us"], 1),
            rnd(r["kvpool_fp8_us"], 1),
            rnd(r["flashinfer_fp8_us"], 1),
            rnd(r["flashinfer_tc_fp8_us"], 1),
            rnd(fp8_vs_fp16(r), 2) + "x",
            rnd(fp8_vs_fi(r), 2) + "x",
        ]
        for r in rows
    ]
    rep.table(
        "fp8/fp8_h200.json rows (all; ratios from the raw us)",
        "| B x L | our fp16 us | our fp8 us | FlashInfer fp8 | FlashInfer TC fp8 | "
        "fp8 vs our fp16 | fp8 vs best FI fp8 |",
        out,
    )
    large = [r for r in rows if is_large(r)]
    rep.fig(
        "Our fp8 kernel reads half the bytes and reaches {} of the ceiling (our fp16 in the same "
        "run: {})",
        rng([r["kvpool_fp8_frac"] for r in rows]),
        rng([r["kvpool_fp16_frac"] for r in rows]),
        src="rows kvpool_fp8_frac, kvpool_fp16_frac",
    )
    rep.fig(
        "On the large shapes (B*L >= 128k) it is {}x our fp16 decode: the 1.8x target is **{}**",
        rng([fp8_vs_fp16(r) for r in large]),
        status(min(fp8_vs_fp16(r) for r in large) >= 1.8),
        src="rows with B*L >= 128k",
    )
    not_tc = [r["shape"] for r in rows if r["flashinfer_fp8_us"] < r["flashinfer_tc_fp8_us"]]
    rep.fig(
        "It is {}x FlashInfer's faster fp8 mode (the tensor-core one on every shape but {}) on "
        "every shape: **{}**",
        rng([fp8_vs_fi(r) for r in rows]),
        join_and(not_tc) if not_tc else "none",
        status(min(fp8_vs_fi(r) for r in rows) >= 1),
        src="rows flashinfer{,_tc}_fp8_us",
    )
    low = min(rows, key=fp8_vs_fp16)
    rep.fig(
        "The unflattering row is {}, where fp8 is {}x our own fp16 decode",
        low["shape"],
        rnd(fp8_vs_fp16(low), 2),
        src="row with the lowest fp16/fp8 time ratio",
    )
    rep.fig(
        "fp8 GPU tests: {} passed", passed(pick(g, "fp8/gpu_tests.log"))[0], src="fp8/gpu_tests.log"
    )
    pre = load(pick(g, "fp8/fp8_prefill_h200.json"))["rows"]
    parts = []
    for i, r in enumerate(pre):
        shape = r["shape"] + (" cached" if " on " in r["shape"] else "")
        tail = " TFLOP/s against our fp16 prefill's " if i == 0 else " against "
        parts.append(
            f"{shape} {rnd(r['kvpool_fp8_tflops'], 1)}{tail}"
            f"{rnd(r['kvpool_fp16_tflops'], 1)} "
            f"({rnd(r['kvpool_fp16_us'] / r['kvpool_fp8_us'], 2)}x)"
        )
    rep.fig(
        "{}: the fp8 prefill is {} our fp16 prefill on every shape",
        ", ".join(parts),
        "slower than"
        if all(r["kvpool_fp8_us"] > r["kvpool_fp16_us"] for r in pre)
        else "NOT slower than",
        src="fp8/fp8_prefill_h200.json rows",
    )


PREFILL_PEERS = {
    "flashinfer_fa2": "fa2",
    "flashinfer_fa3": "fa3",
    "sdpa_flash": "SDPA flash",
    "sdpa_cudnn": "cuDNN",
}


def prefill_best_peer(r):
    return min(((PREFILL_PEERS[k], r[f"{k}_us"]) for k in PREFILL_PEERS), key=lambda p: p[1])


def bench_prefill(rep, f):
    g = f["gpu"]
    rep.section("bench/README.md Results", "prefill")
    d = load(pick(g, "prefill_h200.json"))
    rows = measured(d["rows"], "kvpool_us")
    fp16 = [r for r in rows if r["dtype"] == "float16"]
    bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
    rep.fig(
        "dense fp16 matmul {} TFLOP/s in the same run",
        rnd(d["dense_matmul_tflops"]["float16"]),
        src="prefill_h200.json dense_matmul_tflops.float16",
    )

    out = []
    for i, r in enumerate(fp16):
        shape = r["shape"] + (
            " cached"
            if " on " in r["shape"] and "chunk" not in r["shape"] and "spec" not in r["shape"]
            else ""
        )
        frac = rnd(r["kvpool_frac_dense"], 2) + (" of dense" if i == 0 else "")
        out.append(
            [
                shape,
                f"{rnd(r['kvpool_tflops'], 1)} ({frac})",
                rnd(r["flashinfer_fa2_tflops"], 1),
                rnd(r["flashinfer_fa3_tflops"], 1),
                rnd(r["sdpa_cudnn_tflops"], 1),
                rnd(r["flashinfer_fa2_us"] / r["kvpool_us"], 2),
                rnd(prefill_best_peer(r)[1] / r["kvpool_us"], 2),
            ]
        )
    rep.table(
        "prefill_h200.json fp16 rows (ratios from the raw us; best peer = fastest of fa2, fa3, "
        "SDPA flash, SDPA cuDNN)",
        "| shape | kvpool | FlashInfer fa2 | FlashInfer fa3 | SDPA cuDNN | x fa2 | x best peer |",
        out,
    )
    rep.fig(
        "Our prefill is {}x FlashInfer fa2 and {}x the best peer on every shape",
        rng([r["flashinfer_fa2_us"] / r["kvpool_us"] for r in fp16]),
        rng([prefill_best_peer(r)[1] / r["kvpool_us"] for r in fp16]),
        src="fp16 rows",
    )
    faster = [
        f"{PREFILL_PEERS[k]} on {r['shape']}"
        for r in fp16
        for k in PREFILL_PEERS
        if r[f"{k}_us"] > r["kvpool_us"]
    ]
    rep.info(
        "ours faster than (README: 'except fa3 and cuDNN on the 64 x 4 speculative shape'): "
        + (", ".join(faster) or "none"),
        src="fp16 rows *_us > kvpool_us",
    )
    rep.fig(
        "bf16 rows are in the JSON ({}x fa2, {}x the best peer)",
        rng([r["flashinfer_fa2_us"] / r["kvpool_us"] for r in bf16]),
        rng([prefill_best_peer(r)[1] / r["kvpool_us"] for r in bf16]),
        src="bf16 rows",
    )
    rep.fig(
        "Tests: {} passed (`prefill_tests.log`); memcheck and racecheck {} errors",
        passed(g / "prefill_tests.log")[0],
        sanitizer_errors(g / "prefill_memcheck.log", g / "prefill_racecheck.log"),
        src="prefill_tests.log, prefill_{memcheck,racecheck}.log",
    )


def secs(x):
    """TTFT seconds as the prefix table prints them: 2 decimals below 1 s, else 1."""
    return rnd(x, 2) if x < 1 else rnd(x, 1)


def bench_prefix(rep, f):
    rep.section("bench/README.md Results", "prefix caching in the scheduler")
    runs = load(f["prefix_sim"])["runs"]
    sp, mt = runs["system_prompts"], runs["multiturn"]
    rep.fig(
        "{} GiB of KV ({} blocks of {} tokens) for every run, max_model_len {}, {} requests, "
        "watermark {}",
        rnd(sp["kv_memory_bytes"] / 2**30),
        thou(sp["num_blocks"]),
        sp["model"]["block_size"],
        sp["scheduler"]["max_model_len"],
        thou(sp["workload"]["num_requests"]),
        sp["scheduler"]["watermark"],
        src="prefix_sim runs.system_prompts",
    )
    w, m = sp["workload"], mt["workload"]
    rep.fig(
        "ShareGPT-like requests at {}/s (Poisson), each prompt starting with one of {} system "
        'prompts of {} tokens. "multi-turn": {} conversations of up to {} turns (ShareGPT '
        "lengths per message), {} new conversations/s, turns {} s apart on average",
        rnd(w["rate_per_s"]),
        w["num_prefixes"],
        thou(w["prefix_tokens"]),
        thou(m["conversations"]),
        m["turns"],
        rnd(m["conversation_rate_per_s"]),
        rnd(m["think_time_s"]),
        src="prefix_sim runs.*.workload",
    )
    cols = []
    for run in (sp, mt):
        res = run["results"]
        cols += [(res["paged"], None), (res["paged_prefix_caching"], run["prefix_caching"])]
    rows = [
        ["prefix hit rate (tokens)"]
        + ["-" if pc is None else rnd(r["prefix_hit_rate"], 3) for r, pc in cols]
    ]
    rows.append(
        ["prefill tokens"]
        + [
            thou(r["prefill_tokens"])
            if pc is None
            else f"{thou(r['prefill_tokens'])} (-{pct(pc['prefill_tokens_saved_fraction'])} %)"
            for r, pc in cols
        ]
    )
    rows.append(
        ["output tokens / s (modelled)"]
        + [
            thou(r["modelled_output_tokens_per_s"])
            if pc is None
            else f"{thou(r['modelled_output_tokens_per_s'])} ({rnd(pc['modelled_throughput_ratio'], 2)}x)"
            for r, pc in cols
        ]
    )
    rows.append(
        ["TTFT mean / p99 (modelled)"]
        + [f"{secs(r['ttft_mean_s'])} s / {secs(r['ttft_p99_s'])} s" for r, _ in cols]
    )
    rows.append(
        ["peak / mean running"]
        + [f"{r['peak_running']} / {rnd(r['mean_running'], 1)}" for r, _ in cols]
    )
    rows.append(["preemptions"] + [str(r["preemptions"]) for r, _ in cols])
    rep.table(
        "prefix_sim runs.{system_prompts,multiturn}.results.{paged,paged_prefix_caching}",
        "| | system prompts, off | on | multi-turn, off | on |",
        rows,
    )
    rep.fig(
        "and ends at {})",
        rnd(mt["prefix_caching"]["hit_rate_tokens"], 2),
        src="prefix_sim runs.multiturn.prefix_caching.hit_rate_tokens (the peak near 0.55 is "
        "read off the plot)",
    )
    c1, c2 = sp["results"]["contiguous"], mt["results"]["contiguous"]
    rep.fig(
        "Contiguous reservation of max_model_len ran both at {} concurrent requests ({} and {} "
        "output tokens/s)",
        c1["peak_running"]
        if c1["peak_running"] == c2["peak_running"]
        else f"{c1['peak_running']}/{c2['peak_running']}",
        thou(c1["modelled_output_tokens_per_s"]),
        thou(c2["modelled_output_tokens_per_s"]),
        src="prefix_sim runs.*.results.contiguous.peak_running, modelled_output_tokens_per_s",
    )

    rep.section("bench/README.md Results", "prefix caching from Python")
    pc = load(f["prefix_cache"])
    rep.fig(
        "2-core VM at load {},",
        rnd(pc["provenance"]["machine"]["load_average_1m_before"], 1),
        src="prefix_cache provenance.machine.load_average_1m_before",
    )
    miss, hit, step = pc["add_miss"], pc["add_hit"], pc["decode_step"]

    def row(label, ours, py):
        return [
            label,
            rnd(ours["median_us"], 1) + " us",
            rnd(py["median_us"], 1) + " us",
            rnd(py["median_us"] / ours["median_us"], 1) + "x",
        ]

    n = pc["prompt_tokens"] // pc["block_size"]
    rep.table(
        "prefix_cache {add_miss,add_hit,decode_step}.*.median_us",
        "| | kvpool | pure Python, same algorithm and checks | |",
        [
            row(
                f"add a {pc['prompt_tokens']}-token prompt, full miss ({n} blocks hashed, "
                "evicting in steady state)",
                miss["ours"],
                miss["python"],
            ),
            row(
                f"add a {pc['prompt_tokens']}-token prompt, full hit ({n - 1} blocks revived, "
                "1 allocated)",
                hit["ours"],
                hit["python"],
            ),
            row(
                f"{pc['decode_requests']}-request decode step, append with token ids",
                step["ours_on"],
                step["python"],
            ),
        ],
    )
    r_miss = miss["python"]["median_us"] / miss["ours"]["median_us"]
    rep.fig(
        "In this run the full-miss add is {}x the Python baseline, {} the 10x aimed for",
        rnd(r_miss, 1),
        "short of" if r_miss < 10 else "meeting",
        src="prefix_cache add_miss",
    )
    rep.fig(
        "The full-hit add {} the 50 us target ({} us;",
        "meets" if hit["ours"]["median_us"] < 50 else "misses",
        rnd(hit["ours"]["median_us"], 1),
        src="prefix_cache add_hit.ours.median_us",
    )
    rep.fig(
        "Caching still adds {} % to the append of a decode step ({} against {} us without "
        "caching; {} % with `sync`) against 10 % aimed for",
        pct(step["caching_overhead"]),
        rnd(step["ours_on"]["median_us"], 1),
        rnd(step["ours_off"]["median_us"], 1),
        pct(step["caching_overhead_with_sync"]),
        src="prefix_cache decode_step",
    )


def hosttier(d):
    rows = [r for r in d["rows"] if r["method"] == "batch" and r["num_blocks"] >= 64]

    c = d["ceiling_1gib"]
    return {
        # 2 MiB blocks, batched copies, 64-4096 blocks, contiguous or fragmented
        "big": rng(
            [
                v
                for r in rows
                if r["block_bytes"] == 2 << 20
                for v in (r["swap_out_vs_ceiling"], r["swap_in_vs_ceiling"])
            ]
        ),
        # 64 KiB blocks, batched copies, 64-4096 blocks
        "small_contig": rng(
            [
                v
                for r in rows
                if r["block_bytes"] == 64 << 10 and not r["fragmented"]
                for v in (r["swap_out_vs_ceiling"], r["swap_in_vs_ceiling"])
            ]
        ),
        "small_frag": rng(
            [
                v
                for r in rows
                if r["block_bytes"] == 64 << 10 and r["fragmented"]
                for v in (r["swap_out_vs_ceiling"], r["swap_in_vs_ceiling"])
            ]
        ),
        "ceiling": rnd(max(c["h2d_gbps"], c["d2h_gbps"]), 1),
    }


def bench_hosttier(rep, f):
    g = f["gpu"]
    rep.section("bench/README.md Results", "host tier")
    d = load(pick(g, "hosttier/swap_h200.json"))
    h = hosttier(d)

    def row(block, n, frag, method):
        return [
            r
            for r in d["rows"]
            if r["block_bytes"] == block
            and r["num_blocks"] == n
            and r["fragmented"] == frag
            and r["method"] == method
        ][0]

    big = max(r["num_blocks"] for r in d["rows"])
    bb, br = row(2 << 20, big, True, "batch"), row(2 << 20, big, True, "runs")
    sb, sr = row(64 << 10, big, True, "batch"), row(64 << 10, big, True, "runs")
    s64 = row(64 << 10, 64, True, "batch")

    def gbps(r):
        return f"{rnd(r['swap_out_gbps'], 1)}/{rnd(r['swap_in_gbps'], 1)} GB/s"

    def loop(r):
        return f"{rnd(r['per_block_loop']['d2h_gbps'], 1)}/{rnd(r['per_block_loop']['h2d_gbps'], 1)} GB/s"

    rep.fig(
        "`cudaMemcpyAsync` ceiling {} GB/s in the same run): 2 MiB blocks (Llama-3-8B layout) "
        "swap out and in at {} of that ceiling for 64-{} blocks, contiguous or fragmented ({} "
        "fragmented: {} batched, {} with per-run copies; a per-block `cudaMemcpyAsync` loop {})",
        h["ceiling"],
        h["big"],
        big,
        big,
        gbps(bb),
        gbps(br),
        loop(br),
        src="hosttier/swap_h200.json ceiling_1gib (max of h2d, d2h); rows method=batch "
        "num_blocks>=64 swap_{out,in}_vs_ceiling; runs rows' per_block_loop (out=d2h, in=h2d)",
    )
    rep.fig(
        "64 KiB blocks: {} contiguous; fragmented {} (64 blocks {} out / {} in; {} blocks {} / {}, "
        "{} batched; per-run copies {} against a per-block loop's {}, {}x/{}x)",
        h["small_contig"],
        h["small_frag"],
        rnd(s64["swap_out_vs_ceiling"], 2),
        rnd(s64["swap_in_vs_ceiling"], 2),
        big,
        rnd(sb["swap_out_vs_ceiling"], 2),
        rnd(sb["swap_in_vs_ceiling"], 2),
        gbps(sb),
        gbps(sr),
        loop(sr),
        rnd(sr["swap_out_gbps"] / sr["per_block_loop"]["d2h_gbps"], 2),
        rnd(sr["swap_in_gbps"] / sr["per_block_loop"]["h2d_gbps"], 2),
        src="rows 64 KiB, method=batch num_blocks>=64; the 4096-block fragmented runs row",
    )
    rep.fig(
        "memcheck {} errors (`hosttier/sanitizer.log`)",
        sanitizer_errors(pick(g, "hosttier/sanitizer.log")),
        src="hosttier/sanitizer.log",
    )


def size_bytes(s):
    """'256MiB' -> 268435456."""
    n, unit = re.fullmatch(r"(\d+)\s*([KMGT])iB", s).groups()
    return int(n) << (10 * " KMGT".index(unit))


def gib_label(s):
    """'64GiB' -> '64 GiB'."""
    return re.sub(r"(\d)([KMGT]iB)", r"\1 \2", s)


def readme_swap_sim(rep, f):
    rep.section("README.md Results", "preemption by swap (a shared 2-core CPU machine)")
    d = load(f["swap_sim"])
    rows = d["rows"]
    top = [
        r for r in rows if r["mode"] == "auto" and r["cpu_kv_memory"] == rows[0]["cpu_kv_memory"]
    ]
    fast = max(top, key=lambda r: r["host_link_gbps"])
    slow = min((r for r in rows if r["mode"] == "swap"), key=lambda r: r["host_link_gbps"])
    rep.fig(
        "| preemption by swap, modelled, {} of Llama-3-8B KV, {} requests | {}x, {} recomputed "
        "tokens against {}; a {} GB/s link forced to swap {}x | recompute only |",
        gib_label(d["args"]["kv_memory"]),
        thou(d["args"]["num_requests"]),
        rnd(fast["throughput_ratio"], 3),
        "no" if fast["recomputed_tokens_tier"] == 0 else thou(fast["recomputed_tokens_tier"]),
        thou(fast["recomputed_tokens_no_tier"]),
        f"{slow['host_link_gbps']:g}",
        rnd(slow["throughput_ratio"], 3),
        src="swap_sim rows[fastest link, auto] and rows[slowest link, swap]: throughput_ratio, "
        "recomputed_tokens_*",
    )


def bench_swap_sim(rep, f):
    rep.section("bench/README.md Results", "preemption by swap against recompute")
    d = load(f["swap_sim"])
    rows, rep0 = d["rows"], d["reports"][0]
    first = rows[0]
    rep.fig(
        "{} ShareGPT-like requests at t=0, Llama-3-8B, {} of GPU KV ({} blocks), max_model_len "
        "{}, {} running at most",
        thou(d["args"]["num_requests"]),
        gib_label(d["args"]["kv_memory"]),
        thou(rep0["num_blocks"]),
        d["args"]["max_model_len"],
        d["args"]["max_running_seqs"],
        src="swap_sim args, reports[0].num_blocks",
    )
    paged = rep0["results"]["paged"]
    rep.fig(
        "({} preemptions, {} recomputed tokens, {} output tokens/s)",
        thou(first["preemptions_no_tier"]),
        thou(first["recomputed_tokens_no_tier"]),
        thou(first["output_tokens_per_s_no_tier"]),
        src="swap_sim rows[0].*_no_tier (= reports[0].results.paged: "
        f"{paged['preemptions']} preemptions)",
    )
    out = []
    for r in rows:
        full = f" ({thou(r['tier_full'])})" if r["tier_full"] else ""
        out.append(
            [
                f"{r['host_link_gbps']:g} GB/s",
                r["mode"],
                gib_label(r["cpu_kv_memory"]),
                f"{thou(r['by_swap'])} / {thou(r['by_recompute'])}{full}",
                thou(r["recomputed_tokens_tier"]),
                rnd(r["swapped_gib"], 1) if r["swapped_gib"] else "0",
                rnd(r["throughput_ratio"], 3) + "x",
                rnd(r["ttft_mean_ratio"], 3) + "x",
                rnd(r["ttft_p99_ratio"], 3) + "x",
                rnd(r["latency_p99_ratio"], 3) + "x",
            ]
        )
    rep.table(
        "swap_sim rows (all, in file order)",
        "| link | mode | tier | swap / recompute (tier full) | recomputed tokens | swapped GiB | "
        "throughput | TTFT mean | TTFT p99 | latency p99 |",
        out,
    )
    fast = rows[0]
    rep.fig(
        "swapping saves every recomputed token and gains {} % throughput and {} % mean TTFT",
        pct(fast["throughput_ratio"] - 1, 1),
        pct(1 - fast["ttft_mean_ratio"], 1),
        src=f"swap_sim rows[0] ({fast['host_link_gbps']:g} GB/s {fast['mode']})",
    )
    forced = sorted(
        [r for r in rows if r["mode"] == "swap" and r["throughput_ratio"] < 1],
        key=lambda r: -r["host_link_gbps"],
    )
    rep.fig(
        "where forcing swap loses {}",
        join_and(pct(1 - r["throughput_ratio"]) + " %" for r in forced),
        src="swap_sim rows mode=swap below 1x: "
        + ", ".join(f"{r['host_link_gbps']:g} GB/s" for r in forced),
    )
    mid = [
        r
        for r in rows
        if r["mode"] == "auto" and r["by_swap"] and r["by_recompute"] and not r["tier_full"]
    ]
    for r in mid:
        rep.fig(
            "`auto` still swaps {} victims",
            r["by_swap"],
            src=f"swap_sim row {r['host_link_gbps']:g} GB/s auto",
        )
        rep.fig(
            "ends {} % below no tier",
            pct(1 - r["throughput_ratio"], 1),
            src=f"swap_sim row {r['host_link_gbps']:g} GB/s auto throughput_ratio",
        )
    small = [r for r in rows if r["tier_full"]]
    for r in small:
        blocks = size_bytes(r["cpu_kv_memory"]) // rep0["model"]["block_bytes"]
        rep.fig(
            "A {} tier ({} blocks) is full for {} victims",
            gib_label(r["cpu_kv_memory"]),
            thou(blocks),
            thou(r["tier_full"]),
            src="swap_sim row with tier_full: cpu_kv_memory / reports[0].model.block_bytes, tier_full",
        )
    sw = [r for r in rows if r["mode"] == "swap"][0]
    rep.fig(
        "({} against {}): a swapped request",
        thou(sw["preemptions_tier"]),
        thou(sw["preemptions_no_tier"]),
        src="swap_sim rows mode=swap preemptions_*",
    )


def transfer(f):
    d = load(pick(f["gpu2"], "multigpu/transfer_h200x2.json"))
    out = {"byte_exact": d["byte_exact_samples"] and not d["mismatched_samples"]}
    for s in d["summary"]:
        out[s["num_blocks"]] = dict(s, ratio=s["nccl_contiguous_us"] / s["best_us"])
    return out


def tp_rows(f):
    return load(pick(f["gpu2"], "multigpu/tp_decode_h200x2.json"))["rows"]


def bench_multigpu(rep, f):
    rep.section("bench/README.md Results", "KV transfer between two GPUs, TP decode")
    tr = transfer(f)

    def t(us):
        return f"{rnd(us, 1)} us" if us < 1000 else f"{sig(us / 1000)} ms"

    rows = []
    for n in (1, 16, 256, 4096):  # the README shows these four of the eight sizes
        s = tr[n]
        rows.append(
            [
                str(n),
                f"{t(s['best_us'])} ({sig(s['best_gb_per_s'])} GB/s)",
                f"{t(s['nccl_contiguous_us'])} ({sig(s['nccl_contiguous_gb_per_s'])} GB/s)",
                rnd(s["ratio"], 2) + "x",
                sig(s["memcpy_peer_gb_per_s"]) + " GB/s",
            ]
        )
    rep.table(
        "multigpu/transfer_h200x2.json summary (1, 16, 256, 4096 blocks; ratio = "
        "nccl_contiguous_us / best_us)",
        "| blocks | kvpool best | NCCL contiguous send/recv | ratio | `cudaMemcpyPeer` |",
        rows,
    )
    sizes = [k for k in tr if isinstance(k, int)]
    rep.fig(
        "every sample {}",
        "byte-exact" if tr["byte_exact"] else "NOT byte-exact",
        src="transfer_h200x2.json byte_exact_samples, mismatched_samples",
    )
    rep.fig(
        "at every size ({}x)",
        rng([tr[k]["ratio"] for k in sizes]),
        src="transfer_h200x2.json summary, all sizes",
    )
    tp = tp_rows(f)
    mb = [r["kv_mb"] for r in tp]
    rep.fig(
        "2 GPUs vs 1 on {} MB-{} GB of KV: {}",
        min(mb),
        rnd(max(mb) / 1000, 1),
        ", ".join(
            f"{rnd(r['one_gpu_us'] / r['tp2_us'], 2)}x ({r['batch']}x{r['seq_len']})"
            for r in sorted(tp, key=lambda r: r["one_gpu_us"] / r["tp2_us"])
        ),
        src="multigpu/tp_decode_h200x2.json rows one_gpu_us / tp2_us, kv_mb",
    )
    rep.info(
        "TP outputs bitwise equal to one GPU: "
        + str(all(r["tp_equals_one_gpu_bitwise_one_split"] for r in tp)),
        src="tp_decode_h200x2.json rows",
    )
    rep.fig(
        "Two-GPU tests: {} passed",
        passed(pick(f["gpu2"], "multigpu/gpu2_tests.log"))[0],
        src="multigpu/gpu2_tests.log",
    )


def bench_transformers(rep, f):
    g = f["gpu"]
    rep.section("bench/README.md Results", "generation through transformers")
    gen = load(pick(g, "transformers/generate_h200.json"))
    rows, ra = gen["rows"], gen["ratios"]
    rep.fig(
        "{}-layer Llama-shaped bf16 model with random weights, {} ShareGPT-like requests, {} output "
        "tokens",
        gen["model"]["num_hidden_layers"],
        gen["workload"]["num_requests"],
        thou(rows["kvpool_loop"]["output_tokens"]),
        src="generate_h200.json model, workload, rows",
    )
    tps = {k: v["tokens_per_s"] for k, v in rows.items()}
    out = [
        [
            "kvpool loop, eager",
            thou(tps["kvpool_loop"]),
            rnd(ra["kvpool_loop_over_hf_dynamic_sdpa_tokens_per_s"], 1) + "x",
        ],
        [
            "kvpool loop, CUDA graphs",
            thou(tps["kvpool_loop_graphs"]),
            rnd(ra["kvpool_loop_graphs_over_hf_dynamic_sdpa_tokens_per_s"], 1) + "x",
        ],
        ["transformers dynamic cache", thou(tps["hf_dynamic_sdpa"]), "1.0x"],
        [
            "transformers continuous batching",
            thou(tps["hf_continuous_batching"]),
            f"(ours eager {rnd(ra['kvpool_loop_over_hf_continuous_batching_tokens_per_s'], 1)}x, graphs "
            f"{rnd(ra['kvpool_loop_graphs_over_hf_continuous_batching_tokens_per_s'], 1)}x)",
        ],
        [
            "transformers static cache, first 2 batches",
            thou(tps["hf_static_first_2_batches"]),
            f"(ours eager {rnd(ra['kvpool_loop_over_hf_static_first_2_batches_tokens_per_s'], 1)}x)",
        ],
    ]
    rep.table(
        "generate_h200.json rows.*.tokens_per_s, ratios.*",
        "| | tokens/s | x transformers dynamic cache (SDPA) |",
        out,
    )
    b1, b32 = ra["fixed_b1_ms_per_step"], ra["fixed_b32_ms_per_step"]
    rep.fig(
        "Batch 1, 128 tokens: {} ms/step eager, {} ms/step with CUDA graphs, {} ms/step for "
        "transformers' dynamic cache ({}x, {}x). Batch 32: {} / {} / {} ms/step",
        sig(b1["kvpool"]),
        sig(b1["kvpool_graphs"]),
        sig(b1["hf_dynamic"]),
        rnd(ra["fixed_b1_kvpool_over_hf_dynamic"], 1),
        rnd(ra["fixed_b1_kvpool_graphs_over_hf_dynamic"], 1),
        sig(b32["kvpool"]),
        sig(b32["kvpool_graphs"]),
        sig(b32["hf_dynamic"]),
        src="generate_h200.json ratios.fixed_b{1,32}_*",
    )
    rep.fig(
        "Tests: {} GPU tests passed (`tests.log`) and {} host tests (`cpu_tests.log`)",
        passed(pick(g, "transformers/tests.log"))[0],
        passed(pick(g, "transformers/cpu_tests.log"))[0],
        src="transformers/tests.log, transformers/cpu_tests.log",
    )
    greedy_paragraph(rep, f, readme=False)


# ---------------------------------------------------------------- main


def prov_commit(path):
    """'c3a772c (2026-12-01T03:26:36+00:00)' from a JSON's provenance (or its older forms)."""
    d = load(path)
    p = d.get("provenance") or d.get("environment") or d
    return f"{p.get('commit', '?')} ({p.get('date_utc') or p.get('date', '?')})"


NOT_FROM_DATA = """
Quoted figures this script does not recompute (not in the JSON of one run; check by hand):
  bench/README.md prefix caching from Python: "in five other runs", "20-84 %, median 77 %",
    "90 % before the step's stores were batched", "52.4 us before the tokens were hashed in
    place" (earlier runs)
  bench/README.md prefix caching in the scheduler: "peaks near 0.55 about 25 s in" (the plot)
  bench/README.md elastic pool: "22.3x in an earlier two-GPU-host run"
  bench/README.md swap sim: "Below about 9.7 GB/s", "n blocks x 210 us + 15 us", "27 us per
    token" (model constants); bench/FIGURES.md "below about 10 GB/s"
  bench/README.md fp8: "6 warps x 3 stages" (fp8_sweep.json at 270740b, not re-run)
  bench/FIGURES.md: "55 GB/s each way, 15 us per call" (the simulator's default host link)
  bench/README.md free list: the single-threaded rows of the lane run beside the GPU work
    ("1.10x and 1.16x", `free_list_h200.json` in the --gpu folder) and of 1e82866 ("1.18x and 1.42x")
  bench/README.md decode host time "at 14b2a4d ... 17.1-19.6 us unsplit and 13 of 22 met";
    prefix caching from Python "9.2x in the run at 14b2a4d" (the previous runs of record)
  bench/README.md decode host time of the later run alone on one H200 ("37.0 us ... at df04f03",
    "6 of 22", "df04f03: 0.61-1.79x, median 1.08"; `2026-12-01_df04f03_h200/decode/`)
  rust/core/src/free_list.md, pool/growable.md, slab/mod.rs, cuda/README.md: their own figures
  "(run at c3a772c)", "0da9aa7", "2026-12-01": the run names (the provenance lines printed here)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", type=Path, required=True, help="one-GPU run folder")
    ap.add_argument("--gpu2", type=Path, help="two-GPU run folder (transfer.json, tp_decode.json)")
    ap.add_argument(
        "--vm", type=Path, help="a run folder of bench/cpu.sh (a machine without a GPU)"
    )
    ap.add_argument(
        "--free-list", type=Path, help="folder with free_list_h200.json (default --gpu)"
    )
    ap.add_argument(
        "--sim-cuda", type=Path, help="default --gpu/simulate_sharegpt_llama-3-8b_cuda.json"
    )
    ap.add_argument(
        "--sim-host", type=Path, help="default --vm/simulate_sharegpt_llama-3-8b_host.json"
    )
    ap.add_argument("--prefix-sim", type=Path, help="default --vm/prefix_sim.json")
    ap.add_argument("--prefix-cache", type=Path, help="default --vm/prefix_cache_host.json")
    ap.add_argument("--swap-sim", type=Path, help="default --vm/swap_sim_llama-3-8b.json")
    ap.add_argument("--pool-python", type=Path, help="default --vm/pool_python.json")
    ap.add_argument(
        "--readmes",
        type=Path,
        default=REPO,
        help="folder holding README.md, bench/README.md and bench/FIGURES.md to check against",
    )
    ap.add_argument("--no-check", action="store_true", help="do not look phrases up in the READMEs")
    ap.add_argument(
        "--write",
        action="store_true",
        help="edit the READMEs: each DIFFERS phrase's numbers put in place of the old ones",
    )
    a = ap.parse_args()
    if a.write and a.no_check:
        ap.error("--write needs the READMEs checked (leave out --no-check)")

    def vm(name, given):
        if given:
            return given
        if a.vm:
            return pick(a.vm, name)
        return Path(f"<no --vm: {name}>")

    f = {
        "gpu": a.gpu,
        "gpu2": a.gpu2,
        "free_list": a.free_list or a.gpu,
        "sim_cuda": a.sim_cuda or pick(a.gpu, "simulate_sharegpt_llama-3-8b_cuda.json"),
        "sim_host": vm("simulate_sharegpt_llama-3-8b_host.json", a.sim_host),
        "prefix_sim": vm("prefix_sim.json", a.prefix_sim),
        "prefix_cache": vm("prefix_cache_host.json", a.prefix_cache),
        "swap_sim": vm("swap_sim_llama-3-8b.json", a.swap_sim),
        "pool_python": vm("pool_python.json", a.pool_python),
    }
    rep = Report(check=not a.no_check)
    if rep.check:
        rep.add_doc("README.md Results", a.readmes / "README.md", "Results")
        rep.add_doc("bench/FIGURES.md", a.readmes / "bench/FIGURES.md")
        rep.add_doc("bench/README.md Results", a.readmes / "bench/README.md", "Results")

    print("Inputs (provenance commit and date; for a folder, of one JSON in it):")
    named = {
        "gpu": "pool_cuda.json",
        "gpu2": "multigpu/transfer_h200x2.json",
        "free_list": "free_list_h200.json",
    }
    for k, p in f.items():
        if p is None:
            print(f"  {k:12} -")
            continue
        try:
            print(f"  {k:12} {p}  commit {prov_commit(pick(p, named[k]) if k in named else p)}")
        except (OSError, ValueError, AttributeError) as e:
            print(f"  {k:12} {p}  ({e.__class__.__name__}: {e})")

    sections = [
        readme_scheduler,
        readme_pool_tables,
        readme_kernels,
        readme_cpu_machine,
        readme_hosttier,
        readme_swap_sim,
        readme_gpu_tail,
        figures_swap_table,
        figures_prefix_paragraph,
        figures_greedy_paragraph,
        bench_scheduler,
        bench_gpu_intro,
        bench_allocator,
        bench_free_list,
        bench_tables_growable,
        bench_decode,
        bench_fp8,
        bench_prefill,
        bench_prefix,
        bench_hosttier,
        bench_swap_sim,
        bench_multigpu,
        bench_transformers,
    ]
    for sec in sections:
        if sec is bench_multigpu and not f["gpu2"]:
            print(
                "\n=== bench/README.md Results: two GPUs -- skipped (no --gpu2); the READMEs keep "
                "the earlier two-GPU figures"
            )
            continue
        try:
            sec(rep, f)
        except (OSError, KeyError, IndexError, ValueError, TypeError) as e:
            print(f"  !! {sec.__name__} stopped: {e.__class__.__name__}: {e}")
    print(NOT_FROM_DATA)
    if rep.check:
        print(
            f"README check: {rep.counts['ok']} phrases and table rows found as printed, "
            f"{rep.counts['DIFFERS']} differ:"
        )
        for line in rep.differs:
            print("  " + line)
    if a.write:
        left = rep.write()
        print(
            f"\n--write: {len(rep.stale) - len(left)} phrases re-quoted in place, {len(left)} left "
            "for a hand edit (a word changed, or no single place fits):"
        )
        for line in left:
            print("  " + line)


if __name__ == "__main__":
    main()
