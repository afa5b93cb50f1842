"""Storage tiers below the host tier: ``DiskTier`` (disk.py), KV blocks in a file by content
hash through NIXL's POSIX plugin, checksummed, LRU within a capacity, its index
kept across restarts if ``persistent``; ``PrefixDiskCache``
(spill.py), a pool's prefix cache over it. Needs NIXL (the ``nixl``
extra); importing this package does not load it."""

from kvpool.tier.disk import DiskIndexWarning, DiskTier
from kvpool.tier.spill import PrefixDiskCache

__all__ = ["DiskIndexWarning", "DiskTier", "PrefixDiskCache"]
