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

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import ConfigError


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


@dataclass(frozen=True)
class ExtendLayout:
    """Sizes of the one int64 buffer an extend batch travels in:
    ``[ids T | positions T | slots T | last_idx B | indptr I | kv_lens K | table B * W]``, where
    ``I >= B + 1`` and ``K >= B`` leave room to align the int32 segments. Entries past the live
    chunks are padding: token 0 at position 0 writing scratch slot 0, empty chunks."""

    tokens: int  # T
    chunks: int  # B
    width: int  # W, block-table columns
    indptr: int  # I
    kv: int  # K

    def sizes(self) -> list[int]:
        t, b = self.tokens, self.chunks
        return [t, t, t, b, self.indptr, self.kv, b * self.width]

    @property
    def numel(self) -> int:
        return sum(self.sizes())


def pack_extend(chunks: Sequence[PrefillChunk], page_size: int, layout: ExtendLayout) -> np.ndarray:
    """The host buffer of ``layout`` holding ``chunks`` (checked by ``check_chunks``), padded."""
    out = np.empty(layout.numel, dtype=np.int64)
    n = pack_extend_into(out, chunks, page_size, layout)
    out[n:] = 0
    return out


@functools.lru_cache(maxsize=256)
def _offsets(layout: ExtendLayout) -> tuple[int, ...]:
    """Where each segment of ``layout`` starts: positions, slots, last_idx, indptr, kv_lens,
    block table."""
    starts = np.cumsum(layout.sizes()[:-1]).tolist()
    return tuple(starts)


def pack_extend_into(
    out: np.ndarray, chunks: Sequence[PrefillChunk], page_size: int, layout: ExtendLayout
) -> int:
    """Write ``chunks`` (checked by ``check_chunks``) into ``out`` in ``layout``, padded; return
    how many leading entries were written: every segment but the block-table rows of the
    chunks past the live ones, which no chunk reads (they keep what they held). A few numpy
    calls a chunk, no per-token Python: about 30 µs for one chunk of 512 tokens."""
    o_pos, o_slots, o_last, o_ind, o_kv, o_table = _offsets(layout)
    w, live = layout.width, len(chunks)
    written = o_table + live * w
    out[:written] = 0
    n = 0
    for b, c in enumerate(chunks):
        q, start = len(c.tokens), c.start
        out[n : n + q] = c.tokens
        pos = out[o_pos + n : o_pos + n + q]
        pos[:] = np.arange(start, start + q)
        row = out[o_table + b * w : o_table + (b + 1) * w]
        pages = c.pages[:w]
        row[: len(pages)] = pages
        if start % page_size == 0 and q >= page_size:  # whole pages first: a reshape, no gather
            slots = out[o_slots + n : o_slots + n + q]
            first, k = start // page_size, q // page_size
            whole = slots[: k * page_size].reshape(k, page_size)
            whole[:] = row[first : first + k, None] * page_size + np.arange(page_size)
            rest = pos[k * page_size :]
            slots[k * page_size :] = row[rest // page_size] * page_size + rest % page_size
        else:
            out[o_slots + n : o_slots + n + q] = row[pos // page_size] * page_size + pos % page_size
        n += q
        out[o_last + b] = n - 1
        out[o_ind + b + 1] = n
        out[o_kv + b] = c.end
    out[o_ind + live + 1 : o_ind + layout.indptr] = n  # empty chunks and alignment room
    return written


def unpack_extend(
    buffer: torch.Tensor, layout: ExtendLayout
) -> tuple[torch.Tensor, ...]:  # ids, positions, slots, indptr, kv_lens, table, last_idx
    """Views of the fields in ``buffer`` (``layout``, on the device); the int32 ones cast."""
    t, b = layout.tokens, layout.chunks
    ids, pos, slots, last, rest = buffer[: layout.numel].split(
        [t, t, t, b, layout.numel - 3 * t - b]
    )
    indptr, kv_lens, table = rest.to(torch.int32).split(layout.sizes()[4:])
    return ids, pos, slots, indptr[: b + 1], kv_lens[:b], table.view(b, layout.width), last


def build_extend_batch(
    chunks: Sequence[PrefillChunk], page_size: int, device: torch.device
) -> ExtendBatch:
    """The packed batch of ``chunks`` on ``device`` (module docstring): one host-to-device copy.
    The table width is rounded up to 16 pages and the int32 segments to 16 bytes, so a new
    batch shape never changes the extend kernel's Triton specialisation."""
    check_chunks(chunks, page_size)
    q_lens, kv_lens = [len(c.tokens) for c in chunks], [c.end for c in chunks]
    bs = len(chunks)
    width = _round_up(-(-max(kv_lens) // page_size), ALIGN)
    layout = ExtendLayout(
        sum(q_lens), bs, width, _round_up(bs + 1, ALIGN_INT32), _round_up(bs, ALIGN_INT32)
    )
    host = torch.from_numpy(pack_extend(chunks, page_size, layout))
    if device.type == "cuda":
        host = host.pin_memory()
    fields = unpack_extend(host.to(device, non_blocking=True), layout)
    pages = [list(c.pages) for c in chunks]
    return ExtendBatch(*fields, q_lens=q_lens, kv_lens_host=kv_lens, pages=pages)


def prompt_chunks(
    prompts: Sequence[Sequence[int]], pages: Sequence[Sequence[int]]
) -> list[PrefillChunk]:
    """Whole prompts from position 0, one chunk each."""
    if len(prompts) != len(pages):
        raise ConfigError(f"{len(prompts)} prompts but {len(pages)} page lists.")
    return [PrefillChunk(list(p), 0, list(pg)) for p, pg in zip(prompts, pages)]


__all__ = [
    "ExtendBatch",
    "ExtendLayout",
    "PrefillChunk",
    "build_extend_batch",
    "check_chunks",
    "pack_extend",
    "pack_extend_into",
    "prompt_chunks",
    "unpack_extend",
]
