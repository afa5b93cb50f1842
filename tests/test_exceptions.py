"""The exception hierarchy is declared once (the extension's `exceptions!` list) and every other
place that names it agrees: the extension module, its stub, `kvpool.exceptions` and `kvpool`.
Every class pickles by its public path and unpickles to the same class with its message and
attributes."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import kvpool
import kvpool._core
import kvpool.exceptions
import pytest
from kvpool.exceptions import (
    CacheInUseError,
    HostTierFullError,
    KvError,
    KvSystemError,
    OutOfBlocksError,
    WrongTierError,
)

STUB = Path(kvpool.__file__).with_name("_core.pyi")


def runtime_exceptions() -> dict[str, type]:
    """What the extension registers: every KvError class in `kvpool._core`."""
    return {
        name: value
        for name, value in vars(kvpool._core).items()
        if isinstance(value, type) and issubclass(value, KvError)
    }


def stub_exceptions() -> dict[str, str]:
    """Each exception class of `_core.pyi`, with its base's name."""
    tree = ast.parse(STUB.read_text())
    bases = {
        node.name: ast.unparse(node.bases[0])
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.bases
    }

    def is_exception(name: str) -> bool:
        base = bases.get(name)
        return base == "Exception" or (base is not None and is_exception(base))

    return {name: base for name, base in bases.items() if is_exception(name)}


def test_the_extension_stub_and_module_agree() -> None:
    runtime = runtime_exceptions()
    assert sorted(runtime) == sorted(kvpool.exceptions.__all__)
    stub = stub_exceptions()
    assert sorted(stub) == sorted(runtime)
    for name, cls in runtime.items():
        base = "Exception" if cls is KvError else cls.__bases__[0].__name__
        assert stub[name] == base, name


def test_kvpool_reexports_every_exception_as_the_same_class() -> None:
    for name in kvpool.exceptions.__all__:
        assert name in kvpool.__all__
        assert getattr(kvpool, name) is getattr(kvpool.exceptions, name)
        assert getattr(kvpool._core, name) is getattr(kvpool.exceptions, name)


@pytest.mark.parametrize("name", sorted(kvpool.exceptions.__all__))
def test_every_class_names_the_public_module(name: str) -> None:
    cls = getattr(kvpool.exceptions, name)
    assert cls.__module__ == "kvpool.exceptions" and cls.__qualname__ == name
    assert cls.__doc__, f"{name} has no docstring"


ATTRIBUTES: dict[type, dict[str, object]] = {
    OutOfBlocksError: {"requested": 9, "free": 2, "num_blocks": 8, "max_num_blocks": None},
    HostTierFullError: {"requested": 3, "free": 1, "num_blocks": 4, "max_num_blocks": None},
    WrongTierError: {"tier": "host"},
    CacheInUseError: {"in_use": 5},
    KvSystemError: {"errno": 12},
}


@pytest.mark.parametrize("name", sorted(kvpool.exceptions.__all__))
def test_every_class_round_trips_through_pickle(name: str) -> None:
    cls = getattr(kvpool.exceptions, name)
    error = cls(f"a {name}")
    for attribute, value in ATTRIBUTES.get(cls, {}).items():
        setattr(error, attribute, value)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(error, protocol=protocol))
        assert type(back) is cls
        assert back.args == (f"a {name}",) and str(back) == f"a {name}"
        assert vars(back) == vars(error)


def test_a_raised_error_round_trips_with_its_attributes() -> None:
    pool = kvpool.Pool(kvpool.KvLayout(2, 1, 16, 4), 4, device="host")
    with pytest.raises(OutOfBlocksError) as raised:
        pool.alloc_many(10)
    back = pickle.loads(pickle.dumps(raised.value))
    assert type(back) is OutOfBlocksError and str(back) == str(raised.value)
    assert (back.requested, back.free, back.num_blocks, back.max_num_blocks) == (10, 4, 4, None)
    assert b"kvpool.exceptions" in pickle.dumps(raised.value)
