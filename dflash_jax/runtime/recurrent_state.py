"""The target-state protocol the decoding steps thread through: a plain KV cache, or a hybrid
target's ``HybridCache`` whose linear-attention states must be rolled back after a verify pass.

A KV cache rolls back by bookkeeping (a row's length). A recurrent state cannot: the verify pass
of a hybrid target runs with ``defer=True`` (its linear states untouched, the block's record
attached) and, once each row's committed count is known, ``settle`` advances each row's states by
exactly that many tokens of the block (``models.hybrid``). Everything here runs inside the jitted
step; for a dense ``Target`` every function is the identity or its old behaviour.
"""

from __future__ import annotations

import jax

from dflash_jax.models.hybrid import HybridCache, HybridTarget
from dflash_jax.ops.cache import KVCache


def new_target_cache(target, batch: int, length: int):
    """Zeroed target decode state of ``length`` positions for ``batch`` rows."""
    if isinstance(target, HybridTarget):
        return target.new_cache(batch, length)
    tc = target.config
    return KVCache.zeros(tc.num_layers, batch, length, tc.num_kv_heads, tc.head_dim, target.embed_tokens.dtype)


def windowable(cache) -> bool:
    """Whether a step may attend to a ``read_window`` of this cache (a plain KV cache only)."""
    return isinstance(cache, KVCache)


def verify_kwargs(target) -> dict:
    """Extra ``target.step`` arguments of a verify pass: a hybrid target defers its linear states."""
    return {"defer": True} if isinstance(target, HybridTarget) else {}


def settle(target, cache, produced: jax.Array):
    """The verify pass's cache with each row advanced by its ``produced [batch]`` committed tokens
    (a KV cache as it is: entries past a row's length are never read)."""
    if isinstance(cache, HybridCache):
        return target.settle(cache, produced)
    return cache
