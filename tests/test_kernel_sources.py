"""The installed package carries its kernel sources (embedded in the extension at build time),
and KVPOOL_CUDA_DIR switches to a source folder for kernel development."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvpool import _core
from kvpool.kernels import _build

REPO_CUDA = Path(__file__).resolve().parent.parent / "cuda"


@pytest.fixture
def fresh_sources(monkeypatch):
    """read_source caches per process; every test here starts and ends with an empty cache."""
    monkeypatch.delenv(_build.SOURCE_DIR_ENV, raising=False)
    _build.read_source.cache_clear()
    yield monkeypatch
    _build.read_source.cache_clear()


def test_embedded_sources_are_the_repository_files():
    embedded = _core.kernel_sources()
    on_disk = {p.name: p.read_text() for p in REPO_CUDA.iterdir() if p.suffix in (".cu", ".cuh")}
    assert embedded == on_disk


def test_every_module_the_library_compiles_reads_embedded_sources(fresh_sources):
    for label, source, _ in _build.all_sources():
        assert not _build.INCLUDE.search(source), f"{label}: an include was left for NVRTC"
        assert 'extern "C" __global__' in source, label


def test_source_dir_override(fresh_sources, tmp_path):
    (tmp_path / "append_kv.cu").write_text('#include "x.cuh"\nbody\n')
    (tmp_path / "x.cuh").write_text("inlined header")
    fresh_sources.setenv(_build.SOURCE_DIR_ENV, str(tmp_path))
    assert _build.read_source("append_kv.cu") == "inlined header\nbody\n"
    with pytest.raises(FileNotFoundError, match="copy_blocks.cu"):
        _build.read_source("copy_blocks.cu")


def test_unknown_source_names_what_the_build_has(fresh_sources):
    with pytest.raises(FileNotFoundError, match="append_kv.cu"):
        _build.read_source("no_such_kernel.cu")
