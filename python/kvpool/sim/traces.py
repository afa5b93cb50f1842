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

A file is read once, as a stream (a pipe works), and each line is checked as it is read: the
first bad line or conversation raises TraceError naming the file, the line and the field, and
memory is bounded by the longest line (workload.MAX_LINE_BYTES) or ShareGPT conversation
(MAX_CONVERSATION_CHARS) allowed, not by the file. Times are at most workload.MAX_ARRIVAL_S
seconds (an Azure TIMESTAMP is a date from 1970 on); integers keep every digit up to
workload.MAX_INT_DIGITS (Mooncake hash ids are compared exactly).
"""

from __future__ import annotations

import codecs
import datetime
import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvpool.scheduler.request import Request
from kvpool.sim.sharing import DEFAULT_THINK_TIME_S, with_token_streams
from kvpool.sim.tokens import HASH, PRIVATE, TokenStream
from kvpool.sim.workload import (
    MAX_ARRIVAL_S,
    TraceError,
    brief_repr,
    csv_table,
    int_literal,
    json_value,
    jsonl_rows,
    open_trace,
    read_requests,
    trace_lines,
)

TRACE_FORMATS = ("auto", "kvpool", "azure", "burstgpt", "mooncake", "sharegpt")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
MOONCAKE_BLOCK_TOKENS = 512
CHARS_PER_TOKEN = 4
# A ShareGPT file is one JSON array, parsed one conversation at a time: a conversation may
# be this long (the longest of the public ShareGPT files is well under 1 MiB).
MAX_CONVERSATION_CHARS = 16 << 20

Lines = Iterator[tuple[int, str]]
NEWLINE = "\n"


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
    message starts with "--trace <path>") naming what is wrong or missing. The file is read
    once, as a stream, and fails at its first bad line or conversation."""
    if trace_format not in TRACE_FORMATS:
        raise TraceError(
            f"--trace-format must be one of {', '.join(TRACE_FORMATS)}, got {trace_format!r}"
        )
    label = f"--trace {path}"
    with open_trace(path, label) as stream:
        opened = _detect(path, stream, trace_format, label)
        fmt, lines = opened.format, opened.lines
        if think_time_s is not None and fmt != "sharegpt":
            raise TraceError(
                f"--think-time applies to ShareGPT traces (which have no times); {label} is {fmt}"
            )
        if fmt == "kvpool":
            requests = read_requests(lines, label, path.suffix.lower() == ".csv", max_model_len)
            return _streams(requests, seed, path), TraceInfo(fmt)
        if fmt == "sharegpt":
            chunks = _json_chunks(opened.json_text, stream)
            rows, info = _sharegpt(_ArrayItems(chunks, label, opened.json_lineno), think_time_s)
        else:
            rows, info = {"azure": _azure, "burstgpt": _burstgpt, "mooncake": _mooncake}[fmt](
                lines, label
            )
    requests, too_long = _fit(rows, max_model_len)
    if not requests:
        raise TraceError(
            f"{label}: no request of the {fmt} trace fits"
            + (f" max_model_len {max_model_len}" if too_long else " (the trace is empty)")
        )
    info = TraceInfo(fmt, too_long, info.skipped_failed)
    return _streams(requests, seed, path), info


@dataclass(frozen=True, slots=True)
class _Opened:
    """A trace file once its format is known. `lines` go on from the first non-blank line
    detection read (a pipe is read once). A ShareGPT file is not split into lines (it may be
    one line of any length): the stream is read on after `json_text`, the text detection
    read, which is line `json_lineno` of the file."""

    format: str
    lines: Lines
    json_text: str = ""
    json_lineno: int = 1


def _detect(path: Path, stream: BinaryIO, trace_format: str, label: str) -> _Opened:
    if trace_format == "sharegpt" or (trace_format == "auto" and path.suffix.lower() == ".json"):
        return _Opened("sharegpt", iter(()))
    lines = trace_lines(stream, label)
    if trace_format != "auto":
        return _Opened(trace_format, lines)
    first = next((item for item in lines if item[1].strip()), None)  # blank lines are skipped
    if first is None:
        return _Opened(detect_format(path, ""), iter(()))
    fmt = detect_format(path, first[1])
    if fmt == "sharegpt":
        return _Opened(fmt, iter(()), first[1] + "\n", first[0])
    return _Opened(fmt, itertools.chain([first], lines))


def _streams(requests: list[Request], seed: int, path: Path) -> list[Request]:
    try:
        return with_token_streams(requests, seed)
    except TraceError as e:  # a conversation whose turns do not hold each other
        raise TraceError(f"--trace {path}: {e}") from None


