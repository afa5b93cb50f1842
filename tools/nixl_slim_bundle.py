"""Makes a slim NIXL bundle from the nixl-cu13 wheel, small enough to travel with a device `run`
(64 MiB carry limit for everything carried; the full wheel is 58.8 MB, 250 MB unpacked).

Kept: the ``nixl_cu13`` Python package, its core libraries, the UCX and POSIX plugins, UCX
itself with its shared-memory (cma, and the always-built sysv/posix/tcp inside libuct) and
CUDA transports (cuda_copy, cuda_ipc: ``ucx/libuct_cuda``), and every shared library those
need (the ELF ``NEEDED`` closure, found by reading the files, never guessed). Dropped: the
``nixl_ep_cu13`` torch extensions (~95 MB), the other plugins (storage: AWS/Azure/OBJ/GUSLI/
INFINIA/GDS; GPUNETIO, LIBFABRIC, telemetry) and the libraries only they need, UCX's
InfiniBand modules (no RDMA NIC on the boxes) and perftest, headers, scripts.

The bundle is a ``.tar.gz`` of a site-packages tree: extract it and put it on ``PYTHONPATH``:

    python3 tools/nixl_slim_bundle.py WHEEL --out /work/main/.whl-nixl/nixl_cu13_slim.tar.gz
    # on the box:
    mkdir -p /tmp/nixl && tar -xzf .whl-nixl/nixl_cu13_slim.tar.gz -C /tmp/nixl
    export PYTHONPATH=/tmp/nixl:$PYTHONPATH

``--check PYTHON`` then imports the bundle with that interpreter (the wheel's Python version,
3.12 for cp312; it needs numpy) and moves 16 MiB of host memory between two agents in one
process through UCX, byte-exact.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "nixl_cu13"
KEEP_PLUGINS = ("libplugin_UCX.so", "libplugin_POSIX.so")
# UCX loads its transports from ``ucx/`` at run time (not NEEDED by anything): the ones kept.
KEEP_UCX_MODULES = ("libuct_cma.so", "libuct_cuda.so", "libucm_cuda.so")

CHECK = r"""
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import nixl_cu13 as nixl
n = 16 << 20
src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
dst = np.zeros(n, np.uint8)
a = nixl.nixl_agent("slim-a", nixl.nixl_agent_config(backends=["UCX"]))
b = nixl.nixl_agent("slim-b", nixl.nixl_agent_config(backends=["UCX"]))
a.register_memory([(dst.ctypes.data, n, 0, "")], "DRAM")
b.register_memory([(src.ctypes.data, n, 0, "")], "DRAM")
a.add_remote_agent(b.get_agent_metadata())
b.add_remote_agent(a.get_agent_metadata())
rows = lambda base: np.array([[base + i * (1 << 20), 1 << 20, 0] for i in range(16)], np.uint64)
h = a.initialize_xfer("READ", a.get_xfer_descs(rows(dst.ctypes.data), "DRAM"),
                      a.get_xfer_descs(rows(src.ctypes.data), "DRAM"), "slim-b")
state = a.transfer(h)
while state == "PROC":
    state = a.check_xfer_state(h)
assert state == "DONE", state
assert np.array_equal(src, dst), "bytes differ"
print("slim nixl ok:", nixl.__file__, "16 MiB READ host to host byte-exact")
"""


def needed(path: Path) -> list[str]:
    """The ELF NEEDED entries of ``path`` (readelf's dynamic section)."""
    out = subprocess.run(
        ["readelf", "-d", str(path)], check=True, capture_output=True, text=True
    ).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def is_elf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"\x7fELF"


def slim(tree: Path) -> tuple[list[Path], list[Path]]:
    """Deletes from the unpacked wheel ``tree`` what the kept roots do not need; (kept, removed)."""
    for drop in ("nixl_ep_cu13", f"{PACKAGE}.scripts"):
        shutil.rmtree(tree / drop, ignore_errors=True)
    for data in tree.glob(f"{PACKAGE}-*.data"):
        shutil.rmtree(data)
    libs = tree / f"{PACKAGE}.libs"
    meson = tree / f".{PACKAGE}.mesonpy.libs"
    roots = list((tree / PACKAGE).glob("*.so"))
    for plugin_dir in (meson / "plugins", libs / "nixl"):
        roots += [plugin_dir / name for name in KEEP_PLUGINS if (plugin_dir / name).exists()]
    roots += [
        p
        for p in (libs / "ucx").glob("*.so*")
        if any(p.name.startswith(m) for m in KEEP_UCX_MODULES)
    ]
    # Libraries by soname in the bundle's library folders (plugins are loaded, never NEEDED).
    by_name = {p.name: p for d in (libs, meson) for p in d.iterdir() if p.is_file() and is_elf(p)}
    keep: set[Path] = set()
    todo = list(roots)
    while todo:
        path = todo.pop()
        if path in keep:
            continue
        keep.add(path)
        todo += [by_name[name] for name in needed(path) if name in by_name]
    removed = []
    for path in sorted(tree.rglob("*")):
        if path.is_file() and (path.suffix == ".la" or (is_elf(path) and path not in keep)):
            removed.append(path)
            path.unlink()
    return sorted(keep), removed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", type=Path, help="nixl_cu13-*.whl")
    ap.add_argument("--out", type=Path, required=True, help="the .tar.gz to write")
    ap.add_argument("--check", metavar="PYTHON", help="import and run a READ with this Python")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "site"
        with zipfile.ZipFile(args.wheel) as wheel:
            wheel.extractall(tree)
        kept, removed = slim(tree)
        for path in tree.rglob("*"):  # zipfile drops the modes: libraries must be loadable
            if path.is_file():
                path.chmod(0o755 if is_elf(path) else 0o644)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(args.out, "w:gz", compresslevel=9) as tar:
            for path in sorted(tree.iterdir()):
                tar.add(path, arcname=path.name)
        unpacked = sum(p.stat().st_size for p in tree.rglob("*") if p.is_file())
        print(
            f"kept {len(kept)} libraries ({unpacked / 1e6:.1f} MB unpacked), removed "
            f"{len(removed)} files; {args.out}: {args.out.stat().st_size / 1e6:.1f} MB"
        )
        if args.check:
            check = Path(tmp) / "check"
            with tarfile.open(args.out) as tar:
                tar.extractall(check, filter="tar")
            subprocess.run([args.check, "-c", CHECK, str(check)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
