"""A continuous-batching scheduler on kvpool, and the contiguous-reservation baseline.

`paged_scheduler` serves requests from a kvpool.Pool through kvpool.BlockTables;
`contiguous_scheduler` reserves max_model_len tokens per request from one byte range by first
fit; `PrefixCachedKv` serves from a pool with prefix caching (requests sharing prompt tokens,
see sharing.py and traces.py). Both run the same loop (core.Scheduler) with the same policies, so their figures compare.
"""

from kvpool.scheduler.contiguous import ContiguousKv, FirstFit, contiguous_scheduler
from kvpool.scheduler.core import Scheduler, SchedulerConfig
from kvpool.scheduler.costmodel import H200, Hardware, RooflineCost
from kvpool.scheduler.metrics import StepMetrics, latency_summary, summarize
from kvpool.scheduler.paged import PagedKv, paged_scheduler
from kvpool.scheduler.policies import POLICIES, make_policy
from kvpool.scheduler.prefix import PrefixCachedKv
from kvpool.scheduler.presets import PRESETS, ModelPreset, get_preset, num_blocks_for, parse_bytes
from kvpool.scheduler.seq import Seq
from kvpool.scheduler.sharing import generate_multiturn, with_token_streams
from kvpool.scheduler.tokens import TokenStream
from kvpool.scheduler.traces import TRACE_FORMATS, read_trace
from kvpool.scheduler.workload import Request, TraceError, describe, generate, load_trace

__all__ = [
    "H200",
    "POLICIES",
    "PRESETS",
    "TRACE_FORMATS",
    "ContiguousKv",
    "FirstFit",
    "Hardware",
    "ModelPreset",
    "PagedKv",
    "PrefixCachedKv",
    "Request",
    "RooflineCost",
    "Scheduler",
    "SchedulerConfig",
    "Seq",
    "StepMetrics",
    "TokenStream",
    "TraceError",
    "contiguous_scheduler",
    "describe",
    "generate",
    "generate_multiturn",
    "get_preset",
    "latency_summary",
    "load_trace",
    "make_policy",
    "num_blocks_for",
    "paged_scheduler",
    "parse_bytes",
    "read_trace",
    "summarize",
    "with_token_streams",
]
