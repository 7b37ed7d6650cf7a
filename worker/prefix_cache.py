"""Prefix cache: full KV pages keyed by the chained hash of their tokens.

A page enters when its request has computed it (`publish`); while requests reference it,
it is pinned; when the last reference goes it is parked in an LRU list, and evicted from
there only when a page is needed and no free page is left.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from itertools import islice


class PrefixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._page_of: dict[int, int] = {}  # key -> page
        self._key_of: dict[int, int] = {}  # page -> key
        # unreferenced cached pages, oldest first
        self._parked: OrderedDict[int, None] = OrderedDict()
        self._recent: OrderedDict[int, None] = OrderedDict()  # keys, least recently used first
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def num_evictable(self) -> int:
        return len(self._parked)

    @property
    def num_pages(self) -> int:
        return len(self._page_of)

    def match(self, keys: list[int]) -> list[int]:
        """Pages of the longest cached prefix of `keys`; un-parks them (the caller takes a reference)."""
        pages: list[int] = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
            self._parked.pop(page, None)
            self._recent.move_to_end(key)
        return pages

    def record(self, num_tokens: int, hit_tokens: int) -> None:
        """Count one request's first admission in the hit-rate statistics. Not done in
        `match`: an admission the scheduler rolls back (no pages) is retried next step."""
        self.query_tokens += num_tokens
        self.hit_tokens += hit_tokens

    def publish(self, keys: Iterable[int], pages: Iterable[int]) -> None:
        """Make just-computed full pages findable, each under its key (a no-op for a prefix
        already cached)."""
        page_of, key_of, recent = self._page_of, self._key_of, self._recent
        for key, page in zip(keys, pages, strict=True):
            if key in page_of or page in key_of:
                continue
            page_of[key] = page
            key_of[page] = key
            recent[key] = None

    def park(self, pages: Iterable[int]) -> list[int]:
        """The last references to `pages` went away: the cached ones stay, evictable, in this
        order. Returns the others (free to reuse)."""
        key_of, parked = self._key_of, self._parked
        uncached = []
        for page in pages:
            if page in key_of:
                parked[page] = None
            else:
                uncached.append(page)
        return uncached

    def evict(self) -> int:
        """Drop the least recently parked page and return it for reuse."""
        page, _ = self._parked.popitem(last=False)
        key = self._key_of.pop(page)
        del self._page_of[key]
        self._recent.pop(key, None)
        return page

    def summary(self, max_pages: int | None = None) -> list[int]:
        """Keys now cached, most recently used first (what the router matches prompts against).
        The engine thread takes it after a step's tokens went out; the keys are walked in C
        rather than a Python loop (still milliseconds for a full cache: docs/performance.md)."""
        return list(islice(reversed(self._recent), max_pages))
