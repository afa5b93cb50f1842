"""A continuous-batching scheduler on kvpool, and the contiguous-reservation baseline.

`paged_scheduler` serves requests from a kvpool.Pool through kvpool.BlockTables;
`contiguous_scheduler` reserves max_model_len tokens per request from one byte range by first
fit; `PrefixCachedKv` serves from a pool with prefix caching (requests that bring their token
ids, `Request.tokens`); `HybridKv` serves a hybrid model (a `kvpool.ModelKvSpec` of several
KV groups) through `kvpool.HybridTables`. All run the same loop (core.Scheduler) with the same policies, so
their figures compare. The simulator that drives them with workloads and a cost model is
kvpool.sim; this package does not depend on it.
"""

from kvpool.scheduler.contiguous import ContiguousKv, FirstFit, contiguous_scheduler
from kvpool.scheduler.core import Scheduler, SchedulerConfig
from kvpool.scheduler.hybrid import HybridKv
from kvpool.scheduler.metrics import StepMetrics, latency_summary, summarize
from kvpool.scheduler.paged import PagedKv, paged_scheduler
from kvpool.scheduler.policies import POLICIES, make_policy
from kvpool.scheduler.prefix import PrefixCachedKv
from kvpool.scheduler.request import Request, TokenIds
from kvpool.scheduler.seq import Seq

__all__ = [
    "POLICIES",
    "ContiguousKv",
    "FirstFit",
    "HybridKv",
    "PagedKv",
    "PrefixCachedKv",
    "Request",
    "Scheduler",
    "SchedulerConfig",
    "Seq",
    "StepMetrics",
    "TokenIds",
    "contiguous_scheduler",
    "latency_summary",
    "make_policy",
    "paged_scheduler",
    "summarize",
]
