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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

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
# A trace is read one line at a time and every line is checked as it comes: a bad file fails
# at its first bad line, and memory is bounded by the longest line allowed, not the file.

MAX_LINE_BYTES = 1 << 20  # one request per line; real rows are under 10 kB
MAX_INT_DIGITS = 100  # no count, id or time in a trace needs more digits than this
# Arrival times are at most this (about 317 years). A float still resolves 2 us here, so the
# latencies of modelled steps (milliseconds) keep their digits; much beyond it they become 0.0.
MAX_ARRIVAL_S = 1e10

_FIELDS = {
    "arrival_s": ("arrival_s", "arrival_time", "arrival", "timestamp"),
    "prompt_tokens": ("prompt_tokens", "input_tokens", "prompt_len", "input_len"),
    "output_tokens": ("output_tokens", "output_len", "max_tokens"),
}


def brief_repr(value: object, limit: int = 40) -> str:
    """`value` for an error message: its repr cut to `limit` characters, a list or an object
    by its size (a trace's value may be a megabyte long or nested a thousand deep)."""
    if isinstance(value, list):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"an object of {len(value)} fields"
    if isinstance(value, HugeInteger):
        return f"an integer of {value.digits} digits"
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def open_trace(path: Path, label: str) -> BinaryIO:
    """The trace file, opened for `trace_lines`; TraceError (starting with `label`) if it cannot be."""
    try:
        return path.open("rb")
    except OSError as e:
        raise TraceError(f"{label}: cannot read trace: {e}") from None


def trace_lines(stream: BinaryIO, label: str) -> Iterator[tuple[int, str]]:
    """`(lineno, line)` for each line of `stream`, decoded as UTF-8 (a leading BOM dropped),
    without its line ending. Raises TraceError naming the line (`label:lineno`) when one is
    longer than MAX_LINE_BYTES or not UTF-8, having read at most MAX_LINE_BYTES + 1 bytes of it."""
    lineno = 0
    while True:
        try:
            raw = stream.readline(MAX_LINE_BYTES + 1)
        except OSError as e:
            raise TraceError(f"{label}: cannot read trace: {e}") from None
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            raise TraceError(
                f"{label}:{lineno}: line longer than {MAX_LINE_BYTES} bytes (a trace has one "
                "request per line)"
            )
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise TraceError(
                f"{label}:{lineno}: not UTF-8 text (byte {e.start + 1} of the line)"
            ) from None
        yield lineno, line.rstrip("\r\n")


@dataclass(frozen=True, slots=True)
class HugeInteger:
    """A JSON integer of more than MAX_INT_DIGITS digits, kept as its length only: no field
    accepts it, and its message then names the field (int() on it would take quadratic time,
    or raise Python's 4300-digit ValueError that names nothing)."""

    digits: int


def int_literal(text: str) -> int | HugeInteger:
    """json's parse_int for traces."""
    digits = len(text.lstrip("-"))
    return HugeInteger(digits) if digits > MAX_INT_DIGITS else int(text)


def json_value(text: str, where: str) -> object:
    """The JSON value of `text`; TraceError naming `where` if it is not one we can hold."""
    try:
        return json.loads(text, parse_int=int_literal)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise TraceError(f"{where}: JSON nested too deeply") from None


def jsonl_rows(lines: Iterable[tuple[int, str]], label: str) -> Iterator[tuple[str, object]]:
    """`(where, value)` for each non-blank line of JSON Lines (`trace_lines`), `where` being
    `label:lineno` for messages; a line that is not JSON raises `TraceError` naming it."""
    for lineno, line in lines:
        if line.strip():
            where = f"{label}:{lineno}"
            yield where, json_value(line, where)


def _csv_fields(line: str, where: str) -> list[str]:
    try:
        return next(csv.reader([line]), [])
    except csv.Error as e:  # e.g. a field longer than csv.field_size_limit()
        raise TraceError(f"{where}: not valid CSV ({e})") from None


