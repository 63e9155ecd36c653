"""The KV page pool: which pages are free, and how many owners each used page has.

Pages are plain integers indexing the runner's pool (`kv_pool` rows, see docs/architecture.md).
The manager never touches KV data; it only hands out page ids. Ownership is by reference count
so that a page can later be shared by several sequences and by an immutable prefix checkpoint
(prefix caching): a page goes back to the free list only when its last owner releases it.

Page tables are plain `list[int]` owned by their holder (a Sequence today, a checkpoint later);
the manager works on tables rather than on sequences so that any owner can use it.
"""

from __future__ import annotations

from collections import deque


class OutOfPages(RuntimeError):
    """An allocation asked for more pages than are free (callers check first)."""


class BlockManager:
    def __init__(self, num_pages: int, page_tokens: int):
        if num_pages < 1 or page_tokens < 1:
            raise ValueError(f"need num_pages >= 1 and page_tokens >= 1, got {num_pages}, {page_tokens}")
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self._ref_counts = [0] * num_pages
        # Allocation pops from the left, release appends on the right: a released page is reused
        # as late as possible, which is what a later prefix cache wants (recently freed pages may
        # still be looked up) and costs nothing now.
        self._free: deque[int] = deque(range(num_pages))

    # -- queries -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_tokens

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_tokens)

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    def is_shared(self, page: int) -> bool:
        """Shared pages are immutable: nobody may append into them (copy-on-write comes later)."""
        return self._ref_counts[page] > 1

    def pages_to_grow(self, table: list[int], num_tokens: int) -> int:
        """New pages `table` needs so that it covers `num_tokens` tokens."""
        return max(0, self.pages_for(num_tokens) - len(table))

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.pages_to_grow(table, num_tokens) <= len(self._free)

    # -- mutation ------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages, each with one owner."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._ref_counts[p] = 1
        return pages

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append pages to `table` (in place) so that it covers `num_tokens` tokens."""
        table.extend(self.allocate(self.pages_to_grow(table, num_tokens)))

    def share(self, pages: list[int]) -> None:
        """Add one owner to each page (a second sequence or a checkpoint now also holds it)."""
        for p in pages:
            if self._ref_counts[p] <= 0:
                raise ValueError(f"page {p} is free and cannot be shared")
            self._ref_counts[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one owner from each page; pages without owners become free."""
        # Reverse order: the tail of a table (least likely to be shared by a prefix) is freed
        # first and so reused first.
        for p in reversed(pages):
            count = self._ref_counts[p]
            if count <= 0:
                raise ValueError(f"page {p} released more times than it was owned")
            self._ref_counts[p] = count - 1
            if count == 1:
                self._free.append(p)
