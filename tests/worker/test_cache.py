"""Bookkeeping of the KV cache: steady binds, pages, the prefix cache (CPU, no model)."""

import torch

from worker.cache import KVStorage, PageCache, ReqToTokenPool, _BindState, _is_steady_increment
from worker.page_hash import page_hashes
from worker.prefix_cache import PrefixCache
from worker.request import Request, ScheduledTask
from worker.sampling import SamplingParams
from worker.workspace import InferenceWorkspace

PAGE = 4


def _cache(num_pages: int = 32, prefix: bool = True) -> PageCache:
    dev = torch.device("cpu")
    ws = InferenceWorkspace(max_tokens=64, max_running=4, max_seq_len=64, num_heads=2, head_dim=8,
                            dtype=torch.float32, device=dev, split_kv=False)  # fmt: skip
    storage = KVStorage(2, num_pages * PAGE, 1, 8, torch.float32, dev)
    return PageCache(storage, ReqToTokenPool(4, 64, dev, staging=128), PAGE, num_pages, ws, prefix)


def _request(rid: str, n: int, start: int = 10) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams())


def test_steady_increment_rules():
    prev = _BindState((1, 2), (5, 9), all_decode=True)
    assert _is_steady_increment(prev, _BindState((1, 2), (6, 10), True))
    assert not _is_steady_increment(prev, _BindState((2, 1), (10, 6), True))  # order matters
    assert not _is_steady_increment(prev, _BindState((1, 2), (6, 11), True))
    assert not _is_steady_increment(
        _BindState((1, 2), (5, 9), False), _BindState((1, 2), (6, 10), True)
    )
    assert not _is_steady_increment(None, _BindState((1, 2), (6, 10), True))


def _decode_step(cache: PageCache, reqs: list[Request]):
    for r in reqs:
        r.output_ids.append(7)
        assert cache.reserve(r, 1)
    batch = cache.bind_tasks([ScheduledTask(r, 1) for r in reqs])
    for r in reqs:
        r.num_computed += 1
    return batch


def test_steady_bind_advances_metadata_like_a_full_rebind():
    cache = _cache()
    reqs = [_request("a", 5), _request("b", 7, start=40)]
    for r in reqs:
        assert cache.admit(r) and cache.reserve(r, len(r.prompt_ids))
    cache.bind_tasks([ScheduledTask(r, len(r.prompt_ids)) for r in reqs])
    for r in reqs:
        r.num_computed = len(r.prompt_ids)
    first = _decode_step(cache, reqs)
    assert first.steady is None  # after a prefill: rebuilt from the host
    for _ in range(5):  # crosses page boundaries: new pages reach the table through the flush
        batch = _decode_step(cache, reqs)
        assert batch.steady is not None and batch.steady.batch_size == 2
        got = [
            t.clone()
            for t in (batch.positions, batch.seq_lens, batch.kv_indptr, batch.out_cache_loc)
        ]
        cache.invalidate_bind()  # bind the same step again, from the host
        cache._task_len[[r.row for r in reqs]] -= 1
        for r in reqs:
            r.num_computed -= 1
        rebound = cache.bind_tasks([ScheduledTask(r, 1) for r in reqs])
        for r in reqs:
            r.num_computed += 1
        assert rebound.steady is None
        want = (rebound.positions, rebound.seq_lens, rebound.kv_indptr, rebound.out_cache_loc)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


def test_pages_return_and_prefix_pages_are_reused():
    cache = _cache(num_pages=16)
    total = cache.num_free_pages
    a = _request("a", 13)
    assert cache.admit(a) and cache.reserve(a, 13)
    cache.admitted(a)
    assert cache.num_free_pages == total - 4
    a.num_computed = 13
    cache.release(a)  # 3 full pages stay cached (evictable), the partial one is freed
    assert cache.num_free_pages == total and cache.prefix.num_evictable == 3
    b = _request("b", 13)  # same tokens
    assert cache.admit(b)
    assert b.num_computed == 12 and b.num_cached == 12  # 3 pages of hits; the last token recomputes
    assert cache.prefix_stats == (0, 13)  # only kept admissions count: a's (no hits) so far
    cache.admitted(b)
    assert cache.prefix_stats == (12, 26)


