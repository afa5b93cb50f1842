"""The optional GPU dependencies stay optional: `import kvpool` and `import kvpool.kernels` (and
the CLI) import neither CuPy nor torch, so a machine with the `cuda12` or `cuda13` extra but no
GPU, or whose CuPy cannot find its CUDA libraries, still imports kvpool. CuPy is imported where
a kernel is launched on a GPU pool."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHECK = """
import sys
import kvpool, kvpool.kernels, kvpool.sim.cli
pool = kvpool.Pool(kvpool.KvLayout(1, 1, 4, 16, "float16"), 8, device="host")
ids = pool.alloc_many(2)
pool.free_many(ids)
loaded = sorted(m for m in ("cupy", "torch") if m in sys.modules)
print("loaded:", loaded)
"""


def run_check(extra_path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if extra_path is not None:  # ahead of everything, so its cupy shadows any installed one
        env["PYTHONPATH"] = os.pathsep.join(
            [extra_path, *filter(None, [os.environ.get("PYTHONPATH")])]
        )
    return subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=120
    )


def test_importing_kvpool_imports_no_gpu_library():
    done = run_check()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded: []"


def test_a_cupy_that_fails_to_import_does_not_break_kvpool(tmp_path):
    # What a cupy-cuda12x wheel does on a machine whose CUDA it cannot load, at its worst.
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(
        textwrap.dedent("raise ImportError('CuPy failed to load libcudart.so.12')\n")
    )
    done = run_check(str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded: []"
