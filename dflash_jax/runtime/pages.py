"""The host side of a paged cache: which pages are free, who holds them, and the prefix cache.

``PageAllocator`` hands out pages of one pool (the target's and the drafter's pools share page numbers:
a page holds the same positions of both) with reference counts. A request holds its pages from its
admission until its row is released or preempted, and gets more as it advances (``grow``); a page
shared by several requests (a cached prefix) is freed when the last one lets it go.

Prefix caching: a full page of a prompt is keyed by a hash chain of its tokens, ``key_i =
blake2b(key_{i-1} || tokens of page i)`` (128 bits: a collision, which would serve one prompt another's
K/V, is out of reach, unlike with a 64-bit ``hash``), so a key names the page's tokens and every token
before them (the page's K/V depend on both). A new request reuses the longest run of its prompt's leading full
pages that are cached, for the target's K/V and the drafter's context K/V alike (the drafter's
context features depend only on the prefix too), and prefills only the rest. At least one prompt
token is always prefilled (its logits give the first token), so a prompt that is entirely cached
recomputes its last page. Reused pages are read-only: a row writes only at positions at or past its
prompt's length, never in a page of its cached prefix, so no request sees another's pages change.
Unreferenced cached pages stay cached until a new allocation needs them, least recently used first.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Sequence

import numpy as np

from dflash_jax.ops.paged_cache import NULL_PAGE


@dataclasses.dataclass
class PageGrant:
    """What an admission got: the request's pages in order (one per ``page_size`` positions asked for)
    and how many leading positions are already cached (a multiple of the page size)."""

    pages: list[int]
    cached_tokens: int


@dataclasses.dataclass
class PageStats:
    """Counters for ``/metrics``."""

    total: int            # pages a request may get (the pool without the null page)
    free: int             # neither referenced nor cached
    cached: int           # cached and unreferenced (evictable)
    in_use: int           # referenced by a running request
    prefix_queries: int   # prompt tokens looked up
    prefix_hits: int      # of them, found cached
    preemptions: int = 0  # running rows paused for pages (``ContinuousBatcher.preemptions``)


class PageAllocator:
    """Free list, reference counts and the prefix cache of a pool of ``num_pages`` pages of
    ``page_size`` positions (page ``NULL_PAGE`` is never handed out)."""

    def __init__(self, num_pages: int, page_size: int, *, prefix_cache: bool = True):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (one is the null page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages, self.page_size, self.prefix_cache = num_pages, page_size, prefix_cache
        self.reset()

    def reset(self) -> None:
        """Every page free and nothing cached (the device pools were dropped)."""
        self._free = collections.deque(p for p in range(self.num_pages) if p != NULL_PAGE)
        self._refs = [0] * self.num_pages
        self._in_use = 0  # pages with a reference
        self._key_of: dict[int, bytes] = {}                # cached page -> its key
        self._page_of: dict[bytes, int] = {}               # key -> cached page
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # unreferenced cached pages
        self.prefix_queries = self.prefix_hits = 0

    # -- queries -----------------------------------------------------------------------------------

    @property
    def total(self) -> int:
        return self.num_pages - 1

    @property
    def available(self) -> int:
        """Pages an allocation may take now: free ones and unreferenced cached ones."""
        return len(self._free) + len(self._lru)

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    def stats(self) -> PageStats:
        return PageStats(total=self.total, free=len(self._free), cached=len(self._lru), in_use=self._in_use,
                         prefix_queries=self.prefix_queries, prefix_hits=self.prefix_hits)

    def all_free(self) -> bool:
        """No page is referenced: every request let its pages go (the leak check)."""
        return self._in_use == 0 and not any(self._refs) and len(self._free) + len(self._lru) == self.total

    def page_keys(self, tokens: Sequence[int]) -> list[bytes]:
        """The hash-chain keys of the full pages of ``tokens``."""
        keys, key = [], b""
        ids = np.asarray(tokens, dtype=np.int64)
        for i in range(len(tokens) // self.page_size):
            page = ids[i * self.page_size:(i + 1) * self.page_size]
            key = hashlib.blake2b(key + page.tobytes(), digest_size=16).digest()
            keys.append(key)
        return keys

    def cached_prefix(self, prompt: Sequence[int], *, reuse: bool = True) -> list[int]:
        """The pages of the longest cached run of ``prompt``'s leading full pages, leaving at least its
        last token to compute (none without ``reuse``)."""
        if not self.prefix_cache or not reuse:
            return []
        pages = []
        for key in self.page_keys(prompt[:len(prompt) - 1]):
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    # -- allocation --------------------------------------------------------------------------------

    def can_allocate(self, prompt: Sequence[int], positions: int, *, keep: int = 0, reuse: bool = True) -> bool:
        """Whether ``allocate(prompt, positions)`` would succeed and leave ``keep`` pages available."""
        hit = self.cached_prefix(prompt, reuse=reuse)
        needed = self.pages_for(positions) - len(hit)
        return needed + keep <= self.available - sum(1 for p in hit if self._refs[p] == 0)

    def allocate(self, prompt: Sequence[int], positions: int, *, keep: int = 0, reuse: bool = True,
                 ) -> PageGrant | None:
        """Pages for the first ``positions`` positions of a request (its prompt and a first stretch of
        new tokens, or its whole length): its cached prefix's pages, shared, then fresh ones (evicting
        least recently used cached pages if no page is free). None if the pool cannot hold them now
        while leaving ``keep`` pages available (the running rows' next growth); nothing is taken then.
        ``reuse=False``: no cached prefix (a prompt whose every position must be computed)."""
        if not self.can_allocate(prompt, positions, keep=keep, reuse=reuse):
            return None
        hit = self.cached_prefix(prompt, reuse=reuse)
        for page in hit:
            self._take(page)
        fresh = [self._fresh_page() for _ in range(self.pages_for(positions) - len(hit))]
        self.prefix_queries += len(prompt)
        self.prefix_hits += len(hit) * self.page_size
        return PageGrant(pages=hit + fresh, cached_tokens=len(hit) * self.page_size)

    def share(self, pages: Sequence[int], positions: int, *, keep: int = 0) -> PageGrant | None:
        """Pages for the first ``positions`` positions of a request whose leading full pages are another
        live request's ``pages`` (an equal prompt admitted with it: a request's ``n`` > 1 choices): those,
        shared, then fresh ones. None (nothing taken) if the pool cannot hold the fresh ones while leaving
        ``keep`` pages available."""
        fresh = self.pages_for(positions) - len(pages)
        if fresh + keep > self.available:
            return None
        for page in pages:
            self._take(page)
        return PageGrant(pages=list(pages) + [self._fresh_page() for _ in range(fresh)],
                         cached_tokens=len(pages) * self.page_size)

    def grow(self, pages: list[int], positions: int) -> bool:
        """Appends fresh pages to a request's ``pages`` until they cover ``positions`` positions; False
        (nothing taken) if the pool has too few available."""
        needed = self.pages_for(positions) - len(pages)
        if needed > self.available:
            return False
        pages.extend(self._fresh_page() for _ in range(needed))
        return True

    def register(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Caches the full pages of ``tokens`` (whose K/V are in ``pages``, in order): a later prompt
        starting with them reuses them. A key already cached keeps its page."""
        if not self.prefix_cache:
            return
        for key, page in zip(self.page_keys(tokens), pages):
            if key in self._page_of or page in self._key_of:
                continue
            self._page_of[key], self._key_of[page] = page, key

    def release(self, pages: Sequence[int]) -> None:
        """Lets a request's pages go: a page nobody holds becomes free, or evictable if cached. The last
        pages go first, so a prefix's later pages are evicted before the earlier ones they extend."""
        for page in reversed(pages):
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} released more often than taken")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._in_use -= 1
                if page in self._key_of:
                    self._lru[page] = None
                else:
                    self._free.append(page)

    def _take(self, page: int) -> None:
        self._in_use += self._refs[page] == 0
        self._refs[page] += 1
        self._lru.pop(page, None)

    def _fresh_page(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:  # the least recently used unreferenced cached page
            page, _ = self._lru.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
        self._refs[page] = 1
        self._in_use += 1
        return page
