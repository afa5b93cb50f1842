"""Where a benchmark ran: the commit and the machine, recorded in every results JSON.

Imported by the scripts in bench/ (run as `python3 bench/<name>.py`, so this folder is on
sys.path). On the GPU box there is no git: the commit is then "unknown" unless the script
takes it from its `--commit` option.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def git_commit() -> str:
    """Short hash of HEAD, with "-dirty" when tracked files differ from it."""
    git = ["git", "-C", str(Path(__file__).resolve().parent)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=False)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def machine() -> dict[str, Any]:
    """Host name, platform, CPU model and count, and the 1-minute load average before the run
    (other work on a shared machine inflates timings)."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "node": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_average_1m_before": round(os.getloadavg()[0], 2),
    }
