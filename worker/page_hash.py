"""The chained block hash shared by the prefix cache (worker) and the router (cluster).

Page i's key is blake2b(key of page i-1 || its token ids as little-endian int32). A key
therefore names the whole prefix up to the end of its page, so two requests share a
page's KV exactly when they share every token before that page's end.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_ROOT = b"kvray-page-v1"


def page_hashes(
    token_ids: Sequence[int], page_size: int, *, max_pages: int | None = None
) -> list[int]:
    """Keys of the full pages of `token_ids` (a trailing partial page has none)."""
    n_full = len(token_ids) // page_size
    if max_pages is not None:
        n_full = min(n_full, max_pages)
    keys: list[int] = []
    _chain(keys, _ROOT, token_ids[: n_full * page_size], page_size)
    return keys


def extend_page_hashes(
    keys: list[int], token_ids: Sequence[int], page_size: int, upto: int
) -> None:
    """Append keys for the full pages of `token_ids[:upto]` that `keys` does not cover yet."""
    n_full = min(upto, len(token_ids)) // page_size
    if n_full <= len(keys):
        return
    prev = keys[-1].to_bytes(8, "little", signed=True) if keys else _ROOT
    _chain(keys, prev, token_ids[len(keys) * page_size : n_full * page_size], page_size)


def _chain(keys: list[int], prev: bytes, token_ids: Sequence[int], page_size: int) -> None:
    """Append the keys of whole pages of `token_ids`, the first chained to `prev`. The ids
    become bytes in one conversion: one per page cost more than the hashing (a 1,024-token
    prompt's admission, 2026-12-06)."""
    data = np.asarray(token_ids, dtype="<i4").tobytes()
    step = 4 * page_size
    for at in range(0, len(data) - step + 1, step):
        prev = hashlib.blake2b(prev + data[at : at + step], digest_size=8).digest()
        keys.append(int.from_bytes(prev, "little", signed=True))
