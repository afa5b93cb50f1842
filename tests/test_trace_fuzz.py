"""A fuzzer for the trace readers of `kvpool simulate --trace`, every format: Hypothesis
writes valid and malformed files (wrong types, booleans, huge and non-finite numbers, deep
nesting, short and long rows, cut lines, bytes that are not UTF-8, BOMs, CRLF) and the reader
must either return well-formed requests or raise TraceError in one line that starts with
`--trace <path>`, never anything else, within a bounded allocation. A few examples go through
the CLI in a subprocess under an address-space limit: exit 0, or exit 2 with one line.

Profiles: the derandomized "ci" profile of conftest.py; HYPOTHESIS_PROFILE=soak for long runs.
"""

from __future__ import annotations

import csv
import datetime
import io
import itertools
import json
import math
import os
import resource
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvpool.sim import TraceError
from kvpool.sim.traces import _ArrayItems, read_trace
from kvpool.sim.workload import MAX_ARRIVAL_S, int_literal

# ---- values: what a field may hold --------------------------------------------------------

HUGE_INT = st.integers(min_value=2**53 - 2, max_value=2**53 + 2) | st.builds(
    lambda digits: 10**digits - 1, st.sampled_from([20, 101, 400, 4000])
)
HOSTILE = st.one_of(
    st.integers(-(2**40), 2**40),
    HUGE_INT,
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
    st.lists(st.integers(0, 9), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
COUNT = st.integers(1, 3000)
TIME = st.floats(0, 1e4, allow_nan=False)


def rarely(draw: st.DrawFn) -> bool:
    return draw(st.integers(0, 7)) == 7


def field(valid: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    """A valid value or a hostile one."""
    return st.one_of(valid, HOSTILE)


@st.composite
def mostly(draw: st.DrawFn, valid: st.SearchStrategy, hostile: st.SearchStrategy) -> object:
    """A draw of `valid` about nine times in ten, else of `hostile`: a file of a few rows is
    then often valid throughout (one_of would not weigh them: it merges equal branches)."""
    return draw(hostile) if rarely(draw) else draw(valid)


# Hypothesis leans to the simplest choice (the first branch, the smallest integer), so every
# strategy here puts the valid form first and draws mutations as "not the smallest value":
# the examples then hold enough valid files to reach the readers' success paths too.


def json_row(
    fields: dict[str, st.SearchStrategy[object]],
    optional: dict[str, st.SearchStrategy[object]] | None = None,
) -> st.SearchStrategy[dict]:
    """An object with these fields, or with some of them and of `optional` (maybe hostile
    values), maybe an unknown one."""
    maybe = {**fields, **(optional or {})}
    return mostly(
        st.fixed_dictionaries(dict(fields)),
        st.fixed_dictionaries(
            {},
            optional={name: field(valid) for name, valid in maybe.items()} | {"unknown": HOSTILE},
        ),
    )


KVPOOL_FIELDS = {
    "arrival_s": TIME,
    "prompt_tokens": COUNT,
    "output_tokens": COUNT,
    "priority": st.integers(-3, 3),
}
SHARING_FIELDS = {
    "prefix_group": st.integers(0, 2),
    "prefix_tokens": st.integers(0, 64),
    "conversation_id": st.integers(0, 2),
}
MOONCAKE_FIELDS = {
    "timestamp": st.integers(0, 10**7),
    "input_length": COUNT,
    "output_length": COUNT,
    "hash_ids": st.lists(st.integers(0, 2**70), max_size=8),
}
CSV_COLUMNS = {
    "kvpool": {"arrival_s": TIME, "prompt_tokens": COUNT, "output_tokens": COUNT},
    "azure": {
        "TIMESTAMP": st.datetimes(datetime.datetime(1970, 1, 2), datetime.datetime(2200, 1, 1)).map(
            lambda t: t.isoformat(sep=" ")
        ),
        "ContextTokens": COUNT,
        "GeneratedTokens": COUNT,
    },
    "burstgpt": {
        "Timestamp": TIME,
        "Model": st.sampled_from(["ChatGPT", "GPT-4"]),
        "Request tokens": st.integers(0, 3000),
        "Response tokens": st.integers(0, 3000),
    },
}
MESSAGE = json_row(
    {"from": st.sampled_from(["human", "gpt", "system", "user", "chatgpt"]), "value": st.text()}
)
TURN = st.tuples(
    st.fixed_dictionaries({"from": st.sampled_from(["human", "user"]), "value": st.text()}),
    st.fixed_dictionaries({"from": st.sampled_from(["gpt", "chatgpt"]), "value": st.text()}),
).map(list)
CONVERSATION = mostly(
    st.fixed_dictionaries(
        {"id": st.text(max_size=4), "conversations": st.lists(TURN, min_size=1, max_size=3)}
    ).map(lambda c: {**c, "conversations": [m for turn in c["conversations"] for m in turn]}),
    json_row({"id": st.text(max_size=4), "conversations": st.lists(MESSAGE, max_size=4)}),
)
# More digits than Python's int() takes from text: written by hand, json.dumps cannot.
LONG_NUMBER_ROW = '{"arrival_s": 0, "prompt_tokens": ' + "7" * 5000 + ', "output_tokens": 1}'
DEEP = st.sampled_from([50, 990, 5000, 100_000]).map(lambda n: "[" * n + "]" * n)


def dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)  # NaN and Infinity as Python writes them


def lines_of(rows: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
    """Lines, some replaced by deep nesting, a cut copy of a neighbour, or a blank."""
    hostile_line = st.one_of(
        DEEP, st.just(""), st.just("   "), st.text(max_size=20), st.just(LONG_NUMBER_ROW)
    )
    return st.lists(mostly(rows, hostile_line), min_size=1, max_size=8)


@st.composite
def cut(draw: st.DrawFn, text: str) -> str:
    """`text`, perhaps cut short at a random character."""
    if text and rarely(draw):
        return text[: draw(st.integers(0, len(text)))]
    return text


@st.composite
def jsonl_text(
    draw: st.DrawFn,
    fields: dict[str, st.SearchStrategy[object]],
    optional: dict[str, st.SearchStrategy[object]] | None = None,
) -> str:
    rows = json_row(fields, optional).map(dumps).flatmap(lambda line: cut(line))
    return "\n".join(draw(lines_of(rows))) + draw(st.sampled_from(["", "\n"]))


def csv_field(value: object) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="").writerow([value])
    return buf.getvalue()


@st.composite
def csv_text(draw: st.DrawFn, columns: dict[str, st.SearchStrategy[object]]) -> str:
    names = draw(st.permutations([*columns, "extra"]))
    if rarely(draw):
        names = names[: len(names) - draw(st.integers(1, 2))]  # maybe drop some
    values = {**columns, "extra": HOSTILE}

    @st.composite
    def row(draw2: st.DrawFn) -> str:
        hostile = rarely(draw2)
        cells = [csv_field(draw2(field(values[n]) if hostile else values[n])) for n in names]
        if rarely(draw2):  # a short row or a long one
            cells = cells[: draw2(st.integers(0, len(cells)))] + draw2(
                st.lists(st.just("9"), max_size=1)
            )
        return ",".join(cells)

    body = draw(lines_of(row()))
    return "\n".join([",".join(map(csv_field, names)), *body]) + "\n"


@st.composite
def sharegpt_text(draw: st.DrawFn) -> str:
    items = draw(st.lists(mostly(CONVERSATION.map(dumps), DEEP | HOSTILE.map(dumps)), max_size=5))
    text = "[" + ",\n ".join(items) + "]"
    return draw(cut(text))


FORMATS = {
    "kvpool.jsonl": jsonl_text(KVPOOL_FIELDS, SHARING_FIELDS),
    "mooncake.jsonl": jsonl_text(MOONCAKE_FIELDS),
    "kvpool.csv": csv_text(CSV_COLUMNS["kvpool"]),
    "azure.csv": csv_text(CSV_COLUMNS["azure"]),
    "burstgpt.csv": csv_text(CSV_COLUMNS["burstgpt"]),
    "sharegpt.json": sharegpt_text(),
}


@st.composite
def trace_bytes(draw: st.DrawFn, text: st.SearchStrategy[str]) -> bytes:
    """The text as a file: maybe a BOM, CRLF line ends, or a byte that is not UTF-8."""
    data = draw(text).encode()
    if draw(st.booleans()):
        data = data.replace(b"\n", b"\r\n")
    if rarely(draw):
        data = b"\xef\xbb\xbf" + data
    if data and rarely(draw):
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\x00", b"\xe9"])) + data[at:]
    return data


# ---- what a reader must do -----------------------------------------------------------------

ALLOCATION_LIMIT = 64 << 20  # bytes allocated at once while reading a fuzzed file (<1 MiB)


def check_read(path: Path, trace_format: str, max_model_len: int) -> None:
    """Reads the file; well-formed requests or one TraceError line, in bounded memory."""
    tracemalloc.start()
    try:
        requests, info = read_trace(path, trace_format, max_model_len)
    except TraceError as e:
        message = str(e)
        assert message.startswith(f"--trace {path}"), message
        assert "\n" not in message and len(message) < 600, message
        return
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < ALLOCATION_LIMIT, peak
    assert requests and info.format in ("kvpool", "azure", "burstgpt", "mooncake", "sharegpt")
    ids = [r.request_id for r in requests]  # ours keeps each row's place in the file
    assert (ids if info.format != "kvpool" else sorted(ids)) == list(range(len(ids)))
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)  # from the first row's time (a skipped one's too)
    assert all(math.isfinite(t) and 0 <= t <= MAX_ARRIVAL_S for t in arrivals)
    for r in requests:
        assert r.prompt_tokens >= 1 and r.output_tokens >= 1
        assert r.prompt_tokens + r.output_tokens <= max_model_len
        assert r.tokens is not None and len(r.tokens) >= r.prompt_tokens + r.output_tokens


FUZZ = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("name", sorted(FORMATS))
@FUZZ
@given(data=st.data(), auto=st.booleans(), max_model_len=st.sampled_from([64, 4096]))
def test_reader_returns_requests_or_one_line(tmp_path, name, data, auto, max_model_len):
    path = tmp_path / name
    path.write_bytes(data.draw(trace_bytes(FORMATS[name])))
    trace_format = "auto" if auto else name.split(".")[0]
    check_read(path, trace_format, max_model_len)


@FUZZ
@given(
    items=st.lists(CONVERSATION, max_size=6),
    indent=st.sampled_from([None, 1]),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_sharegpt_items_across_any_chunk_boundaries(items, indent, cuts):
    # The incremental parser must see the items json.loads sees, wherever the pieces end.
    text = json.dumps(items, indent=indent)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    got = [value for _, value in _ArrayItems(iter(pieces), "t").items("items")]
    assert got == json.loads(text, parse_int=int_literal)  # huge literals as HugeInteger


MEMORY_LIMIT = 1 << 30  # address space of the CLI process: a few hundred MiB is its own


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@pytest.mark.parametrize("name", ["kvpool.csv", "mooncake.jsonl", "sharegpt.json"])
@settings(max_examples=2, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_cli_exits_0_or_2_with_one_line(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data.draw(trace_bytes(FORMATS[name])))
    out = tmp_path / "report"
    run = subprocess.run(
        [sys.executable, "-m", "kvpool", "simulate", "--trace", str(path)]
        + ["--kv-memory", "512MiB", "--max-model-len", "4096", "--max-running-seqs", "16"]
        + ["--max-tokens-per-step", "512", "--no-progress", "--no-plot", "--out", str(out)],
        capture_output=True,
        text=True,
        preexec_fn=_limit,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    if run.returncode == 0:
        assert (out / "simulate.json").exists()
        return
    assert run.returncode == 2, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvpool simulate: error: --trace {path}")
