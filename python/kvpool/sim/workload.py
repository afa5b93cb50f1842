"""Workloads: seeded generators shaped like real chat traces, and user trace files.

Lengths follow log-normal distributions whose means match the published statistics of the
traces the vLLM paper evaluates on (ShareGPT: mean prompt 161, mean output 338 tokens; Alpaca:
19 and 58). A log-normal is the usual fit for these long-tailed length histograms; the sigmas
below give the long tail (ShareGPT outputs of several thousand tokens occur) without letting
the mean drift. Lengths are clipped so that prompt + output fits in `max_model_len`.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvpool.scheduler.request import Request


@dataclass(frozen=True, slots=True)
class LengthModel:
    """Log-normal prompt and output lengths given by their means (tokens) and log-space sigma."""

    prompt_mean: float
    prompt_sigma: float
    output_mean: float
    output_sigma: float


SHAREGPT = LengthModel(prompt_mean=161.0, prompt_sigma=1.0, output_mean=338.0, output_sigma=0.9)
ALPACA = LengthModel(prompt_mean=19.0, prompt_sigma=0.6, output_mean=58.0, output_sigma=0.8)
LENGTH_MODELS = {"sharegpt": SHAREGPT, "alpaca": ALPACA}
ARRIVALS = ("poisson", "burst")


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and the line."""


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    mu = math.log(mean) - sigma * sigma / 2.0  # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2)
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(np.int64)


def arrival_times(
    rng: np.random.Generator,
    n: int,
    rate: float | None,
    arrival: str = "poisson",
    burst_size: int = 64,
) -> np.ndarray:
    """Arrival times in seconds. rate None (or inf) means every request is there at t=0 (offline).

    "poisson": exponential gaps of mean 1/rate. "burst": groups of `burst_size` requests arrive
    together, the groups spaced so that the long-run rate is still `rate`.
    """
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    if (
        isinstance(burst_size, bool)
        or not isinstance(burst_size, (int, np.integer))
        or burst_size < 1
    ):
        raise ValueError(f"burst_size must be an integer >= 1, got {burst_size!r}")
    if rate is None or math.isinf(rate):
        return np.zeros(n)
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if arrival == "poisson":
        return np.cumsum(rng.exponential(1.0 / rate, n))
    groups = np.arange(n) // burst_size
    return groups * (burst_size / rate)


def generate(
    kind: str = "sharegpt",
    num_requests: int = 1000,
    *,
    seed: int = 0,
    rate: float | None = None,
    arrival: str = "poisson",
    burst_size: int = 64,
    max_model_len: int = 4096,
    num_prefixes: int = 0,
    prefix_tokens: int = 0,
    num_priorities: int = 4,
) -> list[Request]:
    """A seeded synthetic workload ("sharegpt" or "alpaca"); same arguments, same requests."""
    if kind not in LENGTH_MODELS:
        raise ValueError(f"workload must be one of {sorted(LENGTH_MODELS)}, got {kind!r}")
    if max_model_len < 2 + prefix_tokens:
        raise ValueError(f"max_model_len {max_model_len} leaves no room for a prompt and an output")
    model = LENGTH_MODELS[kind]
    rng = np.random.default_rng(seed)
    prompt = _lognormal(rng, model.prompt_mean, model.prompt_sigma, num_requests)
    output = _lognormal(rng, model.output_mean, model.output_sigma, num_requests)
    arrivals = arrival_times(rng, num_requests, rate, arrival, burst_size)
    priority = rng.integers(0, max(1, num_priorities), num_requests)
    prefix_id = (
        rng.integers(0, num_prefixes, num_requests)
        if num_prefixes > 0
        else np.full(num_requests, -1)
    )
    shared = prefix_tokens if num_prefixes > 0 else 0
    prompt = np.clip(prompt + shared, 1, max_model_len - 1)
    output = np.clip(output, 1, max_model_len - prompt)
    return [
        Request(
            i,
            float(arrivals[i]),
            int(prompt[i]),
            int(output[i]),
            int(priority[i]),
            int(prefix_id[i]),
            shared if prefix_id[i] >= 0 else 0,
        )
        for i in range(num_requests)
    ]


def describe(requests: list[Request]) -> dict[str, float]:
    """Summary statistics of a workload, for the report."""
    p = np.array([r.prompt_tokens for r in requests], dtype=np.float64)
    o = np.array([r.output_tokens for r in requests], dtype=np.float64)
    a = np.array([r.arrival_s for r in requests], dtype=np.float64)
    return {
        "num_requests": len(requests),
        "prompt_tokens_mean": float(p.mean()) if len(p) else 0.0,
        "prompt_tokens_p99": float(np.percentile(p, 99)) if len(p) else 0.0,
        "output_tokens_mean": float(o.mean()) if len(o) else 0.0,
        "output_tokens_p99": float(np.percentile(o, 99)) if len(o) else 0.0,
        "last_arrival_s": float(a.max()) if len(a) else 0.0,
    }


# ---- trace files -------------------------------------------------------------------------

