"""Compile the Hopper prefill modules with NVRTC on the CPU (no GPU) and print ptxas's resource
report; with --sass DIR also write each cubin's SASS (cuobjdump from the nvidia-cuda-cuobjdump
or Triton wheel, when one is installed) and count the instructions that matter: HGMMA, the
block-table loads (LDG), LDL/STL (local memory), SHFL, MUFU.EX2.

Usage: PYTHONPATH=python python tools/sass_sm90.py [--head-dim 128] [--sass /tmp/sass]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

from cuda.bindings import nvrtc  # type: ignore[import-untyped]
from kvpool.kernels import _build


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton  # type: ignore[import-untyped]

        path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(path) if path.is_file() else None
    except ImportError:
        return None


def compile_variant(v: _build.PrefillVariant) -> tuple[bytes, str]:
    src = _build.read_source(v.source).encode()
    err, prog = nvrtc.nvrtcCreateProgram(src, b"kernel.cu", 0, [], [])
    opts = [o.encode() for o in (*v.options(), "-ftz=true", f"--gpu-architecture={v.arch}")]
    opts.append(b"--ptxas-options=-v")
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, log)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise SystemExit(f"{v}: {err}\n{log.decode(errors='replace')}")
    _, size = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = b" " * size
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    nvrtc.nvrtcDestroyProgram(prog)
    return cubin, log.decode(errors="replace")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, action="append")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tma", action="store_true", help="the TMA-load modules (KV_TMA=1)")
    ap.add_argument("--sass", help="folder for the SASS listings")
    args = ap.parse_args()
    tool = _cuobjdump() if args.sass else None
    for d in args.head_dim or list(_build.HEAD_DIMS):
        v = _build.sm90_prefill_variant(args.dtype, d, args.block_size, args.tma)
        cubin, log = compile_variant(v)
        report = " | ".join(
            line.strip() for line in log.splitlines() if re.search(r"registers|spill|stack", line)
        )
        warn = [line for line in log.splitlines() if "warning" in line.lower()]
        print(f"D={d} BN={v.kv_tile} bs={args.block_size} tma={int(v.tma)}: {report}")
        for line in warn:
            print(f"  {line.strip()}")
        if args.sass and tool:
            out = Path(args.sass)
            out.mkdir(parents=True, exist_ok=True)
            tag = f"d{d}{'_tma' if v.tma else ''}"
            cub = out / f"prefill_sm90_{tag}.cubin"
            cub.write_bytes(cubin)
            sass = subprocess.run([tool, "-sass", str(cub)], capture_output=True, text=True).stdout
            (out / f"prefill_sm90_{tag}.sass").write_text(sass)
            counts = {
                k: len(re.findall(pat, sass))
                for k, pat in (
                    ("HGMMA", r"\bHGMMA\."),
                    ("LDG", r"\bLDG\."),
                    ("LDGSTS", r"\bLDGSTS"),
                    ("UTMALDG", r"\bUTMALDG"),
                    ("SHFL", r"\bSHFL\."),
                    ("LDL/STL", r"\b(LDL|STL)\b"),
                    ("MUFU.EX2", r"MUFU\.EX2"),
                    ("WARPSYNC/BAR", r"\bBAR\."),
                )
            }
            print(f"  SASS {counts}")
        elif args.sass:
            print("  (no cuobjdump found)", file=sys.stderr)


if __name__ == "__main__":
    main()
