"""Paged KV cache: per-layer K/V page pools, a page allocator, slots and block-table rows.

    k_caches[layer], v_caches[layer]   [num_pages, page_size, n_kv_heads, head_dim]
    slot of token ``pos`` of a request  pages[pos // page_size] * page_size + pos % page_size
    block-table row of a request        [max_pages_per_request] int32, its pages then zeros

Page 0 is scratch: the allocator never hands it out. Padded rows of a replayed graph batch
read and write only there (``out_cache_loc`` 0, block table all 0), so they never touch a live
request's keys. Requests reserve all the pages they will ever need at admission, so a step can
never run out of pages halfway through a batch.
"""

from __future__ import annotations

import heapq

import torch

from ..errors import ConfigError

SCRATCH_PAGE = 0


class PageAllocator:
    """Hands out pages ``1..num_pages-1`` (page 0 is scratch); lowest ids first.

    The free pages are a heap: ``free`` of a request's pages costs O(pages log n), not a sort
    of every free page (which made releasing 100,000 one-page requests take minutes)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ConfigError(
                f"num_pages must be >= 2 (page 0 is reserved scratch), got {num_pages}."
            )
        self.num_pages = num_pages
        self._free = list(range(SCRATCH_PAGE + 1, num_pages))  # a heap: ascending is one
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` distinct free pages, or ``ConfigError`` (and nothing taken) if too few."""
        if n > len(self._free):
            raise ConfigError(
                f"KV cache has {len(self._free)} free pages, {n} needed; wait for running "
                "requests to finish, shorten the request, or build the cache with more pages."
            )
        pages = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Return ``pages``; freeing a page that is not allocated is a bug and raises."""
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            raise ConfigError(f"pages {bad} are not allocated (double free?); free each once.")
        self._used.difference_update(pages)
        for page in pages:
            heapq.heappush(self._free, page)


def free_bytes(device: torch.device | str) -> int | None:
    """Bytes free on ``device`` now (CUDA: the driver's count; CPU: the kernel's
    MemAvailable), or None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def check_memory(nbytes: int, num_pages: int, device: torch.device | str) -> None:
    """Refuse up front a KV cache that cannot fit, rather than swap or fail minutes later."""
    free = free_bytes(device)
    if free is not None and nbytes > free:
        raise ConfigError(
            f"the KV cache needs {num_pages} pages, {nbytes / 2**30:.2f} GiB, but only "
            f"{free / 2**30:.2f} GiB is free on {device}; lower max_bs or max_context_len "
            "(the cache holds max_bs requests of max_context_len tokens), or pass num_pages."
        )


class KVCache:
    """K/V pages of every layer plus their allocator."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        max_context_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if page_size < 1 or max_context_len < 1:
            raise ConfigError(
                f"page_size and max_context_len must be >= 1, got {page_size}, {max_context_len}."
            )
        self.page_size = page_size
        self.max_context_len = max_context_len
        self.max_pages_per_request = -(-max_context_len // page_size)
        # before anything is allocated (the allocator's free list too: 1e9 pages is 30 GiB)
        nbytes = 2 * num_layers * num_pages * page_size * num_kv_heads * head_dim
        check_memory(nbytes * torch.empty((), dtype=dtype).element_size(), num_pages, device)
        self.allocator = PageAllocator(num_pages)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def check_fits(self, num_tokens: int, what: str = "request") -> None:
        """``ConfigError`` if ``num_tokens`` could never be held, even by an empty cache."""
        if num_tokens > self.max_context_len:
            raise ConfigError(
                f"{what} needs {num_tokens} KV slots, more than max_context_len="
                f"{self.max_context_len}; shorten the prompt or max_new_tokens, or build the "
                "model runner with a larger max_context_len."
            )
        if self.pages_for(num_tokens) > self.num_pages - 1:
            raise ConfigError(
                f"{what} needs {self.pages_for(num_tokens)} pages of {self.page_size} tokens; "
                f"the whole cache has {self.num_pages - 1} usable pages. Build the model runner "
                "with more num_pages."
            )

    def can_reserve(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= self.allocator.num_free

    def reserve(self, num_tokens: int) -> list[int]:
        """Pages for ``num_tokens`` tokens of one request (checked against the limits first)."""
        self.check_fits(num_tokens)
        return self.allocator.allocate(self.pages_for(num_tokens))

    def release(self, pages: list[int]) -> None:
        self.allocator.free(pages)

    def slot(self, pages: list[int], pos: int) -> int:
        """Flat slot of token ``pos`` of the request owning ``pages``."""
        page, offset = divmod(pos, self.page_size)
        if pos < 0:  # divmod would index pages[-1]: another page's slot
            raise ConfigError(f"token position {pos} is negative; positions start at 0.")
        if page >= len(pages):
            raise ConfigError(
                f"token position {pos} is past the {len(pages)} pages reserved for the request."
            )
        return pages[page] * self.page_size + offset

    def slots(self, pages: list[int], start: int, stop: int) -> list[int]:
        """Slots of token positions ``start..stop-1``."""
        return [self.slot(pages, p) for p in range(start, stop)]

    def block_table_row(self, pages: list[int]) -> list[int]:
        """``[max_pages_per_request]``: the request's pages, then scratch page 0."""
        if len(pages) > self.max_pages_per_request:
            raise ConfigError(
                f"{len(pages)} pages exceed max_pages_per_request={self.max_pages_per_request}."
            )
        return pages + [SCRATCH_PAGE] * (self.max_pages_per_request - len(pages))


__all__ = ["KVCache", "PageAllocator", "SCRATCH_PAGE", "check_memory", "free_bytes"]