def detect_format(path: Path, text: str) -> str:
    """The format a trace file is in, from its name and its first non-blank line (`text` is
    the file's beginning; that line is enough)."""
    head = text.lstrip()[:1]
    if path.suffix.lower() == ".json" or head == "[":
        return "sharegpt"
    first = next((line for line in text.splitlines() if line.strip()), "")
    if path.suffix.lower() == ".csv":
        try:
            header, _ = csv_table(iter([(1, first)]), str(path))
        except TraceError:
            return "kvpool"  # load_trace names the bad line
        if any(c in header for c in AZURE_COLUMNS[1:]):
            return "azure"
        if any(c in header for c in BURSTGPT_COLUMNS[1:]):
            return "burstgpt"
        return "kvpool"
    try:
        row = json_value(first, str(path))
    except TraceError:
        return "kvpool"  # load_trace names the bad line
    if isinstance(row, dict) and ("hash_ids" in row or "input_length" in row):
        return "mooncake"
    return "kvpool"


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
    """An integer >= minimum, given as one (kept exact, however large) or as a number or a
    text with an integral value; not a boolean."""
    number: int | None = None
    if isinstance(value, bool):
        pass
    elif isinstance(value, int):
        number = value
    elif isinstance(value, (float, str)):
        try:
            x = float(value)
        except ValueError:
            x = math.nan
        number = int(x) if x.is_integer() else None  # nan and inf are not integers
    if number is None or number < minimum:
        raise TraceError(
            f"{where}: {name} must be an integer >= {minimum}, got {brief_repr(value)}"
        )
    return number


def _seconds(value: object, name: str, where: str, maximum: float = MAX_ARRIVAL_S) -> float:
    """A time in [0, maximum], given as a number or text (not as a boolean)."""
    x = math.nan
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            x = float(value)
        except (ValueError, OverflowError):  # OverflowError: an integer beyond any float
            pass
    if not 0 <= x <= maximum:  # also refuses nan
        raise TraceError(
            f"{where}: {name} must be a number in [0, {maximum:g}], got {brief_repr(value)}"
        )
    return x


def _csv_rows(lines: Lines, label: str, fmt: str, columns: tuple[str, ...]):
    header, rows = csv_table(lines, label)
    for column in columns:
        if column not in header:
            shown = ", ".join(header)
            raise TraceError(
                f"{label} ({fmt}): missing column {column!r} (header: {brief_repr(shown, 200)}; "
                f"a {fmt} trace has {', '.join(columns)})"
            )
    for where, row in rows:
        for column in columns:
            if row[column] is None:
                raise TraceError(
                    f"{where}: no {column} (the row has fewer columns than the header)"
                )
        yield where, row


def _azure_time(text: str, where: str) -> float:
    """A TIMESTAMP in seconds since 1970 (a time without a zone is UTC: local time would
    add an hour at a daylight-saving change)."""
    try:
        t = datetime.datetime.fromisoformat(text.strip())
        if t.tzinfo is None:
            t = t.replace(tzinfo=datetime.UTC)
        seconds = t.timestamp()
    except (ValueError, OverflowError):
        seconds = math.nan
    if not 0 <= seconds <= MAX_ARRIVAL_S:
        raise TraceError(
            f"{where}: TIMESTAMP must be a date and time from 1970 on, got {brief_repr(text)}"
        )
    return seconds


def _azure(lines: Lines, label: str) -> tuple[list[Request], TraceInfo]:
    out: list[Request] = []
    for where, row in _csv_rows(lines, label, "azure", AZURE_COLUMNS):
        t = _azure_time(row["TIMESTAMP"] or "", where)
        prompt = _count(row["ContextTokens"], "ContextTokens", where, 1)
        output = _count(row["GeneratedTokens"], "GeneratedTokens", where, 1)
        out.append(Request(len(out), t, prompt, output))
    return out, TraceInfo("azure")


def _burstgpt(lines: Lines, label: str) -> tuple[list[Request], TraceInfo]:
    out: list[Request] = []
    failed = 0
    for where, row in _csv_rows(lines, label, "burstgpt", BURSTGPT_COLUMNS):
        t = _seconds(row["Timestamp"], "Timestamp", where)
        prompt = _count(row["Request tokens"], "Request tokens", where)
        output = _count(row["Response tokens"], "Response tokens", where)
        if prompt == 0 or output == 0:  # a failed request
            failed += 1
            continue
        out.append(Request(len(out), t, prompt, output))
    return out, TraceInfo("burstgpt", skipped_failed=failed)


def _mooncake(lines: Lines, label: str) -> tuple[list[Request], TraceInfo]:
    out: list[Request] = []
    for where, row in jsonl_rows(lines, label):
        if not isinstance(row, dict):
            raise TraceError(f"{where}: expected an object with {', '.join(MOONCAKE_FIELDS)}")
        for name in MOONCAKE_FIELDS[:3]:
            if name not in row:
                raise TraceError(
                    f"{where} (mooncake): missing field {name!r} (a mooncake trace has "
                    f"{', '.join(MOONCAKE_FIELDS)})"
                )
        t = _seconds(row["timestamp"], "timestamp", where, MAX_ARRIVAL_S * 1000.0) / 1000.0
        prompt = _count(row["input_length"], "input_length", where, 1)
        output = _count(row["output_length"], "output_length", where, 1)
        i = len(out)
        hashes = _hash_ids(row.get("hash_ids", []), where)
        out.append(Request(i, t, prompt, output, tokens=mooncake_stream(i, hashes, prompt, output)))
    return out, TraceInfo("mooncake")


