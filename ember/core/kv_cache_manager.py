"""KVCacheManager: gives each request its blocks, reusing cached prefix blocks by chained hash."""

from __future__ import annotations

from ember.core.block_pool import BlockPool, KVCacheBlock
from ember.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many leading blocks are hashed already
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found there

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks that prefix the request (never all its tokens)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        # At least one token must be computed to get logits for the next token.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock] | None = None,
    ) -> bool:
        """Make room for num_new_tokens more tokens; False (changing nothing) if blocks run out."""
        if not computed_blocks:
            # Fast path for most decode steps: the last block still has room.
            blocks = self.req_to_blocks.get(request.request_id)
            total = request.num_computed_tokens + num_new_tokens
            if blocks is not None and total <= len(blocks) * self.block_size:
                if self.enable_caching:
                    self._cache_full_blocks(request, blocks, total)
                return True
        computed_blocks = computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_needed = cdiv(total_tokens, self.block_size) - len(blocks) - len(computed_blocks)
        # Hits sitting in the free queue stop being free once touched.
        num_reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed + num_reclaimed > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return False
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        if num_needed > 0:
            blocks.extend(self.pool.get_new_blocks(num_needed))
        self._cache_full_blocks(request, blocks, total_tokens)
        return True

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], total: int) -> None:
        """Hash blocks that this step fills completely (their KV is written during the step)."""
        if not self.enable_caching:
            return
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(total // self.block_size, len(request.block_hashes))
        if end > start:
            self.pool.cache_blocks(blocks, request.block_hashes, start, end)
            self.num_cached_blocks[request.request_id] = end

    def free(self, request: Request) -> None:
        """Release a request's blocks; tail blocks go back first so they are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """Block ids of a request from index `start` on."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])[start:]]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
