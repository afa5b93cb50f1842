"""The loop of a benchmark over its shape grid (routines/fp8.py, routines/fp8_sweep.py).

One row per (batch, seq_len) shape; a shape that raises is recorded as a row with its error and
the run goes on; the JSON is rewritten after every row, so a run cut short by its time limit
keeps what it measured. Both routines ran through it on an H200 with every row measured and
every sweep candidate correct (bench/results/2026-12-01_1ade54f_h200/).
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def measure_grid(
    grid: Iterable[tuple[int, int]],
    measure: Callable[[int, int], dict[str, Any]],
    result: dict[str, Any],
    out_path: str,
) -> Iterator[dict[str, Any]]:
    """Appends `measure(batch, seq_len)` for each shape to result["rows"], writes `result` to
    `out_path`, and yields the row (for the caller's progress line)."""
    for batch, seq_len in grid:
        try:
            row = measure(batch, seq_len)
        except Exception as e:
            traceback.print_exc()
            row = {"shape": f"{batch}x{seq_len}", "error": f"{type(e).__name__}: {e}"[:300]}
        result["rows"].append(row)
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
        yield row
