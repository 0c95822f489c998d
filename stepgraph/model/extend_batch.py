"""The packed prefill ("extend") batch: chunks of several prompts in one forward.

A chunk is ``tokens`` of one request starting at position ``start``: the request's first
``start`` tokens are already in its pages (an earlier chunk, or none: ``start = 0``). The chunks
are packed end to end into ``T`` tokens:

    input_ids    [T]            int64  token ids, chunk after chunk
    positions    [T]            int64  start .. start + len - 1 of each chunk
    slots        [T]            int64  KV slot of each token (its K/V are written there)
    qo_indptr    [bs + 1]       int32  cumulative chunk lengths: chunk b is rows qo_indptr[b]..[b+1]
    kv_lens      [bs]           int32  start + len: the request's KV length after this chunk
    block_table  [bs, W]        int32  each request's first W pages (W covers the longest kv_len,
                                       rounded up to 16; scratch page 0 past a request's pages)
    last_idx     [bs]           int64  the packed row of each chunk's last token

Every field is built on the host with numpy (no per-token Python loop) and reaches the device in
one copy of one int64 buffer; the int32 fields are cast there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class PrefillChunk:
    tokens: Sequence[int]  # the chunk's token ids (>= 1)
    start: int  # position of its first token = tokens of the request already in the cache
    pages: Sequence[int]  # every page the request owns, in order

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class ExtendBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64
    qo_indptr: torch.Tensor  # [bs + 1] int32
    kv_lens: torch.Tensor  # [bs] int32
    block_table: torch.Tensor  # [bs, W] int32
    last_idx: torch.Tensor  # [bs] int64
    q_lens: list[int]  # host copies: the attention's geometry needs no device sync
    kv_lens_host: list[int]
    pages: list[list[int]]  # each request's pages (the CPU attention gathers through them)
    max_q_len_bound: int | None = None  # a graph's bucket: rows past the live chunks are padding

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_q_len(self) -> int:
        """The longest chunk, or the bound a captured graph sized its grid for."""
        return self.max_q_len_bound if self.max_q_len_bound is not None else max(self.q_lens)


ALIGN = 16  # block-table width, in pages
ALIGN_INT32 = 4  # int32 entries in 16 bytes


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def check_chunks(chunks: Sequence[PrefillChunk], page_size: int) -> None:
    """``ConfigError`` naming the chunk unless each is non-empty, starts at a position >= 0 and
    ends inside its pages."""
    if not chunks:
        raise ConfigError("an extend batch needs at least one chunk; give one prompt or more.")
    for i, c in enumerate(chunks):
        n = len(c.tokens)
        if n == 0:
            raise ConfigError(f"chunk {i} is empty; an empty prompt has no last token.")
        if isinstance(c.start, bool) or not isinstance(c.start, int) or c.start < 0:
            raise ConfigError(f"chunk {i} starts at {c.start!r}; positions start at 0.")
        if c.end > len(c.pages) * page_size:
            raise ConfigError(
                f"chunk {i} ends at position {c.end}, past the {len(c.pages)} pages of "
                f"{page_size} tokens reserved for its request; reserve pages for every token."
            )


def build_extend_batch(
    chunks: Sequence[PrefillChunk], page_size: int, device: torch.device
) -> ExtendBatch:
    """The packed batch of ``chunks`` on ``device`` (module docstring)."""
    check_chunks(chunks, page_size)
    q_lens = [len(c.tokens) for c in chunks]
    kv_lens = [c.end for c in chunks]
    bs, t = len(chunks), sum(q_lens)
    # pages of the longest request after this chunk, rounded up to 16 (page 0 past them): the
    # table's row stride then never changes the extend kernel's Triton specialisation
    width = _round_up(-(-max(kv_lens) // page_size), ALIGN)
    ids = np.concatenate([np.asarray(c.tokens, dtype=np.int64) for c in chunks])
    positions = np.concatenate([np.arange(c.start, c.end, dtype=np.int64) for c in chunks])
    table = np.zeros((bs, width), dtype=np.int64)  # scratch page 0 past a request's pages
    for b, c in enumerate(chunks):
        row = np.asarray(c.pages[:width], dtype=np.int64)
        table[b, : len(row)] = row
    owner = np.repeat(np.arange(bs), q_lens)  # [T] chunk of each token
    slots = table[owner, positions // page_size] * page_size + positions % page_size
    indptr = np.zeros(_round_up(bs + 1, ALIGN_INT32), dtype=np.int64)
    np.cumsum(q_lens, out=indptr[1 : bs + 1])
    kv = np.zeros(_round_up(bs, ALIGN_INT32), dtype=np.int64)
    kv[:bs] = kv_lens
    # one host->device copy: [ids | positions | slots | last_idx | indptr | kv_lens | table];
    # the int32 segments padded to 16 bytes, so each starts aligned (no new specialisation)
    host = torch.from_numpy(
        np.concatenate([ids, positions, slots, indptr[1 : bs + 1] - 1, indptr, kv, table.ravel()])
    )
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    ids_d, pos_d, slots_d, last_d, rest = dev.split([t, t, t, bs, dev.numel() - 3 * t - bs])
    small = rest.to(torch.int32)  # indptr, kv_lens and the table: int32 for the kernel
    indptr_d, kv_d, table_d = small.split([len(indptr), len(kv), bs * width])
    return ExtendBatch(
        input_ids=ids_d,
        positions=pos_d,
        slots=slots_d,
        qo_indptr=indptr_d[: bs + 1],
        kv_lens=kv_d[:bs],
        block_table=table_d.view(bs, width),
        last_idx=last_d,
        q_lens=q_lens,
        kv_lens_host=kv_lens,
        pages=[list(c.pages) for c in chunks],
    )


def prompt_chunks(
    prompts: Sequence[Sequence[int]], pages: Sequence[Sequence[int]]
) -> list[PrefillChunk]:
    """Whole prompts from position 0, one chunk each."""
    if len(prompts) != len(pages):
        raise ConfigError(f"{len(prompts)} prompts but {len(pages)} page lists.")
    return [PrefillChunk(list(p), 0, list(pg)) for p, pg in zip(prompts, pages)]


__all__ = ["ExtendBatch", "PrefillChunk", "build_extend_batch", "check_chunks", "prompt_chunks"]
