"""Readers for the public LLM serving traces, and the format detection of `--trace`.

Formats (`TRACE_FORMATS`; "auto" detects them from the file name and its header):

- kvpool: our JSONL/CSV (workload.load_trace): arrival_s, prompt_tokens, output_tokens,
  optional priority, prefix_group + prefix_tokens, conversation_id.
- azure: Azure LLM inference traces (AzurePublicDataset, 2023 and 2024), CSV with columns
  TIMESTAMP (a date and time, e.g. 2023-11-16 18:15:46.6805900), ContextTokens,
  GeneratedTokens. No sharing is recorded: every request has its own tokens.
- burstgpt: BurstGPT, CSV with Timestamp (seconds), Model, Request tokens, Response tokens,
  Total tokens, Log Type. Rows with 0 response tokens (failed requests) are skipped.
- mooncake: Mooncake's JSONL: timestamp (ms), input_length, output_length, hash_ids. Each
  hash id names one 512-token block of the prompt, and equal ids mean equal prefixes: the
  prompt's tokens are built block by block from the hash ids, so requests share exactly
  the blocks the trace says they share.
- sharegpt: the ShareGPT JSON (a list of {id, conversations: [{from, value}, ...]}): every
  human message followed by an answer is one turn of a conversation whose prompt holds the
  earlier turns. Token counts are estimated from the text, one token per 4 characters
  (rounded up; the usual rule of thumb for English with GPT-style BPE tokenizers), as the
  file has no tokens. It has no times either: every conversation starts at t=0 and its
  turns follow `think_time_s` apart.

Times start at 0 at the first request. Public traces are long: rows whose prompt + output
exceed max_model_len are skipped and counted (`TraceInfo.skipped_too_long`).
"""

from __future__ import annotations

import csv
import datetime
import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvpool.scheduler.request import Request
from kvpool.sim.sharing import DEFAULT_THINK_TIME_S, with_token_streams
from kvpool.sim.tokens import HASH, PRIVATE, TokenStream
from kvpool.sim.workload import TraceError, jsonl_rows, load_trace

TRACE_FORMATS = ("auto", "kvpool", "azure", "burstgpt", "mooncake", "sharegpt")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
MOONCAKE_BLOCK_TOKENS = 512
CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class TraceInfo:
    """What was read: the format, and rows left out (and why)."""

    format: str
    skipped_too_long: int = 0
    skipped_failed: int = 0


def read_trace(
    path: Path,
    trace_format: str = "auto",
    max_model_len: int | None = None,
    seed: int = 0,
    think_time_s: float | None = None,
) -> tuple[list[Request], TraceInfo]:
    """The requests of a trace file, with token streams, sorted by arrival; TraceError (its
    message starts with "--trace <path>") naming what is wrong or missing."""
    if trace_format not in TRACE_FORMATS:
        raise TraceError(
            f"--trace-format must be one of {', '.join(TRACE_FORMATS)}, got {trace_format!r}"
        )
    text = _read(path)
    fmt = detect_format(path, text) if trace_format == "auto" else trace_format
    if think_time_s is not None and fmt != "sharegpt":
        raise TraceError(
            f"--think-time applies to ShareGPT traces (which have no times); --trace {path} is {fmt}"
        )
    if fmt == "kvpool":
        try:
            requests = load_trace(path, max_model_len)
        except TraceError as e:
            raise TraceError(f"--trace {e}") from None
        return _streams(requests, seed, path), TraceInfo(fmt)
    reader = {"azure": _azure, "burstgpt": _burstgpt, "mooncake": _mooncake, "sharegpt": _sharegpt}[
        fmt
    ]
    rows, info = reader(path, text, think_time_s)
    requests, too_long = _fit(rows, max_model_len)
    if not requests:
        raise TraceError(
            f"--trace {path}: no request of the {fmt} trace fits"
            + (f" max_model_len {max_model_len}" if too_long else " (the trace is empty)")
        )
    info = TraceInfo(fmt, too_long, info.skipped_failed)
    return _streams(requests, seed, path), info


