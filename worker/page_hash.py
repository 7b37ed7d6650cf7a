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
    if n_full == 0:
        return []
    ids = np.asarray(token_ids[: n_full * page_size], dtype="<i4").reshape(n_full, page_size)
    keys: list[int] = []
    prev = _ROOT
    for row in ids:
        digest = hashlib.blake2b(prev + row.tobytes(), digest_size=8).digest()
        keys.append(int.from_bytes(digest, "little", signed=True))
        prev = digest
    return keys


def extend_page_hashes(
    keys: list[int], token_ids: Sequence[int], page_size: int, upto: int
) -> None:
    """Append keys for the full pages of `token_ids[:upto]` that `keys` does not cover yet."""
    n_full = min(upto, len(token_ids)) // page_size
    prev = keys[-1].to_bytes(8, "little", signed=True) if keys else _ROOT
    for i in range(len(keys), n_full):
        row = np.asarray(token_ids[i * page_size : (i + 1) * page_size], dtype="<i4")
        prev = hashlib.blake2b(prev + row.tobytes(), digest_size=8).digest()
        keys.append(int.from_bytes(prev, "little", signed=True))
