"""The host-tier options of `kvpool simulate`: parsing, checks and the HostTierSpec they give.

`--cpu-kv-memory SIZE` adds a third run: the paged scheduler preempting into a host tier of
SIZE bytes (the model's blocks), by swap or by recompute as `--preemption` says (auto: the
cheaper one per victim). The other options of this group need it.
"""

from __future__ import annotations

import argparse
import math

import kvpool
from kvpool.scheduler.preemption import PREEMPTION_MODES, HostLink
from kvpool.scheduler.swap import HostTierSpec
from kvpool.sim.presets import parse_bytes

DEFAULT_LINK = HostLink()
OPTIONS = ("preemption", "host_link_gbps", "host_link_latency_us")


# Link and transfer figures are bounded so that modelled times stay in seconds a float
# resolves: a 1e-300 GB/s link, or a 1e300 us fixed cost, reported latencies of 1e300 s.
MIN_GBPS, MAX_GBPS = 1e-3, 1e6  # 1 MB/s to 1 PB/s
MAX_LATENCY_US = 1e6  # one second per call


def finite_in(minimum: float, maximum: float, *, inclusive: bool = True):
    """An argparse type: a float in [minimum, maximum] ((minimum, maximum] without `inclusive`)."""
    sign = ">=" if inclusive else ">"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        low_ok = value >= minimum if inclusive else value > minimum
        if not (low_ok and value <= maximum):  # also refuses nan and inf
            raise argparse.ArgumentTypeError(
                f"must be a finite number {sign} {minimum:g} and <= {maximum:g}, got {text!r}"
            )
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    h = parser.add_argument_group(
        "host tier", "preemption by swap into host memory (needs --cpu-kv-memory)"
    )
    h.add_argument(
        "--cpu-kv-memory",
        default=None,
        help="host tier size, units as --kv-memory; adds a run of paged with the tier, "
        "compared with paged recompute-only",
    )
    h.add_argument(
        "--preemption",
        default=None,
        choices=PREEMPTION_MODES,
        help="how the tier run preempts: auto (per victim, the cheaper of swap and "
        "recompute), swap or recompute (default: auto)",
    )
    h.add_argument(
        "--host-link-gbps",
        type=finite_in(MIN_GBPS, MAX_GBPS),
        default=None,
        help=f"host <-> GPU copy bandwidth each way, GB/s (default: "
        f"{DEFAULT_LINK.bytes_per_s / 1e9:g}, a pinned 1 GiB copy on an H200)",
    )
    h.add_argument(
        "--host-link-latency-us",
        type=finite_in(0, MAX_LATENCY_US),
        default=None,
        help=f"fixed cost of one swap call, us (default: {DEFAULT_LINK.latency_s * 1e6:g})",
    )


def check_options(args: argparse.Namespace) -> str | None:
    """Why the host-tier options do not go together, or None."""
    given = [o for o in OPTIONS if getattr(args, o) is not None]
    if given and args.cpu_kv_memory is None:
        return f"{', '.join('--' + o.replace('_', '-') for o in given)} need --cpu-kv-memory"
    if args.cpu_kv_memory is not None and args.disaggregated:
        return "--cpu-kv-memory cannot be used with --disaggregated (it has no host tier model)"
    return None


def check_values(args: argparse.Namespace, block_bytes: int) -> str | None:
    """Why --cpu-kv-memory does not hold a number of blocks of `block_bytes`, or None."""
    if args.cpu_kv_memory is None:
        return None
    try:
        memory = parse_bytes(args.cpu_kv_memory)
    except ValueError as e:
        return f"--cpu-kv-memory: {e}"
    if not 1 <= memory // block_bytes <= kvpool.MAX_NUM_BLOCKS:
        return (
            f"--cpu-kv-memory must hold 1 to {kvpool.MAX_NUM_BLOCKS} blocks of {block_bytes} bytes, "
            f"i.e. {block_bytes} to {kvpool.MAX_NUM_BLOCKS * block_bytes} bytes; got {memory}"
        )
    return None


def spec(args: argparse.Namespace) -> HostTierSpec | None:
    """The host tier the checked options ask for, or None."""
    if args.cpu_kv_memory is None:
        return None
    link = HostLink(
        DEFAULT_LINK.bytes_per_s if args.host_link_gbps is None else args.host_link_gbps * 1e9,
        DEFAULT_LINK.latency_s
        if args.host_link_latency_us is None
        else args.host_link_latency_us * 1e-6,
    )
    return HostTierSpec(parse_bytes(args.cpu_kv_memory), args.preemption or "auto", link)
