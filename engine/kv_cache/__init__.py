"""Paged KV cache bookkeeping: block pool, prefix hashing, per-sequence block tables, copy-on-write, the CPU swap
pool (torch-free)."""
from loraplex.engine.kv_cache.block_pool import BlockPool, KVBlock
from loraplex.engine.kv_cache.manager import KVCacheManager
from loraplex.engine.kv_cache.prefix_hash import BlockHash, hash_block_tokens, hash_full_blocks
from loraplex.engine.kv_cache.swap import PREEMPTION_MODES, SwapSpace, choose_preemption_mode

__all__ = ["BlockHash", "BlockPool", "KVBlock", "KVCacheManager", "PREEMPTION_MODES", "SwapSpace",
           "choose_preemption_mode", "hash_block_tokens", "hash_full_blocks"]
