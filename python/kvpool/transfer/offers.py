"""Offers and answers of the transfer protocol, decoded from the untrusted peer and checked whole
before the receiver allocates anything (protocol.py runs the exchange).

Two kinds of tables make two kinds of offer through the same protocol:

- a uniform request (``BlockTables``): ``layout`` (``layout_fingerprint``), ``num_tokens`` and
  ``src_ids``, its ``ceil(num_tokens / block_size)`` block ids;
- a hybrid request (``HybridTables``): ``spec`` (``spec_fingerprint``: the page bytes, the
  layers, and every group's kind, layers, window or chunk, K/V or latent shape, dtype, state
  bytes, tokens per page and pages per slot), ``num_tokens``, ``next_query`` and ``groups``:
  per group, in the spec's order, ``{"first_page", "page_ids"}``, exactly the pages
  ``live_pages(group, num_tokens, next_query)`` names (a state group: its whole slot).

Both carry ``request_id``, ``mode``, ``chunk_blocks`` and ``timeout_s``. ``Offer.src_ids`` is
what the data phase moves: a hybrid request's pages are the groups' lists concatenated in the
spec's order, and the receiver's ids come in the same order, so page ``i`` of the offer lands
in page ``i`` of the receiver's list (every page has the pool's page bytes, whatever its
group). A decoded offer is well typed and in range, so nothing after the receiver's
allocation can fail on its contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool._core import KvError, KvLayout, ModelKvSpec
from kvpool.transfer.pieces import AUTO, MODES
from kvpool.transfer.regions import TpShard

PROTOCOL_VERSION = 1
# Block ids on the wire are int32 (what the pool's tables and the movers use).
_INT32_MAX = 2**31 - 1
# Token counts the core takes (`ids::tokens`: at most i64::MAX).
_TOKENS_MAX = 2**63 - 1
# The fields of a KvGroup that a hybrid offer carries, as KvGroup names them.
_GROUP_FIELDS = (
    "kind",
    "layers",
    "window",
    "chunk",
    "num_kv_heads",
    "head_dim",
    "latent_dim",
    "rope_dim",
    "dtype",
    "bytes_per_layer",
    "token_bytes",
)


@dataclass(frozen=True)
class Offer:
    """A decoded, checked offer: every field of the right type and in range."""

    request_id: int
    num_tokens: int
    src_ids: np.ndarray  # int32; a hybrid request's groups concatenated in the spec's order
    mode: str
    chunk_blocks: int
    # The sender's timeout: the receiver's lease ends no later than it, so a READ it sees
    # complete before its own deadline read blocks the sender still held (transfer.md).
    timeout_s: float | None = None
    # Hybrid offers only: the first query still to run, and per group (first_page, pages),
    # in the spec's order: `src_ids` holds group 0's pages first.
    next_query: int | None = None
    group_pages: tuple[tuple[int, int], ...] = ()
    # Uniform offers only. Layer by layer: the layers ready at the offer (the sender announces
    # more with `layers_ready` messages); None: every layer is ready.
    layers_ready: int | None = None
    # The sender's tensor-parallel shard (rank 0 of 1 when the offer names none) and its
    # pool's layout (its own heads: the strides the receiver's descriptors address).
    tp: TpShard | None = None
    sender_layout: KvLayout | None = None
    # The request lands only once the sender commits (a request split over several receivers:
    # none keeps its part unless every part was read).
    commit: bool = False
    # NIXL: the sender packed the request's blocks, in order, into its staging buffer from
    # this block on (nixl_staging.py); None: they are read where they lie.
    staged_at: int | None = None


def layout_fingerprint(layout: KvLayout) -> dict:
    """What two pools must share for a block to mean the same bytes on both."""
    return {
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "block_size": layout.block_size,
        "dtype": layout.dtype,
        "block_bytes": layout.block_bytes,
    }


def layout_mismatch(sender: dict, receiver: dict) -> str | None:
    """Why two fingerprints differ (every differing field), or None."""
    diffs = [
        f"{k} {sender.get(k)!r} (sender) != {receiver[k]!r} (receiver)"
        for k in receiver
        if sender.get(k) != receiver[k]
    ]
    return "layout mismatch: " + ", ".join(diffs) if diffs else None


def spec_fingerprint(spec: ModelKvSpec) -> dict:
    """What two hybrid pools must share for a page of each group to mean the same bytes on
    both: the page bytes, the layers and every group (in JSON's types)."""
    groups = []
    for index, group in enumerate(spec.groups):
        fields = {name: getattr(group, name) for name in _GROUP_FIELDS}
        fields["layers"] = list(fields["layers"])  # JSON has no tuples
        fields["block_size"] = spec.block_size(index)
        fields["pages_per_slot"] = spec.pages_per_slot(index)
        groups.append(fields)
    return {"page_bytes": spec.page_bytes, "num_layers": spec.num_layers, "groups": groups}


def spec_mismatch(sender: dict, receiver: dict) -> str | None:
    """Why a sender's spec fingerprint differs from the receiver's (every differing field,
    each group's named by its index), or None."""
    diffs = [
        f"{k} {sender.get(k)!r} (sender) != {receiver[k]!r} (receiver)"
        for k in ("page_bytes", "num_layers")
        if sender.get(k) != receiver[k]
    ]
    groups, want = sender.get("groups"), receiver["groups"]
    if not isinstance(groups, list):
        diffs.append(f"groups of type {type(groups).__name__} (sender), a list (receiver)")
    elif len(groups) != len(want):
        diffs.append(f"num_groups {len(groups)} (sender) != {len(want)} (receiver)")
    else:
        for index, (theirs, ours) in enumerate(zip(groups, want)):
            if not isinstance(theirs, dict):
                diffs.append(f"group {index} of type {type(theirs).__name__} (sender)")
                continue
            diffs += [
                f"group {index} {k} {theirs.get(k)!r} (sender) != {ours[k]!r} (receiver)"
                for k in ours
                if theirs.get(k) != ours[k]
            ]
    return "spec mismatch: " + ", ".join(diffs) if diffs else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _header_problem(message: Any) -> str | None:
    if not isinstance(message, dict):
        return f"an offer must be a message object, not {type(message).__name__}"
    if message.get("kind") != "offer" or message.get("version") != PROTOCOL_VERSION:
        return f"not an offer of protocol version {PROTOCOL_VERSION}: {message.get('kind')!r}"
    return None


@dataclass(frozen=True)
class _Terms:
    """The fields every offer carries, checked."""

    request_id: int
    mode: str
    chunk_blocks: int
    timeout_s: float | None
    staged_at: int | None


def _terms(fields: dict) -> _Terms | str:
    request_id: Any = fields.get("request_id")
    if not _is_int(request_id) or not 0 <= request_id < 2**64:
        return f"request_id must be an unsigned 64-bit int, got {request_id!r}"
    mode = fields.get("mode")
    if not isinstance(mode, str) or mode not in (*MODES, AUTO):
        return f"unknown mode {mode!r}"
    chunk_blocks: Any = fields.get("chunk_blocks")
    if not _is_int(chunk_blocks) or not 1 <= chunk_blocks <= _INT32_MAX:
        return "chunk_blocks must be a positive int"
    timeout_s: Any = fields.get("timeout_s")
    if timeout_s is not None and (
        not isinstance(timeout_s, (int, float))
        or isinstance(timeout_s, bool)
        or not 0 < timeout_s < float("inf")
    ):
        return f"timeout_s must be a positive number of seconds, got {timeout_s!r}"
    staged_at: Any = fields.get("staged_at")
    if staged_at is not None and not (_is_int(staged_at) and 0 <= staged_at <= _INT32_MAX):
        return f"staged_at must be an int32 block offset >= 0, got {staged_at!r}"
    return _Terms(
        request_id,
        mode,
        chunk_blocks,
        None if timeout_s is None else float(timeout_s),
        staged_at,
    )


def _ids_problem(ids: list, what: str) -> str | None:
    """Why ``ids`` are not int32 block ids >= 0, or None."""
    for block in ids:
        if not (_is_int(block) and 0 <= block <= _INT32_MAX):
            return f"{what} must be int32 block ids >= 0, got {block!r}"
    return None


def decode_offer(
    message: Any, layout: KvLayout, tp: TpShard | None = None, gather: bool = False
) -> Offer | str:
    """The uniform offer in ``message`` (from the untrusted peer), or why it cannot be
    accepted by tables of ``layout`` (a pool that is tensor-parallel shard ``tp``: the
    offer's shard must be of the same model, see ``_sender_shard``, and hold every head the
    receiver needs, or with ``gather`` some of them). Checks everything the receiver will use, so nothing past
    this point can fail on the offer's contents after blocks were allocated."""
    header = _header_problem(message)
    if header is not None:
        return header
    fields: dict[str, Any] = message
    sender_layout = fields.get("layout")
    if not isinstance(sender_layout, dict):
        if "spec" in fields:
            return (
                "the offer is of a hybrid model (a spec of groups); this receiver's tables "
                "are uniform BlockTables"
            )
        return "the offer's layout must be an object"
    shard = _sender_shard(fields, sender_layout, layout, tp)
    if isinstance(shard, str):
        return shard
    cover = tp_cover_problem(shard, tp or TpShard(0, 1, layout.num_kv_heads), gather)
    if cover is not None:
        return cover
    terms = _terms(fields)
    if isinstance(terms, str):
        return terms
    num_tokens: Any = fields.get("num_tokens")
    src_ids = fields.get("src_ids")
    if not _is_int(num_tokens) or num_tokens < 0 or not isinstance(src_ids, list):
        return f"bad offer: num_tokens {num_tokens!r}, src_ids of type {type(src_ids).__name__}"
    if len(src_ids) != -(-num_tokens // layout.block_size):
        return f"{len(src_ids)} blocks offered for {num_tokens} tokens"
    problem = _ids_problem(src_ids, "src_ids")
    if problem is not None:
        return problem
    if len(set(src_ids)) != len(src_ids):
        return "src_ids repeat a block"
    layers_ready: Any = fields.get("layers_ready")
    if layers_ready is not None and not (
        _is_int(layers_ready) and 0 <= layers_ready <= layout.num_layers
    ):
        return f"layers_ready must be an int in 0..{layout.num_layers}, got {layers_ready!r}"
    commit = fields.get("commit", False)
    if not isinstance(commit, bool):
        return f"commit must be a bool, got {commit!r}"
    return Offer(
        terms.request_id,
        num_tokens,
        np.asarray(src_ids, np.int32),
        terms.mode,
        terms.chunk_blocks,
        terms.timeout_s,
        layers_ready=layers_ready,
        tp=shard,
        sender_layout=KvLayout(
            layout.num_layers, shard.num_heads, layout.head_dim, layout.block_size, layout.dtype
        ),
        commit=commit,
        staged_at=terms.staged_at,
    )


def _sender_shard(
    fields: dict, sender_layout: dict, layout: KvLayout, tp: TpShard | None
) -> TpShard | str:
    """The sender's TP shard from an offer (rank 0 of 1 when it names none), checked against
    this receiver's pool (``layout``, shard ``tp``: rank 0 of 1 when None): the same model, the
    heads the shard's rank holds, and heads the receiver needs (every other field of the two
    layouts equal). Why not, naming every differing field, or the shard."""
    wire = fields.get("tp")
    if wire is None and (tp is None or tp.size == 1):  # no TP on either side: one layout
        mismatch = layout_mismatch(sender_layout, layout_fingerprint(layout))
        if mismatch:
            return mismatch
        return TpShard(0, 1, layout.num_kv_heads)
    mine = tp or TpShard(0, 1, layout.num_kv_heads)
    ours = layout_fingerprint(layout)
    diffs = [
        f"{k} {sender_layout.get(k)!r} (sender) != {ours[k]!r} (receiver)"
        for k in ("num_layers", "head_dim", "block_size", "dtype")
        if sender_layout.get(k) != ours[k]
    ]
    if diffs:
        return "layout mismatch: " + ", ".join(diffs)
    if wire is None:
        wire = {"rank": 0, "size": 1, "num_kv_heads": sender_layout.get("num_kv_heads")}
        wire["heads"] = [0, wire["num_kv_heads"]]
    if not isinstance(wire, dict):
        return f"the offer's tp must be an object, not {type(wire).__name__}"
    rank: Any = wire.get("rank")
    size: Any = wire.get("size")
    model_heads: Any = wire.get("num_kv_heads")
    heads = wire.get("heads")
    if not (_is_int(rank) and _is_int(size) and _is_int(model_heads) and 0 <= rank < size):
        return f"bad tp in the offer: {wire!r}"
    if model_heads != mine.num_kv_heads:
        return (
            f"tp mismatch: the model has {model_heads!r} KV heads (sender) != "
            f"{mine.num_kv_heads} (receiver)"
        )
    shard = TpShard(rank, size, model_heads)
    if model_heads % size or sender_layout.get("num_kv_heads") != shard.num_heads:
        return (
            f"tp mismatch: rank {rank} of {size} over {model_heads} KV heads holds "
            f"{model_heads // size if model_heads % size == 0 else 'no whole number of'} heads; "
            f"the sender's pool has {sender_layout.get('num_kv_heads')!r}"
        )
    if heads != list(shard.heads):
        return f"tp mismatch: rank {rank} of {size} holds heads {list(shard.heads)}, the offer says {heads!r}"
    if sender_layout.get("block_bytes") != layout.block_bytes // mine.num_heads * shard.num_heads:
        return f"layout mismatch: block_bytes {sender_layout.get('block_bytes')!r} for {shard.num_heads} heads"
    return shard


def tp_cover_problem(sender: TpShard, receiver: TpShard, gather: bool) -> str | None:
    """Why a receiver holding ``receiver``'s heads cannot take a leg of ``sender``'s (one
    sender must hold every head it needs; a gather leg must hold some of them), or None."""
    lo, hi = max(sender.heads[0], receiver.heads[0]), min(sender.heads[1], receiver.heads[1])
    if gather and lo < hi:
        return None
    if not gather and (lo, hi) == receiver.heads:
        return None
    return (
        f"tp mismatch: this receiver (rank {receiver.rank} of {receiver.size}) needs heads "
        f"{list(receiver.heads)}; the sender (rank {sender.rank} of {sender.size}) holds "
        f"{list(sender.heads)}"
        + ("" if gather else ": gather every sender rank's heads with TpGatherReceiver")
    )


def kept_pages(spec: ModelKvSpec, group: int, num_tokens: int, next_query: int) -> range | str:
    """The page indices group ``group`` of a request of ``num_tokens`` tokens whose queries
    from ``next_query`` on are still to run holds (a state group: its slot), or why the core
    cannot say (a count out of its range)."""
    try:
        if spec.block_size(group) is None:
            return range(int(spec.pages_per_slot(group) or 0))
        start, end = spec.live_pages(group, num_tokens, next_query)
    except KvError as e:
        return f"{type(e).__name__}: {e}"
    return range(start, end)


def _group_pages(entry: Any, index: int, want: range) -> tuple[int, list] | str:
    """Group ``index``'s ``(first_page, page_ids)`` from the offer, checked against the pages
    the receiver's spec says it holds (``want``), or why not."""
    if not isinstance(entry, dict):
        return f"group {index}'s pages must be an object, not {type(entry).__name__}"
    first_page: Any = entry.get("first_page")
    page_ids = entry.get("page_ids")
    if not _is_int(first_page) or not isinstance(page_ids, list):
        return (
            f"group {index}: first_page {first_page!r}, page_ids of type {type(page_ids).__name__}"
        )
    if first_page != want.start or len(page_ids) != len(want):
        return (
            f"group {index}: {len(page_ids)} pages from page {first_page} offered; the spec "
            f"keeps pages {want.start}..{want.stop} of this request"
        )
    problem = _ids_problem(page_ids, f"group {index}'s page_ids")
    if problem is not None:
        return problem
    return first_page, page_ids


def decode_hybrid_offer(
    message: Any, spec: ModelKvSpec, fingerprint: dict | None = None
) -> Offer | str:
    """The hybrid offer in ``message`` (from the untrusted peer), or why tables of ``spec``
    (whose ``spec_fingerprint`` may be given, to spare computing it) cannot accept it. Every
    group's pages are checked against what the spec keeps for the offer's ``num_tokens`` and
    ``next_query``, before anything is allocated."""
    header = _header_problem(message)
    if header is not None:
        return header
    fields: dict[str, Any] = message
    sender_spec = fields.get("spec")
    if not isinstance(sender_spec, dict):
        if "layout" in fields:
            return (
                "the offer is of a uniform layout (one block list); this receiver's tables "
                "are HybridTables"
            )
        return "the offer's spec must be an object"
    mismatch = spec_mismatch(sender_spec, fingerprint or spec_fingerprint(spec))
    if mismatch:
        return mismatch
    terms = _terms(fields)
    if isinstance(terms, str):
        return terms
    num_tokens: Any = fields.get("num_tokens")
    next_query: Any = fields.get("next_query")
    if not (_is_int(num_tokens) and _is_int(next_query) and 0 <= next_query <= num_tokens):
        return (
            f"bad offer: num_tokens {num_tokens!r} and next_query {next_query!r} must be ints "
            "with 0 <= next_query <= num_tokens"
        )
    if num_tokens > _TOKENS_MAX:
        return f"num_tokens {num_tokens} is out of range (at most {_TOKENS_MAX})"
    groups = fields.get("groups")
    if not isinstance(groups, list) or len(groups) != spec.num_groups:
        count = len(groups) if isinstance(groups, list) else type(groups).__name__
        return f"the offer's groups must be a list of {spec.num_groups} entries, got {count}"
    src_ids: list = []
    group_pages = []
    for index, entry in enumerate(groups):
        want = kept_pages(spec, index, num_tokens, next_query)
        if isinstance(want, str):
            return f"group {index}: {want}"
        pages = _group_pages(entry, index, want)
        if isinstance(pages, str):
            return pages
        group_pages.append((pages[0], len(pages[1])))
        src_ids += pages[1]
    if len(set(src_ids)) != len(src_ids):
        return "the offer's page_ids repeat a page (within a group or across groups)"
    return Offer(
        terms.request_id,
        num_tokens,
        np.asarray(src_ids, np.int32),
        terms.mode,
        terms.chunk_blocks,
        terms.timeout_s,
        next_query,
        tuple(group_pages),
        staged_at=terms.staged_at,
    )


def decode_accept(message: Any, request_id: int, num_blocks: int) -> tuple[np.ndarray, str] | str:
    """The receiver's ``(dst_ids, mode)`` from its accept, or why the answer is unusable."""
    if not isinstance(message, dict):
        return f"an answer must be a message object, not {type(message).__name__}"
    if message.get("kind") == "refuse":
        return f"the receiver refused request {request_id}: {message.get('reason')}"
    if message.get("kind") != "accept" or message.get("request_id") != request_id:
        return f"unexpected answer to request {request_id}: {message}"
    dst_ids, mode = message.get("dst_ids"), message.get("mode")
    if (
        mode not in MODES
        or not isinstance(dst_ids, list)
        or len(dst_ids) != num_blocks
        or not all(_is_int(b) and 0 <= b <= _INT32_MAX for b in dst_ids)
    ):
        count = len(dst_ids) if isinstance(dst_ids, list) else dst_ids
        return (
            f"unexpected answer to request {request_id}: mode {mode!r}, "
            f"{count!r} blocks for {num_blocks}"
        )
    return np.asarray(dst_ids, np.int32), mode


def expected_rows(group_pages: Sequence[tuple[int, int]]) -> list[list[int]]:
    """``(group, page_index)`` of every page of an offer, in its order: what the receiver's
    ``request_pages`` must list after it added the request."""
    return [
        [group, first + i] for group, (first, count) in enumerate(group_pages) for i in range(count)
    ]