def test_a_missed_prompt_is_hashed_past_its_first_page_only_once_its_step_is_queued():
    """Admission keys pages as the prefix walk needs them; `hash_ahead` keys the rest while
    the step runs, and `commit` publishes exactly those keys."""
    cache = _cache(num_pages=16)
    a = _request("a", 13)
    assert cache.admit(a) and cache.reserve(a, 13) and a.num_computed == 0
    assert a.page_keys == page_hashes(a.prompt_ids, PAGE, max_pages=1)
    cache.bind_tasks([ScheduledTask(a, 13)])
    cache.hash_ahead([ScheduledTask(a, 13)])
    assert a.page_keys == page_hashes(a.prompt_ids, PAGE)  # 3 full pages
    a.num_computed = 13
    cache.commit(a)
    assert cache.prefix_summary() == a.page_keys[::-1]  # published, the newest first
    b = _request("b", 13)
    c = _request("c", 13)
    c.prompt_ids[9] = 0  # the same first two pages, then not
    assert cache.admit(b) and b.num_computed == 12
    assert cache.admit(c) and c.num_computed == 8


def test_pages_come_free_ones_first_in_order_then_evicted_ones():
    cache = _cache(num_pages=6)  # pages 1-5
    a = _request("a", 8)
    assert cache.admit(a) and cache.reserve(a, 8)
    assert cache._pages[a.row] == [1, 2]
    a.num_computed = 8
    cache.release(a)  # page 2 parked before page 1: the deepest goes first
    b = _request("b", 20, start=100)
    assert cache.admit(b) and cache.reserve(b, 20)
    assert cache._pages[b.row] == [3, 4, 5, 2, 1]
    assert cache.num_free_pages == 0


def test_eviction_takes_the_deepest_unreferenced_page_first():
    cache = _cache(num_pages=6)  # 5 usable pages
    a = _request("a", 12)
    assert cache.admit(a) and cache.reserve(a, 12)
    a.num_computed = 12
    cache.release(a)  # pages of a parked: deepest first in LRU order
    b = _request("b", 10, start=100)  # different tokens: needs 3 pages, 2 free + evictions
    assert cache.admit(b) and cache.reserve(b, 10)
    assert cache.prefix.num_evictable == 2
    c = _request("c", 8)  # a's first two pages must still be there
    # (8 - 1) // 4 = 1 page can hit; it is still cached
    assert cache.admit(c) and c.num_computed == 4


def test_an_admission_rolled_back_for_lack_of_pages_is_counted_once_when_it_sticks():
    cache = _cache(num_pages=16)
    a = _request("a", 13)
    for _ in range(3):  # admitted, then rolled back (as the scheduler does without pages)
        assert cache.admit(a)
        cache.release(a)
        a.num_computed = 0
    assert cache.prefix_stats == (0, 0)
    assert cache.admit(a) and cache.reserve(a, 13)
    cache.admitted(a)
    assert cache.prefix_stats == (0, 13)


def test_a_bind_names_the_tasks_that_sample_when_some_do_not():
    """A prompt chunk that does not end its prompt samples nothing: the bind stages the rows
    that do (the executor picks their logits on the device, never from a host list)."""
    cache = _cache()
    decoding, chunked = _request("a", 5), _request("b", 12, start=40)
    for r in (decoding, chunked):
        assert cache.admit(r)
    assert cache.reserve(decoding, 5) and cache.reserve(chunked, 6)
    whole = cache.bind_tasks([ScheduledTask(decoding, 5), ScheduledTask(chunked, 6)])
    assert whole.sample_rows is not None and whole.sample_rows.tolist() == [0]
    decoding.num_computed, chunked.num_computed = 5, 6
    decoding.output_ids.append(7)
    assert cache.reserve(decoding, 1) and cache.reserve(chunked, 6)
    both = cache.bind_tasks([ScheduledTask(decoding, 1), ScheduledTask(chunked, 6)])
    assert both.sample_rows is None  # the chunk ends its prompt: every task samples


