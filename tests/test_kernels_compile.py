"""Every kernel module the library needs compiles with NVRTC for sm_80 and sm_90, no GPU needed
(CI): all tensor-core decode modules (52: they cover every supported head_dim, block size and
group), 16 of the fp8 decode modules (e4m3 / e5m2 caches with fp16 / bf16 queries), an 8-module
subset of the CUDA-core baseline, append_kv (with append_kv_fp8), copy_blocks and paged_metadata.
The fp8 decode converts fp8 pairs with `cvt ... e4m3x2/e5m2x2` on sm_89+ and with integer
arithmetic (exact, emulated) on sm_80, so both archs compile every fp8 module.

Uses NVRTC from PyPI (`cuda-bindings` + `nvidia-cuda-nvrtc`); the kernels need no CUDA headers,
but the `nvidia-cuda-runtime` include folder is passed when present. Skips only when those
packages are missing. Also checks the resource report: no spills to local memory beyond a few
bytes, so a change that pushes the decode kernel into local memory fails here.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest
from kvpool.kernels import _build

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) not installed")

ARCHS = ("sm_80", "sm_90")
MAX_SPILL_BYTES = 16


def _include_dirs() -> list[str]:
    try:
        import nvidia
    except ImportError:
        return []
    dirs = []
    for root in nvidia.__path__:
        for sub in ("cu13/include", "cuda_runtime/include"):
            if os.path.isfile(os.path.join(root, sub, "cuda_fp16.h")):
                dirs.append(os.path.join(root, sub))
    return dirs


def _check(result, prog, what):
    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise AssertionError(f"{what}: {err}\n{log.decode(errors='replace')}")
    return result[1:]


def compile_cubin(source: str, options: tuple[str, ...], arch: str) -> str:
    """Compile to a cubin for `arch`; return the NVRTC log (holds the ptxas -v report)."""
    (prog,) = _check(
        nvrtc.nvrtcCreateProgram(source.encode(), b"kernel.cu", 0, [], []), None, "create"
    )
    try:
        opts = [o.encode() for o in options]
        opts += [f"--gpu-architecture={arch}".encode(), b"--ptxas-options=-v"]
        opts += [f"-I{d}".encode() for d in _include_dirs()]
        _check(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), prog, f"compile for {arch}")
        (size,) = _check(nvrtc.nvrtcGetCUBINSize(prog), prog, "cubin size")
        assert size > 0
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        return log.decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _compile_one(item, arch):
    label, src, opts = item
    try:
        return label, compile_cubin(src, opts, arch), None
    except AssertionError as e:
        return label, "", str(e)


def test_nvrtc_version_is_not_newer_than_the_box_driver():
    _, major, minor = nvrtc.nvrtcVersion()
    assert (major, minor) <= (13, 0), "ship nothing built by an NVRTC newer than CUDA 13.0"


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_variant_compiles(arch):
    sources = _build.all_sources()
    assert len(sources) == len(_build.decode_variants()) + len(_build.prefill_variants()) + 3

    # NVRTC holds the GIL through cuda-bindings: compile in processes.
    with ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as ex:
        results = list(ex.map(_compile_one, sources, [arch] * len(sources)))
    failures = [f"{label}: {err}" for label, _, err in results if err]
    assert not failures, "\n".join(failures[:5])
    for label, log, _ in results:
        for spill in re.findall(r"(\d+) bytes spill stores", log):
            assert int(spill) <= MAX_SPILL_BYTES, f"{label} on {arch} spills {spill} bytes:\n{log}"


def test_a_syntax_error_fails():
    with pytest.raises(AssertionError, match="compile"):
        compile_cubin('extern "C" __global__ void k() { int x = ; }', ("-std=c++17",), "sm_90")


def test_every_sm90_prefill_module_compiles_for_sm90a():
    """The Hopper prefill (wgmma, setmaxnreg) builds for sm_90a only: every module CI lists,
    without spills, the consumers' wgmma not serialised by ptxas (its warning C7510 or C7515)."""
    sources = _build.sm90_sources()
    assert sources
    with ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as ex:
        results = list(ex.map(_compile_one, sources, [_build.SM90_ARCH] * len(sources)))
    failures = [f"{label}: {err}" for label, _, err in results if err]
    assert not failures, "\n".join(failures[:5])
    for label, log, _ in results:
        for spill in re.findall(r"(\d+) bytes spill stores", log):
            assert int(spill) <= MAX_SPILL_BYTES, f"{label} spills {spill} bytes:\n{log}"
        assert "wgmma" not in log.lower() or "serializ" not in log.lower(), f"{label}:\n{log}"
        assert "C7508" not in log, f"{label}: setmaxnreg ignored:\n{log}"