def _streams(requests: list[Request], seed: int, path: Path) -> list[Request]:
    try:
        return with_token_streams(requests, seed)
    except TraceError as e:  # a conversation whose turns do not hold each other
        raise TraceError(f"--trace {path}: {e}") from None


def detect_format(path: Path, text: str) -> str:
    """The format a trace file is in, from its name and its first line."""
    head = text.lstrip()[:1]
    if path.suffix.lower() == ".json" or head == "[":
        return "sharegpt"
    first = next((line for line in text.splitlines() if line.strip()), "")
    if path.suffix.lower() == ".csv":
        header = next(csv.reader([first]), [])
        if any(c in header for c in AZURE_COLUMNS[1:]):
            return "azure"
        if any(c in header for c in BURSTGPT_COLUMNS[1:]):
            return "burstgpt"
        return "kvpool"
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        return "kvpool"  # load_trace names the bad line
    if isinstance(row, dict) and ("hash_ids" in row or "input_length" in row):
        return "mooncake"
    return "kvpool"


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"--trace {path}: cannot read trace: {e}") from None


def _fit(rows: list[Request], max_model_len: int | None) -> tuple[list[Request], int]:
    """Rows that fit max_model_len, renumbered in arrival order from time 0."""
    rows.sort(key=lambda r: (r.arrival_s, r.request_id))
    t0 = rows[0].arrival_s if rows else 0.0
    kept = [
        r
        for r in rows
        if max_model_len is None or r.prompt_tokens + r.output_tokens <= max_model_len
    ]
    out = [
        Request(
            i,
            r.arrival_s - t0,
            r.prompt_tokens,
            r.output_tokens,
            r.priority,
            r.prefix_id,
            r.prefix_tokens,
            r.conversation_id,
            r.tokens,
        )
        for i, r in enumerate(kept)
    ]
    return out, len(rows) - len(kept)


def _count(value: object, name: str, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool):
        raise TraceError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        x = math.nan
    if not (math.isfinite(x) and x == int(x) and x >= minimum):
        raise TraceError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(x)


def _seconds(value: object, name: str, where: str) -> float:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        x = math.nan
    if not math.isfinite(x):
        raise TraceError(f"{where}: {name} must be a number, got {value!r}")
    return x


def _csv_rows(path: Path, text: str, fmt: str, columns: tuple[str, ...]):
    reader = csv.DictReader(text.splitlines())
    header = reader.fieldnames or []
    for column in columns:
        if column not in header:
            raise TraceError(
                f"--trace {path} ({fmt}): missing column {column!r} (header: {', '.join(header)}; "
                f"a {fmt} trace has {', '.join(columns)})"
            )
    for row in reader:
        where = f"--trace {path}:{reader.line_num}"
        if None in row:
            raise TraceError(f"{where}: more columns than the header has")
        yield where, row


def _azure(path: Path, text: str, _think: float | None) -> tuple[list[Request], TraceInfo]:
    out: list[Request] = []
    for where, row in _csv_rows(path, text, "azure", AZURE_COLUMNS):
        try:
            t = datetime.datetime.fromisoformat(row["TIMESTAMP"].strip()).timestamp()
        except ValueError:
            raise TraceError(
                f"{where}: TIMESTAMP must be a date and time, got {row['TIMESTAMP']!r}"
            ) from None
        prompt = _count(row["ContextTokens"], "ContextTokens", where, 1)
        output = _count(row["GeneratedTokens"], "GeneratedTokens", where, 1)
        out.append(Request(len(out), t, prompt, output))
    return out, TraceInfo("azure")


def _burstgpt(path: Path, text: str, _think: float | None) -> tuple[list[Request], TraceInfo]:
    out: list[Request] = []
    failed = 0
    for where, row in _csv_rows(path, text, "burstgpt", BURSTGPT_COLUMNS):
        t = _seconds(row["Timestamp"], "Timestamp", where)
        prompt = _count(row["Request tokens"], "Request tokens", where)
        output = _count(row["Response tokens"], "Response tokens", where)
        if prompt == 0 or output == 0:  # a failed request
            failed += 1
            continue
        out.append(Request(len(out), t, prompt, output))
    return out, TraceInfo("burstgpt", skipped_failed=failed)


