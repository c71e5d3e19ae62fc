"""Continuous batching over a paged KV cache with prefix caching (see docs/BATCHING.md)."""
from .blocks import BlockPool, KVCacheManager
from .engine import BatchConfig, BatchEngine, Handle, PoolTooSmall

__all__ = ["BatchConfig", "BatchEngine", "BlockPool", "Handle", "KVCacheManager", "PoolTooSmall"]
