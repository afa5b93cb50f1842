"""KvLayout: validation, the block-major stride formula, value semantics."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import kvpool
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvpool import KvLayout, LayoutError

ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_size")
LLAMA_8B = (32, 8, 128, 16)


def expected_strides(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, elem: int
) -> dict[str, int]:
    """`[block][layer][K|V][token][kv_head][head_dim]`, written out independently of Rust."""
    head = head_dim * elem
    token = num_kv_heads * head
    kv = block_size * token
    layer = 2 * kv
    block = num_layers * layer
    return {"block": block, "layer": layer, "kv": kv, "token": token, "head": head, "elem": elem}


# --- validation -------------------------------------------------------------------------


@pytest.mark.parametrize("field", FIELDS)
def test_zero_field_is_named_in_the_error(field: str) -> None:
    args: dict[str, Any] = dict(zip(FIELDS, LLAMA_8B, strict=True))
    args[field] = 0
    with pytest.raises(LayoutError, match=rf"\b{field}\b") as info:
        KvLayout(**args)
    assert isinstance(info.value, kvpool.KvError)
    for other in FIELDS:
        if other != field:
            assert other not in str(info.value)


@pytest.mark.parametrize("field", FIELDS)
def test_negative_field_is_rejected(field: str) -> None:
    args: dict[str, Any] = dict(zip(FIELDS, LLAMA_8B, strict=True))
    args[field] = -1
    with pytest.raises(LayoutError, match=field):
        KvLayout(**args)


def test_misaligned_block_bytes() -> None:
    # 1 layer x 2 x 1 token x 1 head x 8 dims x 2 bytes = 32 bytes: not a multiple of 256.
    with pytest.raises(LayoutError, match=r"block_bytes = 32 .*multiple of 256"):
        KvLayout(1, 1, 8, 1)
    # The same shape in float32 is 64 bytes: still misaligned.
    with pytest.raises(LayoutError, match="multiple of 256"):
        KvLayout(1, 1, 8, 1, dtype="float32")
    # 1 x 2 x 1 x 1 x 64 x 2 = 256: exactly aligned.
    assert KvLayout(1, 1, 64, 1).block_bytes == 256


def test_block_bytes_overflow() -> None:
    with pytest.raises(LayoutError, match="overflow"):
        KvLayout(2**40, 2**40, 2**40, 16)


@pytest.mark.parametrize("dtype", ["int8", "float64", "", "float16 ", "bfloat", "e5m3"])
def test_bad_dtype(dtype: str) -> None:
    with pytest.raises(LayoutError, match="unsupported dtype"):
        KvLayout(*LLAMA_8B, dtype=dtype)


def test_dtype_must_be_a_string() -> None:
    with pytest.raises(TypeError):
        KvLayout(*LLAMA_8B, dtype=2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("float16", "float16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("f2", "float16"),
        ("<f2", "float16"),
        ("FLOAT16", "float16"),
        ("bfloat16", "bfloat16"),
        ("bf16", "bfloat16"),
        ("float32", "float32"),
        ("fp32", "float32"),
        ("float", "float32"),
        ("f4", "float32"),
        ("<f4", "float32"),
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("float8_e4m3", "float8_e4m3fn"),
        ("fp8_e4m3", "float8_e4m3fn"),
        ("e4m3", "float8_e4m3fn"),
        ("fp8", "float8_e4m3fn"),
        ("float8_e5m2", "float8_e5m2"),
        ("e5m2", "float8_e5m2"),
    ],
)
def test_dtype_aliases(alias: str, canonical: str) -> None:
    layout = KvLayout(*LLAMA_8B, dtype=alias)
    assert layout.dtype == canonical
    assert layout.elem_bytes == ELEM_BYTES[canonical]
    assert layout == KvLayout(*LLAMA_8B, dtype=canonical)


def test_default_dtype_is_float16() -> None:
    assert KvLayout(*LLAMA_8B).dtype == "float16"


# --- strides --------------------------------------------------------------------------------


def test_llama_8b_numbers() -> None:
    layout = KvLayout(*LLAMA_8B)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size) == LLAMA_8B
    assert layout.block_bytes == 32 * 2 * 16 * 8 * 128 * 2 == 2 * 1024 * 1024
    assert layout.strides() == {
        "block": 2 * 1024 * 1024,
        "layer": 65536,
        "kv": 32768,
        "token": 2048,
        "head": 256,
        "elem": 2,
    }


layouts = st.builds(
    lambda nl, nh, hd, bs, dtype: (nl, nh, hd, bs, dtype),
    st.integers(1, 80),
    st.integers(1, 16),
    st.sampled_from([16, 32, 64, 80, 96, 128, 256]),
    st.sampled_from([1, 8, 16, 32, 64]),
    st.sampled_from(sorted(ELEM_BYTES)),
)


@given(layouts)
def test_strides_follow_the_block_major_formula(args: tuple[int, int, int, int, str]) -> None:
    nl, nh, hd, bs, dtype = args
    elem = ELEM_BYTES[dtype]
    block_bytes = nl * 2 * bs * nh * hd * elem
    if block_bytes % 256:
        with pytest.raises(LayoutError, match="multiple of 256"):
            KvLayout(nl, nh, hd, bs, dtype)
        return
    layout = KvLayout(nl, nh, hd, bs, dtype)
    strides = layout.strides()
    assert strides == expected_strides(nl, nh, hd, bs, elem)
    assert layout.block_bytes == block_bytes == strides["block"]
    assert layout.elem_bytes == elem
    # The last element of a block sits one element before the next block.
    last = (nl - 1) * strides["layer"] + strides["kv"] + (bs - 1) * strides["token"]
    last += (nh - 1) * strides["head"] + (hd - 1) * strides["elem"]
    assert last + elem == strides["block"]


# --- value semantics ---------------------------------------------------------------------


def test_equality_and_hash() -> None:
    a = KvLayout(*LLAMA_8B)
    b = KvLayout(*LLAMA_8B, dtype="fp16")
    c = KvLayout(*LLAMA_8B, dtype="bfloat16")
    d = KvLayout(32, 8, 128, 32)
    assert a == b and hash(a) == hash(b)
    assert a != c and a != d
    assert a != LLAMA_8B
    assert a != "KvLayout"
    assert len({a, b, c, d}) == 3
    assert {a: 1}[b] == 1


@pytest.mark.parametrize("dtype", sorted(ELEM_BYTES))
@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trip(dtype: str, protocol: int) -> None:
    layout = KvLayout(4, 2, 64, 16, dtype=dtype)
    back = pickle.loads(pickle.dumps(layout, protocol=protocol))
    assert isinstance(back, KvLayout)
    assert back == layout and hash(back) == hash(layout)
    assert back.strides() == layout.strides()


def test_copy() -> None:
    layout = KvLayout(*LLAMA_8B)
    assert copy.copy(layout) == layout
    assert copy.deepcopy(layout) == layout


def test_repr_round_trips() -> None:
    layout = KvLayout(4, 2, 64, 16, dtype="bf16")
    text = repr(layout)
    assert (
        text
        == "KvLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype='bfloat16')"
    )
    assert eval(text, {"KvLayout": KvLayout}) == layout


def test_frozen() -> None:
    layout = KvLayout(*LLAMA_8B)
    with pytest.raises(AttributeError):
        layout.num_layers = 1  # type: ignore[misc]
    assert layout.num_layers == 32


def test_layout_errors_are_kv_errors() -> None:
    assert issubclass(LayoutError, kvpool.KvError)
    assert issubclass(kvpool.KvError, Exception)
