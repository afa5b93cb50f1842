"""Hostile trace files: each is refused with exit status 2 and one line naming the file, the
line and the field, before anything is allocated; a huge file is not read into memory first;
Mooncake hash ids stay exact."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kvpool.sim import TraceError
from kvpool.sim.cli import main
from kvpool.sim.traces import read_trace
from kvpool.sim.workload import MAX_LINE_BYTES, load_trace

CLI = [
    "simulate",
    "--kv-memory",
    "512MiB",
    "--max-model-len",
    "2048",
    "--no-progress",
    "--no-plot",
]
MOONCAKE_ROW = '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n'
KVPOOL_ROW = '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5}\n'
SHAREGPT_ITEM = '{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}'
DEEP = "[" * 100_000


def refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], path: Path) -> str:
    """The one stderr line of `kvpool simulate --trace path`, which must exit 2 and write
    no report; also checks that read_trace raises the same message."""
    out = tmp_path / "report"
    assert main([*CLI, "--trace", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    prefix = "kvpool simulate: error: "
    assert lines[0].startswith(prefix + f"--trace {path}"), lines[0]
    assert not out.exists()
    with pytest.raises(TraceError) as e:
        read_trace(path, max_model_len=2048)
    assert str(e.value) == lines[0][len(prefix) :]
    return lines[0]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (  # a short row left TIMESTAMP None: AttributeError on .strip()
            "azure.csv",
            "ContextTokens,TIMESTAMP,GeneratedTokens\n5\n",
            "azure.csv:2: no TIMESTAMP (the row has fewer columns",
        ),
        ("deep.jsonl", KVPOOL_ROW + DEEP + "\n", "deep.jsonl:2: JSON nested too deeply"),
        ("deep.json", f"[{SHAREGPT_ITEM},\n{DEEP}]", "deep.json:2: JSON nested too deeply"),
        (
            "mooncake_deep.jsonl",
            MOONCAKE_ROW + MOONCAKE_ROW.replace("[1, 2]", DEEP),
            "mooncake_deep.jsonl:2: JSON nested too deeply",
        ),
        (  # csv's field limit raised _csv.Error
            "long.csv",
            "arrival_s,prompt_tokens,output_tokens\n0,5,5\n1," + "7" * 200_000 + ",5\n",
            "long.csv:3: not valid CSV (field larger than field limit (131072))",
        ),
        (  # int() of 5,000 digits raised a ValueError naming neither file nor line
            "digits.jsonl",
            KVPOOL_ROW.replace("5,", "9" * 5000 + ",", 1),
            "digits.jsonl:1: prompt_tokens is out of range, got an integer of 5000 digits",
        ),
        (
            "mooncake_digits.jsonl",
            MOONCAKE_ROW + MOONCAKE_ROW.replace("600", "6" * 5000),
            "mooncake_digits.jsonl:2: input_length must be an integer >= 1, got an integer "
            "of 5000 digits",
        ),
        (  # float(True) made it 1 ms
            "mooncake_bool.jsonl",
            MOONCAKE_ROW + MOONCAKE_ROW.replace('"timestamp": 0', '"timestamp": true'),
            "mooncake_bool.jsonl:2: timestamp must be a number in [0, 1e+13], got True",
        ),
        (
            "mooncake_hash.jsonl",
            MOONCAKE_ROW.replace("[1, 2]", "[1, 2.5]"),
            "mooncake_hash.jsonl:1: hash_ids[1] must be an integer >= 0, got 2.5",
        ),
        (  # an arrival at 1e308 gave latencies of 0.0 s and 0 tokens/s
            "late.jsonl",
            KVPOOL_ROW + KVPOOL_ROW.replace('"arrival_s": 0', '"arrival_s": 1e308'),
            "late.jsonl:2: arrival_s must be a number in [0, 1e+10], got 1e+308",
        ),
        (
            "late_burst.csv",
            "Timestamp,Model,Request tokens,Response tokens\n0,m,5,5\n1e308,m,5,5\n",
            "late_burst.csv:3: Timestamp must be a number in [0, 1e+10], got '1e308'",
        ),
    ],
)
def test_bad_trace_is_one_line_naming_file_line_and_field(tmp_path, capsys, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    assert message in refused(tmp_path, capsys, path)


def test_bytes_that_are_not_utf8_name_their_line(tmp_path, capsys):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(KVPOOL_ROW.encode() * 2 + b'{"arrival_s": 0, "x": "\xe9"}\n')
    assert "latin1.jsonl:3: not UTF-8 text (byte 24 of the line)" in refused(tmp_path, capsys, path)


def test_a_message_quotes_no_huge_value(tmp_path, capsys):
    path = tmp_path / "huge_value.jsonl"
    path.write_text(KVPOOL_ROW.replace("5,", '"' + "x" * 500_000 + '",', 1))
    line = refused(tmp_path, capsys, path)
    assert "huge_value.jsonl:1: prompt_tokens must be a number, got 'xxx" in line
    assert len(line) < 300


def test_mooncake_hash_ids_above_2_53_stay_distinct(tmp_path):
    # Through float(), 2**53 and 2**53 + 1 were one id: the two prompts shared their block.
    path = tmp_path / "big_ids.jsonl"
    path.write_text(
        MOONCAKE_ROW.replace("[1, 2]", f"[{2**53}]")
        + MOONCAKE_ROW.replace("[1, 2]", f"[{2**53 + 1}]")
    )
    first, second = read_trace(path)[0]
    a, b = (r.tokens.ids(512) for r in (first, second))
    assert (a != b).mean() > 0.9
    path.write_text(MOONCAKE_ROW.replace("[1, 2]", f"[{2**64 + 7}, 3]") * 2)  # equal ids, any size
    first, second = read_trace(path)[0]
    assert np.array_equal(first.tokens.ids(600), second.tokens.ids(600))


def test_a_line_is_bounded(tmp_path, capsys):
    path = tmp_path / "long_line.jsonl"
    path.write_text(KVPOOL_ROW + " " * MAX_LINE_BYTES + KVPOOL_ROW)
    assert f"long_line.jsonl:2: line longer than {MAX_LINE_BYTES} bytes" in refused(
        tmp_path, capsys, path
    )
    fits = tmp_path / "fits.jsonl"  # a line of exactly MAX_LINE_BYTES bytes and its newline
    fits.write_text(KVPOOL_ROW[:-1] + " " * (MAX_LINE_BYTES - len(KVPOOL_ROW) + 1) + "\n")
    assert len(load_trace(fits)) == 1


GIB = 1 << 30
MEMORY_LIMIT = GIB  # the interpreter with numpy and kvpool needs a few hundred MiB


def _limited_run(args: list[str]) -> subprocess.CompletedProcess[str]:
    """`python -m kvpool` under an address-space limit well below the size of the files it
    is given: a reader that loads a whole file fails with MemoryError (exit 1, a traceback)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kvpool", *args],
        capture_output=True,
        text=True,
        preexec_fn=limit,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("name", "head", "message"),
    [
        ("zeros.jsonl", b"", ":1: line longer than 1048576 bytes"),
        ("late_bad_line.jsonl", KVPOOL_ROW.encode() + b"{oops\n", ":2: not valid JSON"),
        ("zeros.json", b"", ": expected a list of {id, conversations} objects"),
        ("zeros.csv", b"arrival_s,prompt_tokens,output_tokens\n", ":2: line longer than"),
        (
            "bad_first_conversation.json",
            b'[{"id": 1, "conversations": 5},\n',
            ":1: conversation 0: conversations must be a list",
        ),
    ],
)
def test_a_huge_sparse_trace_fails_at_its_first_bad_line_in_bounded_memory(
    tmp_path, name, head, message
):
    path = tmp_path / name
    path.write_bytes(head)
    os.truncate(path, 4 * GIB)  # sparse: zeros after `head`, no disk used
    run = _limited_run([*CLI, "--trace", str(path), "--out", str(tmp_path / "r")])
    assert run.returncode == 2, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvpool simulate: error: --trace {path}")
    assert message in lines[0], lines[0]


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_dev_zero_fails_fast_with_a_clear_message():
    run = _limited_run([*CLI, "--trace", "/dev/zero", "--out", "/nonexistent/r"])
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().splitlines() == [
        "kvpool simulate: error: --trace /dev/zero:1: line longer than 1048576 bytes "
        "(a trace has one request per line)"
    ]


