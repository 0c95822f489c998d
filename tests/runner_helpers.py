"""Random decode batches for the toy model (shared by the runner tests)."""

from __future__ import annotations

import torch

from stepgraph.batch import ForwardBatch
from stepgraph.toy_model import ToyModelRunner


def random_batch(mr: ToyModelRunner, bs: int, g: torch.Generator) -> ForwardBatch:
    """``bs`` requests with distinct pages (never page 0), random lengths and tokens."""
    num_pages = mr.kv[0].shape[0] // mr.page_size
    width = mr.max_pages_per_request
    pages = (torch.randperm(num_pages - 1, generator=g)[: bs * width] + 1).view(bs, width)
    seq_lens = torch.randint(1, width * mr.page_size + 1, (bs,), generator=g, dtype=torch.int32)
    last = seq_lens.long() - 1
    out_cache_loc = pages.gather(1, (last // mr.page_size)[:, None])[:, 0] * mr.page_size + (
        last % mr.page_size
    )
    return ForwardBatch(
        input_ids=torch.randint(1, mr.embed.shape[0], (bs,), generator=g),
        positions=last,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        block_table=pages.to(torch.int32),
        out_cache_loc=out_cache_loc,
    )
