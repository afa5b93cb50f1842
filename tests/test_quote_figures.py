"""quote_figures.py --write: a re-measured phrase's numbers go where the old ones were, and
nowhere else."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("quote_figures", REPO / "tools" / "quote_figures.py")
quote_figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quote_figures)
requote = quote_figures.requote


def test_a_wrapped_phrase_gets_its_new_numbers_and_keeps_its_line_break():
    text = (
        "Intro.\n- growing a pool: 30x faster than allocate-copy-free at 256 MiB\n"
        "  chunks, 6x at 32 MiB.\n"
    )
    new = requote(
        text, 0, len(text), "30x faster than allocate-copy-free at 256 MiB chunks, 6x at 32 MiB"
    )
    assert new == text  # the same numbers: nothing changes
    new = requote(
        text, 0, len(text), "40x faster than allocate-copy-free at 256 MiB chunks, 7x at 32 MiB"
    )
    assert new == (
        "Intro.\n- growing a pool: 40x faster than allocate-copy-free at 256 MiB\n"
        "  chunks, 7x at 32 MiB.\n"
    )


def test_thousands_and_decimals_are_one_number_each():
    text = "18,006 tokens/s with CUDA graphs and 4,843 eager (0.98-1.00 of 1, 16, 256)"
    new = requote(
        text,
        0,
        len(text),
        "19,292 tokens/s with CUDA graphs and 5,692 eager (0.96-1.00 of 1, 16, 256)",
    )
    assert new == "19,292 tokens/s with CUDA graphs and 5,692 eager (0.96-1.00 of 1, 16, 256)"


def test_a_table_row_is_found_by_its_label_cells_not_by_its_shape():
    table = (
        "| 1x4096 | fp16 | 128 | 32 | 14.3 | 0.91 |\n"
        "| 1x4096 | fp16 | 64 | 32 | 10.1 | 1.04 |\n"
        "| 1x4096 | fp16 | 128 | 64 | 18.3 | 0.83 |\n"
    )
    new = requote(table, 0, len(table), "| 1x4096 | fp16 | 128 | 64 | 18.0 | 0.83 |")
    assert new == table.replace("| 18.3 | 0.83 |", "| 18.0 | 0.83 |")
    # Only the span given is searched (a README section): without the first row, the two left
    # share four label numbers each with it, and a tie is no answer.
    second = table.index("\n") + 1
    assert requote(
        table, 0, len(table), "| 1x4096 | fp16 | 128 | 32 | 14.5 | 0.89 |"
    ) == table.replace("| 14.3 | 0.91 |", "| 14.5 | 0.89 |")
    assert requote(table, second, len(table), "| 1x4096 | fp16 | 128 | 32 | 14.5 | 0.89 |") is None


def test_no_single_place_or_a_changed_word_is_left_for_a_hand_edit():
    two = "| a | 1.0 |\n| a | 2.0 |\n"
    assert requote(two, 0, len(two), "| a | 3.0 |") is None  # two rows fit equally
    text = "Targets: **missed** (1.17x and 1.5x slower"
    assert requote(text, 0, len(text), "Targets: **met** (1.10x and 1.2x slower") is None
    assert (
        requote(text, 0, len(text), "Targets: **missed** (1.18x and 1.4x slower")
        == "Targets: **missed** (1.18x and 1.4x slower"
    )