def csv_table(
    lines: Iterator[tuple[int, str]], label: str
) -> tuple[list[str], Iterator[tuple[str, dict[str, str | None]]]]:
    """The header (the first non-blank line) and `(where, row)` for each later non-blank line,
    one row per line; a row shorter than the header has None in its last columns, a longer
    one raises TraceError."""
    header: list[str] = []
    for lineno, line in lines:
        if line.strip():
            header = _csv_fields(line, f"{label}:{lineno}")
            break

    def rows() -> Iterator[tuple[str, dict[str, str | None]]]:
        for lineno, line in lines:
            if not line.strip():
                continue
            where = f"{label}:{lineno}"
            fields = _csv_fields(line, where)
            if len(fields) > len(header):
                raise TraceError(f"{where}: more columns than the header has")
            values: list[str | None] = [*fields, *[None] * (len(header) - len(fields))]
            yield where, dict(zip(header, values, strict=True))

    return header, rows()


def _field(row: dict, name: str, where: str) -> object:
    for key in _FIELDS[name]:
        if key in row and row[key] not in (None, ""):
            return row[key]
    raise TraceError(
        f"{where}: missing field {name!r} (accepted names: {', '.join(_FIELDS[name])})"
    )


def _number(
    value: object,
    name: str,
    where: str,
    *,
    integer: bool,
    minimum: float,
    maximum: float = math.inf,
) -> float:
    if isinstance(value, bool):  # JSON true/false are not numbers (float(True) would be 1.0)
        raise TraceError(f"{where}: {name} must be a number, got {value!r}")
    if isinstance(value, HugeInteger):
        raise TraceError(f"{where}: {name} is out of range, got {brief_repr(value)}")
    try:
        x = float(value)  # type: ignore[arg-type]
    except OverflowError:  # e.g. a 400-digit integer
        raise TraceError(f"{where}: {name} is out of range, got {brief_repr(value)}") from None
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {name} must be a number, got {brief_repr(value)}") from None
    if not (math.isfinite(x) and minimum <= x <= maximum) or (integer and x != int(x)):
        kind = "an integer" if integer else "a number"
        bound = f"in [{minimum:g}, {maximum:g}]" if maximum < math.inf else f">= {minimum:g}"
        raise TraceError(f"{where}: {name} must be {kind} {bound}, got {brief_repr(value)}")
    return x


def _request(row: object, index: int, where: str, max_model_len: int | None) -> Request:
    if not isinstance(row, dict):
        raise TraceError(
            f"{where}: expected an object with arrival_s, prompt_tokens, output_tokens"
        )
    arrival = _number(
        _field(row, "arrival_s", where),
        "arrival_s",
        where,
        integer=False,
        minimum=0,
        maximum=MAX_ARRIVAL_S,
    )
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
        _number(
            row.get("priority", 0) or 0,
            "priority",
            where,
            integer=True,
            minimum=-(2**31),
            maximum=2**31 - 1,
        )
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

    Fields: arrival_s (seconds, at most MAX_ARRIVAL_S), prompt_tokens, output_tokens, optional
    priority, and for prefix sharing optional prefix_group + prefix_tokens (requests of one
    group share their first prefix_tokens tokens) or conversation_id (the rows of one
    conversation, in arrival order: each prompt holds the previous prompt and its output, then
    new tokens). The file is read line by line; the first bad line raises TraceError naming
    the file and the line number.
    """
    path = Path(path)
    with open_trace(path, str(path)) as stream:
        return read_requests(
            trace_lines(stream, str(path)), str(path), path.suffix.lower() == ".csv", max_model_len
        )


def read_requests(
    lines: Iterator[tuple[int, str]], label: str, is_csv: bool, max_model_len: int | None
) -> list[Request]:
    """load_trace on lines from `trace_lines`, messages starting with `label`."""
    out: list[Request] = []
    if is_csv:
        _, rows = csv_table(lines, label)
        for where, row in rows:
            out.append(_request(row, len(out), where, max_model_len))
    else:
        for where, value in jsonl_rows(lines, label):
            out.append(_request(value, len(out), where, max_model_len))
    if not out:
        raise TraceError(f"{label}: the trace has no requests")
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return out
