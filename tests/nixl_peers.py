"""What the two-process NIXL tests share (tests/test_nixl_faults.py, test_nixl_gpu.py,
test_nixl_growable.py, test_nixl_hybrid.py, test_nixl_layers.py, test_nixl_tp.py): each test
file, run as a script, is the other side (the peer) of its tests, reached over loopback through
NIXL/UCX.

- Importing this module loads NIXL or skips the importing test module (tests/nixl_required.py).
- ``spawn(script, *args, tmp_path=...)`` starts ``script`` as the peer with its arguments and
  one rendezvous file a leg (``legs``), and yields a ``Peer``: the process, the rendezvous
  files, ``connect`` (this side's transport of a leg, closed when the block ends) and
  ``finish`` (the peer's ``RESULT {json}`` line, once it exits with 0). On leaving, every
  transport is closed, the peer killed if still running and waited for, its pipes closed.
- ``run_ranks(rank_fn, rendezvous)``: the ranks of a TP-2 group as threads of the peer, each
  ``rank_fn(rank, rendezvous[rank], report)``; their reports as ``{"ranks": [...]}``.
- ``STAGE_ALWAYS``: ``StagingCost`` that stages every request of more than one run.
- ``conserved``: a side's pool invariant (free + evictable + used + in_flight == total), no
  lease left, and every block back where it was.
- ``fill(pool, tables, rid, num_tokens)``: adds request ``rid`` and fills its blocks with
  values seeded by ``rid``; ``request_bytes(pool, tables, rid)``: its bytes, layer by layer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kvpool
import numpy as np
from kvpool.transfer.nixl_staging import StagingCost
from nixl_required import NixlTransport

__all__ = [
    "PEER_WAIT_S",
    "STAGE_ALWAYS",
    "NixlTransport",
    "Peer",
    "conserved",
    "fill",
    "request_bytes",
    "run_ranks",
    "spawn",
]

PEER_WAIT_S = 30.0  # a bound on every wait if a side breaks, never reached
# Staging costs that stage every request of more than one run: for tests of the staging
# mechanism, whose few blocks would not pay by the default costs (tests/test_nixl_staging.py
# checks those).
STAGE_ALWAYS = StagingCost(descriptor_s=1.0, fixed_s=0.0)


class Peer:
    """The other side's process and its rendezvous files (one a leg)."""

    def __init__(self, process: subprocess.Popen | None, rendezvous: list[Path]) -> None:
        # ``process`` None: a peer in a thread of this process (tests/test_nixl_gpu.py).
        self.process, self.rendezvous = process, rendezvous
        self.output = ""
        self.transports: list[NixlTransport] = []

    def connect(
        self, pool: Any, cls: type[NixlTransport] = NixlTransport, *, leg: int = 0, **options: Any
    ) -> Any:
        """This side's transport (agent 1; the peer is agent 0) of ``leg``, closed when the
        ``spawn`` block ends; ``options`` go to ``connect`` (``staging_bytes``)."""
        transport = cls.connect(1, self.rendezvous[leg], pool, timeout=PEER_WAIT_S, **options)
        self.transports.append(transport)
        return transport

    def finish(self, timeout: float = PEER_WAIT_S) -> dict:
        """Waits (``timeout``) for the peer to exit and returns its last ``RESULT {json}``."""
        assert self.process is not None
        self.output, _ = self.process.communicate(timeout=timeout)
        lines = [x for x in self.output.splitlines() if x.startswith("RESULT ")]
        assert self.process.returncode == 0 and lines, self.output
        return json.loads(lines[-1][len("RESULT ") :])


@contextmanager
def spawn(
    script: str,
    *args: str,
    tmp_path: Path,
    legs: int = 1,
    stdin: bool = False,
    peer_class: type[Peer] = Peer,
) -> Iterator[Any]:
    """Runs ``python script *args rendezvous...`` as the peer (``stdin``: with a pipe to
    drive it line by line); yields a ``peer_class`` over it. Its output (stdout and stderr)
    is one pipe."""
    rendezvous = [tmp_path / f"rendezvous{leg}.json" for leg in range(legs)]
    process = subprocess.Popen(
        [sys.executable, script, *args, *map(str, rendezvous)],
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    other = peer_class(process, rendezvous)
    try:
        yield other
    finally:
        for transport in other.transports:
            transport.close()
        if process.poll() is None:
            process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()


def run_ranks(rank_fn: Callable[[int, str, dict], None], rendezvous: list[str]) -> dict:
    """Runs ``rank_fn(rank, rendezvous[rank], report)`` for ranks 0 and 1, each in a thread
    (the two ranks of a TP-2 group, each with its own pool and transport); joins them."""
    reports: list[dict] = [{}, {}]
    threads = [
        threading.Thread(target=rank_fn, args=(rank, rendezvous[rank], reports[rank]))
        for rank in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"ranks": reports}


def conserved(side: Any, pool: Any, free_before: int) -> None:
    """Both pools' invariant (leases.py), no lease left, every block back where it was."""
    side.check_invariants()
    assert side.leases.live() == [] and side.leases.in_flight == 0
    assert pool.num_free == free_before, (pool.num_free, free_before)


def fill(pool: kvpool.Pool, tables: kvpool.BlockTables, rid: int, num_tokens: int) -> None:
    """Adds request ``rid`` of ``num_tokens`` and fills its K and V blocks of every layer with
    values seeded by ``rid``: the same bytes on either side for the same request."""
    tables.add(rid, num_tokens)
    rng = np.random.default_rng(rid)
    ids = tables.blocks(rid)
    for layer in range(pool.layout.num_layers):
        for view in (pool.k_view(layer), pool.v_view(layer)):
            view[ids] = rng.standard_normal(view[ids].shape).astype(view.dtype)


def request_bytes(pool: kvpool.Pool, tables: kvpool.BlockTables, rid: int) -> list[bytes]:
    """Request ``rid``'s bytes, K then V of each layer."""
    ids = tables.blocks(rid)
    return [
        view[ids].tobytes()
        for layer in range(pool.layout.num_layers)
        for view in (pool.k_view(layer), pool.v_view(layer))
    ]
