"""The chained page keys the prefix cache and the router share (worker/page_hash.py)."""

from __future__ import annotations

import hashlib

from worker.page_hash import extend_page_hashes, page_hashes


def test_a_key_is_the_chained_blake2b_of_its_pages_int32_ids():
    keys = page_hashes([1, 2, 3, 4, 5], 2)  # two full pages; the fifth id has no key yet
    first = hashlib.blake2b(b"kvray-page-v1" + b"\x01\0\0\0\x02\0\0\0", digest_size=8).digest()
    second = hashlib.blake2b(first + b"\x03\0\0\0\x04\0\0\0", digest_size=8).digest()
    assert keys == [int.from_bytes(d, "little", signed=True) for d in (first, second)]


def test_keys_name_the_whole_prefix():
    a, b = page_hashes([1, 2, 3, 4], 2), page_hashes([9, 2, 3, 4], 2)
    assert a[0] != b[0] and a[1] != b[1]  # the same second page after a different first
    assert page_hashes(list(range(10)), 4, max_pages=1) == page_hashes(list(range(10)), 4)[:1]


def test_extending_in_pieces_gives_the_keys_of_one_pass():
    ids = [(7 * i) % 50_000 for i in range(1_030)]
    keys: list[int] = []
    for upto in (0, 5, 16, 17, 300, 1_024, 1_030, 2_000):
        extend_page_hashes(keys, ids, 16, upto)
        assert keys == page_hashes(ids[:upto], 16)
