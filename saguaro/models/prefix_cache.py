"""Prefix caching: KV entries of prompts already run, reused by later prompts that start the same way.

The KV cache (kv_cache.py) gives each sequence a row of its own, so reuse is a copy: a prompt's
KV entries are kept in blocks of `block_size` tokens, each block keyed by a digest of every
token up to its end (so a block only matches after the same whole prefix, as in vLLM's
automatic prefix caching), and a new prompt's row gets the blocks of its longest cached prefix
copied in before the rest of the prompt runs. Blocks are evicted least recently used first,
deepest first, under a byte budget.

With batch-invariant kernels a token's KV entries do not depend on which pass computed them,
so a sequence decodes the same tokens with or without a hit.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from saguaro.models.kv_cache import KVCache

BLOCK_SIZE = 16


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompts looked up
    query_tokens: int = 0  # their tokens
    hit_tokens: int = 0  # tokens whose KV entries were copied in instead of computed
    evicted_blocks: int = 0


def new_prefix_cache(budget_mb: float) -> PrefixCache | None:
    """A prefix cache of budget_mb MiB; None for 0 (prefix caching off)."""
    return PrefixCache(int(budget_mb * 2 ** 20)) if budget_mb else None


class PrefixCache:
    def __init__(self, budget_bytes: int, block_size: int = BLOCK_SIZE):
        if budget_bytes < 0 or block_size < 1:
            raise ValueError("the prefix cache needs a budget >= 0 bytes and a block size >= 1")
        self.budget_bytes, self.block_size = budget_bytes, block_size
        self.blocks: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()  # LRU first
        self.bytes = 0
        self.stats = PrefixCacheStats()

    def block_keys(self, tokens: list[int]) -> list[bytes]:
        """One digest per full block of tokens, each covering the whole prefix up to its end."""
        keys, digest = [], b""
        for end in range(self.block_size, len(tokens) + 1, self.block_size):
            block = array("q", tokens[end - self.block_size:end]).tobytes()
            digest = hashlib.blake2b(digest + block, digest_size=16).digest()
            keys.append(digest)
        return keys

    def cached_blocks(self, tokens: list[int]) -> int:
        """Full blocks of `tokens`, from the start, that are cached (without touching them)."""
        n = 0
        for key in self.block_keys(tokens):
            if key not in self.blocks:
                break
            n += 1
        return n

    def restore(self, cache: KVCache, row: int, tokens: list[int]) -> int:
        """Copies the KV entries of the longest cached prefix of tokens[:-1] into slots 0.. of
        `row` (the last token is always run: its hidden state gives the next token). Returns
        how many tokens were restored."""
        keys = self.block_keys(tokens[:-1])[:self.cached_blocks(tokens[:-1])]
        self.stats.queries += 1
        self.stats.query_tokens += len(tokens)
        if not keys:
            return 0
        self._touch(keys)
        n = len(keys) * self.block_size
        cache.keys[:, row, :, :n] = torch.cat([self.blocks[key][0] for key in keys], dim=2)
        cache.values[:, row, :, :n] = torch.cat([self.blocks[key][1] for key in keys], dim=2)
        self.stats.hit_tokens += n
        return n

    def store(self, cache: KVCache, row: int, tokens: list[int]) -> None:
        """Keeps the KV entries of the full blocks of `tokens`, which `row` holds in slots 0.."""
        if self.budget_bytes == 0:
            return
        keys = self.block_keys(tokens)
        for i, key in enumerate(keys):
            if key in self.blocks:
                continue
            slots = slice(i * self.block_size, (i + 1) * self.block_size)
            block = (cache.keys[:, row, :, slots].clone(), cache.values[:, row, :, slots].clone())
            self.blocks[key] = block
            self.bytes += 2 * block[0].numel() * block[0].element_size()
        self._touch(keys)
        while self.bytes > self.budget_bytes and self.blocks:
            _, (k, v) = self.blocks.popitem(last=False)
            self.bytes -= k.numel() * k.element_size() + v.numel() * v.element_size()
            self.stats.evicted_blocks += 1

    def _touch(self, keys: list[bytes]) -> None:
        """Marks a prefix's blocks used, its deepest block least recently: a block is never
        evicted before the blocks that extend it."""
        for key in reversed(keys):
            self.blocks.move_to_end(key)

    def summary(self) -> dict:
        s = self.stats
        return {"prefix_cache_queries": s.queries, "prefix_cache_query_tokens": s.query_tokens,
                "prefix_cache_hit_tokens": s.hit_tokens,
                "prefix_cache_hit_rate": s.hit_tokens / s.query_tokens if s.query_tokens else 0.0,
                "prefix_cache_blocks": len(self.blocks), "prefix_cache_bytes": self.bytes,
                "prefix_cache_evicted_blocks": s.evicted_blocks}
