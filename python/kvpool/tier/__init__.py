"""Storage tiers below the host tier: ``DiskTier`` (disk.py), KV blocks in a file by content
hash through NIXL's POSIX plugin, checksummed, LRU within a capacity. Needs NIXL (the ``nixl``
extra); importing this package does not load it."""

from kvpool.tier.disk import DiskTier

__all__ = ["DiskTier"]
