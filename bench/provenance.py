"""Where a benchmark ran: one provenance record, the same in every results JSON of bench/.

Imported by the routines (bench/kvbench.py puts this folder on sys.path). Each stores
``"provenance": provenance(script)``:

- ``script``: the routine's file; ``commit``: short hash of HEAD ("-dirty" when tracked files
  differ). Where the checkout has no git metadata (or stale metadata, e.g. files copied onto a
  GPU machine), the commit is taken from kvbench's ``--commit`` or the ``KVPOOL_COMMIT``
  environment variable, else "unknown".
- ``date_utc``; ``machine``: host name, platform, CPU model and count, the 1-minute load
  average before the run (other work on a shared machine inflates timings).
- ``extension``: the compiled ``kvpool._core`` that actually ran (its path, size, and whether it
  carries debug info: a debug build is several times slower than the release wheel); None
  for a benchmark without the Python package.
- ``versions`` of Python, NumPy and, when importable, CuPy and torch; ``gpu`` (name, compute
  capability, driver and runtime versions) when CuPy sees a device, else None.

Results are filed per run in ``bench/results/<date>_<commit>_<machine>/``: :func:`run_dir`.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    """Short hash of HEAD, with "-dirty" when tracked files differ from it; "unknown" without git."""
    git = ["git", "-C", str(Path(__file__).resolve().parent)]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=False,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def commit(given: str | None = None) -> str:
    """The commit to record: `given` (a --commit option), else $KVPOOL_COMMIT, else git."""
    return given or os.environ.get("KVPOOL_COMMIT") or git_commit()


def machine() -> dict[str, Any]:
    """Host name, platform, CPU model and count, and the 1-minute load average before the run."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    return {
        "node": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_average_1m_before": round(os.getloadavg()[0], 2),
    }


def extension() -> dict[str, Any] | None:
    """The compiled module that runs: kvpool._core's own file (not the package's __init__);
    None when kvpool is not installed (a Rust-only benchmark)."""
    try:
        core = importlib.import_module("kvpool._core")
    except ImportError:
        return None
    path = Path(core.__file__ or "")
    data = path.read_bytes()
    return {
        "path": str(path),
        "bytes": len(data),
        "debug_info": ".debug_info" in elf_section_names(data),
    }


def elf_section_names(data: bytes) -> set[str]:
    """Section names of a little-endian ELF64 file (empty for anything else)."""
    if data[:6] != b"\x7fELF\x02\x01":
        return set()
    shoff = int.from_bytes(data[0x28:0x30], "little")
    shentsize, shnum, shstrndx = (
        int.from_bytes(data[o : o + 2], "little") for o in (0x3A, 0x3C, 0x3E)
    )
    headers = [data[shoff + i * shentsize : shoff + (i + 1) * shentsize] for i in range(shnum)]
    strtab_at = int.from_bytes(headers[shstrndx][0x18:0x20], "little")
    names = set()
    for header in headers:
        start = strtab_at + int.from_bytes(header[0:4], "little")
        names.add(data[start : data.index(b"\0", start)].decode(errors="replace"))
    return names


def _version(name: str) -> str | None:
    try:
        return importlib.import_module(name).__version__
    except Exception:  # not installed, or failing to find its CUDA libraries
        return None


def gpu() -> dict[str, Any] | None:
    """The current CUDA device as CuPy sees it, or None."""
    try:
        import cupy

        rt = cupy.cuda.runtime
        props = rt.getDeviceProperties(cupy.cuda.Device().id)
    except Exception:
        return None
    name = props["name"]
    return {
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "compute_capability": f"{props['major']}.{props['minor']}",
        "memory_bytes": int(props["totalGlobalMem"]),
        "driver": rt.driverGetVersion(),
        "runtime": rt.runtimeGetVersion(),
    }


def provenance(script: str, given_commit: str | None = None) -> dict[str, Any]:
    """The record every results JSON carries under "provenance" (see the module docstring)."""
    ext = extension()
    if ext is not None and ext["debug_info"]:
        print(
            f"warning: {ext['path']} is a debug build; timings are not representative",
            file=sys.stderr,
        )
    return {
        "script": script,
        "commit": commit(given_commit),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "extension": ext,
        "versions": {
            "python": platform.python_version(),
            "numpy": _version("numpy"),
            "cupy": _version("cupy"),
            "torch": _version("torch"),
        },
        "gpu": gpu(),
    }


def run_dir(given_commit: str | None = None, machine_name: str | None = None) -> Path:
    """bench/results/<date>_<commit>_<machine>/ for this run (created)."""
    name = machine_name or os.environ.get("KVPOOL_MACHINE") or platform.node() or "unknown"
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    path = RESULTS / f"{date}_{commit(given_commit)}_{name}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, record: Any, indent: int = 1) -> None:
    """Writes a results record as JSON (its folder made if missing), newline-terminated."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=indent) + "\n")