_FIELDS = {
    "arrival_s": ("arrival_s", "arrival_time", "arrival", "timestamp"),
    "prompt_tokens": ("prompt_tokens", "input_tokens", "prompt_len", "input_len"),
    "output_tokens": ("output_tokens", "output_len", "max_tokens"),
}


def _field(row: dict, name: str, where: str) -> object:
    for key in _FIELDS[name]:
        if key in row and row[key] not in (None, ""):
            return row[key]
    raise TraceError(
        f"{where}: missing field {name!r} (accepted names: {', '.join(_FIELDS[name])})"
    )


def _number(value: object, name: str, where: str, *, integer: bool, minimum: float) -> float:
    if isinstance(value, bool):  # JSON true/false are not numbers (float(True) would be 1.0)
        raise TraceError(f"{where}: {name} must be a number, got {value!r}")
    try:
        x = float(value)  # type: ignore[arg-type]
    except OverflowError:  # e.g. a 400-digit JSON integer
        raise TraceError(f"{where}: {name} is out of range, got {str(value)[:20]}...") from None
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {name} must be a number, got {value!r}") from None
    if not math.isfinite(x) or x < minimum or (integer and x != int(x)):
        kind = "an integer" if integer else "a number"
        raise TraceError(f"{where}: {name} must be {kind} >= {minimum:g}, got {value!r}")
    return x


def _request(row: object, index: int, where: str, max_model_len: int | None) -> Request:
    if not isinstance(row, dict):
        raise TraceError(
            f"{where}: expected an object with arrival_s, prompt_tokens, output_tokens"
        )
    arrival = _number(_field(row, "arrival_s", where), "arrival_s", where, integer=False, minimum=0)
    prompt = int(
        _number(
            _field(row, "prompt_tokens", where), "prompt_tokens", where, integer=True, minimum=1
        )
    )
    output = int(
        _number(
            _field(row, "output_tokens", where), "output_tokens", where, integer=True, minimum=1
        )
    )
    priority = int(
        _number(row.get("priority", 0) or 0, "priority", where, integer=True, minimum=-(2**31))
    )
    if max_model_len is not None and prompt + output > max_model_len:
        raise TraceError(
            f"{where}: prompt_tokens + output_tokens = {prompt + output} exceeds max_model_len {max_model_len}"
        )
    group, shared, conversation = _sharing_fields(row, prompt, where)
    return Request(index, arrival, prompt, output, priority, group, shared, conversation)


def _sharing_fields(row: dict, prompt: int, where: str) -> tuple[int, int, int]:
    """Optional (prefix_group, prefix_tokens, conversation_id); -1, 0, -1 when absent."""

    def optional(name: str, minimum: int) -> int | None:
        value = row.get(name)
        if value in (None, ""):
            return None
        return int(_number(value, name, where, integer=True, minimum=minimum))

    group = optional("prefix_group", 0)
    shared = optional("prefix_tokens", 0)
    conversation = optional("conversation_id", 0)
    if (group is None) != (shared is None):
        raise TraceError(
            f"{where}: prefix_group and prefix_tokens go together (requests of one group "
            "share their first prefix_tokens tokens)"
        )
    if shared is not None and shared > prompt:
        raise TraceError(f"{where}: prefix_tokens {shared} exceeds prompt_tokens {prompt}")
    return (
        -1 if group is None else group,
        shared or 0,
        -1 if conversation is None else conversation,
    )


def load_trace(path: str | Path, max_model_len: int | None = None) -> list[Request]:
    """Read a JSONL (one object per line) or CSV (header row) trace; sorted by arrival time.

    Fields: arrival_s (seconds), prompt_tokens, output_tokens, optional priority, and for
    prefix sharing optional prefix_group + prefix_tokens (requests of one group share their
    first prefix_tokens tokens) or conversation_id (the rows of one conversation, in arrival
    order: each prompt holds the previous prompt and its output, then new tokens). A bad line
    raises TraceError naming the file and the line number.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read trace: {e}") from None
    if path.suffix.lower() == ".csv":
        requests = _load_csv(path, text, max_model_len)
    else:
        requests = _load_jsonl(path, text, max_model_len)
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    requests.sort(key=lambda r: (r.arrival_s, r.request_id))
    return requests


def jsonl_rows(text: str, label: str) -> Iterator[tuple[str, object]]:
    """`(where, value)` for each non-blank line of a JSON Lines text, `where` being
    `label:lineno` for messages; a line that is not JSON raises `TraceError` naming it."""
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{label}:{lineno}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e.msg})") from None


def _load_jsonl(path: Path, text: str, max_model_len: int | None) -> list[Request]:
    out: list[Request] = []
    for where, row in jsonl_rows(text, str(path)):
        out.append(_request(row, len(out), where, max_model_len))
    return out


def _load_csv(path: Path, text: str, max_model_len: int | None) -> list[Request]:
    lines = text.splitlines()
    reader = csv.DictReader(lines)
    out: list[Request] = []
    for row in reader:
        where = f"{path}:{reader.line_num}"
        if None in row:
            raise TraceError(f"{where}: more columns than the header has")
        out.append(_request(row, len(out), where, max_model_len))
    return out