def _mooncake(path: Path, text: str, _think: float | None) -> tuple[list[Request], TraceInfo]:
    out: list[Request] = []
    for where, row in jsonl_rows(text, f"--trace {path}"):
        if not isinstance(row, dict):
            raise TraceError(f"{where}: expected an object with {', '.join(MOONCAKE_FIELDS)}")
        for name in MOONCAKE_FIELDS[:3]:
            if name not in row:
                raise TraceError(
                    f"{where} (mooncake): missing field {name!r} (a mooncake trace has "
                    f"{', '.join(MOONCAKE_FIELDS)})"
                )
        t = _seconds(row["timestamp"], "timestamp", where) / 1000.0
        prompt = _count(row["input_length"], "input_length", where, 1)
        output = _count(row["output_length"], "output_length", where, 1)
        hashes = row.get("hash_ids", [])
        if not isinstance(hashes, list):
            raise TraceError(f"{where}: hash_ids must be a list of integers, got {hashes!r}")
        hashes = [_count(h, "hash_ids[]", where) for h in hashes]
        i = len(out)
        out.append(Request(i, t, prompt, output, tokens=mooncake_stream(i, hashes, prompt, output)))
    return out, TraceInfo("mooncake")


def mooncake_stream(request_id: int, hash_ids: list[int], prompt: int, output: int) -> TokenStream:
    """The prompt as 512-token blocks named by hash id (the last one cut to the prompt's end),
    then tokens of this request only: the rest of a prompt longer than its hash ids cover,
    and the output."""
    segments: list[tuple[tuple[int, ...], int]] = []
    left = prompt
    for h in hash_ids:
        if left == 0:
            break
        n = min(MOONCAKE_BLOCK_TOKENS, left)
        segments.append(((HASH, h), n))
        left -= n
    segments.append(((PRIVATE, request_id), left + output))
    return TokenStream(0, tuple(segments))


def estimate_tokens(text: str) -> int:
    """Tokens of a text without a tokenizer: one per CHARS_PER_TOKEN characters, at least 1."""
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


def _sharegpt(path: Path, text: str, think_time_s: float | None) -> tuple[list[Request], TraceInfo]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"--trace {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise TraceError(
            f"--trace {path} (sharegpt): expected a list of {{id, conversations}} objects"
        )
    gap = DEFAULT_THINK_TIME_S if think_time_s is None else think_time_s
    out: list[Request] = []
    for c, item in enumerate(data):
        where = f"--trace {path}: conversation {c}"
        if not isinstance(item, dict) or "conversations" not in item:
            raise TraceError(
                f"{where} (sharegpt): missing field 'conversations' (each item has id and "
                "conversations: [{from, value}, ...])"
            )
        messages = item["conversations"]
        if not isinstance(messages, list):
            raise TraceError(f"{where}: conversations must be a list of {{from, value}}")
        out += _turns(messages, c, gap, len(out), where)
    return out, TraceInfo("sharegpt")


def _turns(
    messages: list, conversation: int, gap: float, first_id: int, where: str
) -> list[Request]:
    """One request per (human message, answer) pair; the context grows by both."""
    turns: list[Request] = []
    held, pending = 0, 0  # tokens of the finished turns; of messages not yet answered
    for m, message in enumerate(messages):
        for name in ("from", "value"):
            if not isinstance(message, dict) or name not in message:
                raise TraceError(f"{where}, message {m} (sharegpt): missing field {name!r}")
        tokens = estimate_tokens(str(message["value"]))
        if message["from"] in ("gpt", "chatgpt", "assistant", "bard", "bing"):
            if pending == 0:
                held += tokens  # an answer to nothing (a greeting): context only
                continue
            prompt = held + pending
            turns.append(
                Request(
                    first_id + len(turns),
                    len(turns) * gap,
                    prompt,
                    tokens,
                    conversation_id=conversation,
                )
            )
            held, pending = prompt + tokens, 0
        else:  # human, user, system
            pending += tokens
    return turns