def test_a_pipe_is_read_once(tmp_path):
    # Detection and reading share one pass, so a FIFO (`--trace <(zcat t.jsonl.gz)`) works for
    # every format, ours included: it was opened twice, and the second open waited for a writer
    # that never came. The reader runs in a subprocess so that a regression fails, not hangs.
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    code = (
        "import sys; from pathlib import Path; from kvpool.sim.traces import read_trace; "
        "r, info = read_trace(Path(sys.argv[1])); print(info.format, len(r))"
    )
    reader = subprocess.Popen(
        [sys.executable, "-c", code, str(fifo)], stdout=subprocess.PIPE, text=True
    )
    try:
        fifo.write_text(KVPOOL_ROW * 3)
        out, _ = reader.communicate(timeout=60)
    finally:
        reader.kill()
        reader.wait()
    assert reader.returncode == 0 and out.split() == ["kvpool", "3"]


def test_a_sharegpt_conversation_is_bounded(tmp_path, capsys, monkeypatch):
    import kvpool.sim.traces as traces

    monkeypatch.setattr(traces, "MAX_CONVERSATION_CHARS", 1000)
    path = tmp_path / "long_conversation.json"
    long_item = SHAREGPT_ITEM.replace('"hi"', '"' + "h" * 300_000 + '"')
    path.write_text(f"[{SHAREGPT_ITEM},\n {long_item}]")
    assert "long_conversation.json:2: an item longer than 1000 characters" in refused(
        tmp_path, capsys, path
    )
    path.write_text(f"[{SHAREGPT_ITEM},\n {SHAREGPT_ITEM}]")  # short ones still read
    assert len(read_trace(path)[0]) == 2


def test_a_json_array_found_by_its_first_line_counts_lines_from_it(tmp_path, capsys):
    path = tmp_path / "conversations.txt"  # not .json: detected by the "[" of line 3
    path.write_text(f"\n\n[{SHAREGPT_ITEM},\n\n {{oops}}]")
    assert "conversations.txt:5: not valid JSON (Expecting property name" in refused(
        tmp_path, capsys, path
    )
    path.write_text(f"\n\n[{SHAREGPT_ITEM},\n\n {SHAREGPT_ITEM}]")
    requests, info = read_trace(path)
    assert info.format == "sharegpt" and len(requests) == 2