def _hash_ids(value: object, where: str) -> list[int]:
    """Hash ids as JSON integers >= 0, kept exact: through a float, ids above 2**53 that
    differ would name one block."""
    if not isinstance(value, list):
        raise TraceError(f"{where}: hash_ids must be a list of integers, got {brief_repr(value)}")
    for k, h in enumerate(value):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise TraceError(f"{where}: hash_ids[{k}] must be an integer >= 0, got {brief_repr(h)}")
    return value


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


def _json_chunks(text: str, stream: BinaryIO, chunk_bytes: int = 1 << 20) -> Iterator[str]:
    """`text`, then the rest of `stream` decoded as UTF-8, in pieces of about `chunk_bytes`."""
    if text:
        yield text
    decoder = codecs.getincrementaldecoder("utf-8-sig" if not text else "utf-8")()
    while True:
        raw = stream.read(chunk_bytes)
        try:
            piece = decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as e:
            raise TraceError(f"not UTF-8 text ({e.reason})") from None
        if piece:
            yield piece
        if not raw:
            return


class _ArrayItems:
    """The items of a JSON array read from text pieces one item at a time, so memory is
    bounded by the longest item (MAX_CONVERSATION_CHARS), not the file. Errors name the line."""

    def __init__(self, chunks: Iterator[str], label: str, first_lineno: int = 1) -> None:
        self.chunks, self.label = chunks, label
        self.buf, self.pos, self.eof = "", 0, False
        self.line, self.counted = first_lineno, 0  # the line number at buf[counted]
        self.decoder = json.JSONDecoder(parse_int=int_literal)

    def _more(self, at_least: int = 1) -> bool:
        """Drop what was consumed and read at least `at_least` more characters (fewer at the
        end of the file); False if there was nothing more."""
        self._where(self.pos)
        self.buf, self.pos, self.counted = self.buf[self.pos :], 0, 0
        start = len(self.buf)
        while not self.eof and len(self.buf) - start < at_least:
            try:
                self.buf += next(self.chunks)
            except StopIteration:
                self.eof = True
            except TraceError as e:
                raise TraceError(f"{self.label}: {e}") from None
        return len(self.buf) > start

    def _where(self, pos: int) -> str:
        """`label:line` of buf[pos]; counts newlines once when positions only move on."""
        if pos >= self.counted:
            self.line += self.buf.count(NEWLINE, self.counted, pos)
            self.counted = pos
            return f"{self.label}:{self.line}"
        return f"{self.label}:{self.line - self.buf.count(NEWLINE, pos, self.counted)}"

    def _next_char(self) -> str:
        """The next character that is not white space ("" at the end), not consumed."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf) or not self._more():
                return self.buf[self.pos : self.pos + 1]

    def items(self, what: str) -> Iterator[tuple[str, object]]:
        """(where, value) for each item; TraceError if the text is not a JSON array."""
        if self._next_char() != "[":
            raise TraceError(f"{self.label}: expected a list of {what}")
        self.pos += 1
        if self._next_char() == "]":
            self.pos += 1
        else:
            while True:
                yield self._item()
                c = self._next_char()
                self.pos += 1
                if c == "]":
                    break
                if c != ",":
                    raise TraceError(
                        f"{self._where(self.pos - 1)}: not valid JSON (expecting ',' or ']')"
                    )
        if self._next_char():
            raise TraceError(f"{self._where(self.pos)}: not valid JSON (extra data after the list)")

    def _item(self) -> tuple[str, object]:
        self._next_char()
        while True:
            where = self._where(self.pos)
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                cut = e.msg.startswith("Unterminated string") or e.pos >= len(self.buf) - 16
                pending = len(self.buf) - self.pos
                if not (cut and not self.eof):
                    raise TraceError(f"{self._where(e.pos)}: not valid JSON ({e.msg})") from None
                if pending > MAX_CONVERSATION_CHARS:
                    raise TraceError(
                        f"{where}: an item longer than {MAX_CONVERSATION_CHARS} characters"
                    ) from None
                self._more(at_least=pending)  # doubles what is held: linear in the item
                continue
            except RecursionError:
                raise TraceError(f"{where}: JSON nested too deeply") from None
            if end - self.pos > MAX_CONVERSATION_CHARS:  # however much was read at once
                raise TraceError(
                    f"{where}: an item longer than {MAX_CONVERSATION_CHARS} characters"
                )
            self.pos = end
            return where, value


def _sharegpt(array: _ArrayItems, think_time_s: float | None) -> tuple[list[Request], TraceInfo]:
    gap = DEFAULT_THINK_TIME_S if think_time_s is None else think_time_s
    out: list[Request] = []
    items = array.items("{id, conversations} objects (sharegpt)")
    for c, (line, item) in enumerate(items):
        where = f"{line}: conversation {c}"
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
