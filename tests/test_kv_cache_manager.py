"""Block pool and KV cache manager: allocation, reference counts, prefix hits, eviction order."""

import pytest

from ember.core.kv_cache_manager import KVCacheManager
from ember.core.request import Request
from ember.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), {0}, BS)


def test_allocate_and_free_returns_every_block():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    req = make_request("a", list(range(1, 10)))  # 9 tokens -> 3 blocks
    assert kv.allocate_slots(req, 9)
    assert len(kv.block_ids("a")) == 3 and kv.num_free_blocks == 7
    kv.free(req)
    assert kv.num_free_blocks == 10


def test_allocation_fails_cleanly_when_blocks_run_out():
    kv = KVCacheManager(num_blocks=2, block_size=BS, enable_caching=False)
    req = make_request("a", list(range(1, 12)))
    assert not kv.allocate_slots(req, 11)  # needs 3 blocks
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []


def test_shared_prefix_hits_cache_and_shares_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.allocate_slots(first, 9)
    second = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    assert num_hit_tokens == 8 and [b.block_id for b in hits] == kv.block_ids("a")[:2]
    second.num_computed_tokens = 0
    assert kv.allocate_slots(second, 2, hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert all(b.ref_cnt == 2 for b in hits)
    kv.free(first)
    kv.free(second)
    assert kv.num_free_blocks == 10


def test_full_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    a = make_request("a", list(range(1, 9)))  # exactly 2 blocks
    assert kv.allocate_slots(a, 8)
    kv.free(a)
    b = make_request("b", list(range(1, 9)))
    _, num_hit_tokens = kv.get_computed_blocks(b)
    assert num_hit_tokens == 4  # the last block is recomputed to produce logits


def test_freed_cached_blocks_survive_until_space_is_needed():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)
    a = make_request("a", list(range(1, 9)))
    assert kv.allocate_slots(a, 8)
    kv.free(a)
    # Free again, but the prefix is still cached: a new request with it hits.
    assert kv.num_free_blocks == 4
    hits, n = kv.get_computed_blocks(make_request("b", list(range(1, 10))))
    assert n == 8
    # Filling the whole cache with other tokens evicts them.
    c = make_request("c", list(range(100, 116)))
    assert kv.allocate_slots(c, 16)
    kv.free(c)
    _, n = kv.get_computed_blocks(make_request("d", list(range(1, 10))))
    assert n == 0


def test_eviction_prefers_least_recently_freed_tail_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)
    a = make_request("a", list(range(1, 9)))
    assert kv.allocate_slots(a, 8)
    kv.free(a)  # tail block freed first -> evicted first
    b = make_request("b", list(range(50, 54)))
    assert kv.allocate_slots(b, 4)
    c = make_request("c", list(range(60, 64)))
    assert kv.allocate_slots(c, 4)  # the two never-used blocks are taken first
    d = make_request("d", list(range(70, 74)))
    assert kv.allocate_slots(d, 4)  # now a's tail block is evicted, its head survives
    _, n = kv.get_computed_blocks(make_request("e", list(range(1, 10))))
    assert n == 4


def test_double_free_is_caught():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=False)
    a = make_request("a", [1, 2, 3])
    assert kv.allocate_slots(a, 3)
    blocks = list(kv.req_to_blocks["a"])
    kv.free(a)
    with pytest.raises(AssertionError):
        kv.pool.free_blocks(blocks)
