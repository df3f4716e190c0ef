"""Paged KV cache bookkeeping: block pool, prefix hashing, per-sequence block tables (torch-free)."""
from loraplex.engine.kv_cache.block_pool import BlockPool, KVBlock
from loraplex.engine.kv_cache.manager import KVCacheManager
from loraplex.engine.kv_cache.prefix_hash import BlockHash, hash_block_tokens, hash_full_blocks

__all__ = ["BlockHash", "BlockPool", "KVBlock", "KVCacheManager", "hash_block_tokens", "hash_full_blocks"]