def test_each_bind_field_sits_where_its_host_twin_does():
    """A non-steady bind copies the host metadata block whole: every device field must lie at
    its host twin's offset, with its dtype, and start on 64 bytes as an allocation would."""
    ws = InferenceWorkspace(max_tokens=13, max_running=5, max_seq_len=64, num_heads=2, head_dim=8,
                            dtype=torch.float32, device=torch.device("cpu"), split_kv=False)  # fmt: skip
    twins = [
        (ws.input_ids, ws.host_i64[0]), (ws.positions, ws.host_i64[1]),
        (ws.out_cache_loc, ws.host_i64[2]), (ws.logits_indices, ws.host_logits[0]),
        (ws.row_base, ws.host_logits[1]), (ws.sample_rows, ws.host_logits[2]),
        (ws.carry[0], ws.host_carry[0]), (ws.carry[1], ws.host_carry[1]),
        (ws.req_pool_indices, ws.host_i32[0]), (ws.seq_lens, ws.host_i32[1]),
        (ws.qo_indptr, ws.host_i32[2]), (ws.kv_indptr, ws.host_i32[3]),
    ]  # fmt: skip
    offsets = []
    for field, host in twins:
        offset = field.data_ptr() - ws.meta.data_ptr()
        assert offset == host.data_ptr() - ws.host_meta.data_ptr() and offset % 64 == 0
        assert field.dtype == host.dtype and field.is_contiguous() and len(host) >= len(field)
        offsets.append((offset, offset + field.numel() * field.element_size()))
    lengths = (len(ws.input_ids), len(ws.seq_lens), len(ws.carry[0]), len(ws.kv_indptr))
    assert lengths == (13, 5, 5, 6)
    assert all(
        end <= start for (_, end), (start, _) in zip(offsets, offsets[1:], strict=False)
    )  # apart
    assert offsets[-1][1] <= ws.meta.numel() * 8


def test_prefix_summary_lists_cached_keys_most_recently_used_first() -> None:
    # what a replica reports to the router: a hit moves its keys to the front; an evicted page's
    # key leaves; at most max_pages of them
    cache = PrefixCache(page_size=16)
    for key, page in ((11, 1), (12, 2), (13, 3), (14, 4)):
        cache.publish([key], [page])
    assert cache.summary(10) == [14, 13, 12, 11]
    assert cache.match([11, 12]) == [1, 2]
    assert cache.summary(3) == [12, 11, 14]
    assert cache.park([3]) == []
    assert cache.evict() == 3
    assert cache.summary(10) == [12, 11, 14]
    assert cache.summary() == [12, 11, 14]  # no cap: the whole cache


def test_latent_storage_is_one_row_that_is_both_k_and_v():
    """MLA's layout: one `[n_layers, n_slots, 1, width]` tensor; a write stores K once."""
    dev = torch.device("cpu")
    latent = KVStorage(2, 16, 1, 40, torch.bfloat16, dev, latent=True)
    assert latent.v is latent.k and latent.nbytes == 2 * 16 * 40 * 2
    assert KVStorage.bytes_per_token(2, 1, 40, torch.bfloat16, latent=True) == 2 * 40 * 2
    assert KVStorage.bytes_per_token(2, 1, 40, torch.bfloat16) == 2 * 2 * 40 * 2
    ws = InferenceWorkspace(max_tokens=64, max_running=4, max_seq_len=64, num_heads=2, head_dim=8,
                            dtype=torch.bfloat16, device=dev, split_kv=False)  # fmt: skip
    cache = PageCache(latent, ReqToTokenPool(4, 64, dev, staging=128), PAGE, 4, ws, False)
    r = _request("a", 3)
    assert cache.admit(r) and cache.reserve(r, 3)
    cache.bind_tasks([ScheduledTask(r, 3)])
    rows = torch.randn(3, 1, 40).bfloat16()
    cache.write(1, rows, rows)
    slots = cache.req_to_token[r.row, :3].long()
    assert torch.equal(cache.k_cache[1, slots], rows) and cache.v_cache is cache.k_cache
