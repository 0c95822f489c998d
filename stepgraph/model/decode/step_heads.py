"""The fused step's cuBLAS LM head and its greedy tokens (the reference rows' head, and the fused
step's where ``tile_table.CUBLAS`` measured cuBLAS faster)."""

from __future__ import annotations

import torch

from ...kernels.sampling.argmax_rows import argmax_rows
from ...tuning import DecodeTuning
from ..llama import LlamaModel, pad_rows


def cublas_head(
    model: LlamaModel,
    h: torch.Tensor,
    logits_out,
    tokens_out,
    tuning: DecodeTuning | None = None,
    rows: int = 0,
    live: int | None = None,
) -> torch.Tensor:
    """The LM head of the normed ``h`` as ``F.linear`` (into ``logits_out`` when given), then the
    greedy tokens into ``tokens_out`` when given: the reference rows' head, and the fused step's
    where cuBLAS measured faster. ``rows``: the GEMM's rows, the graph bucket's (``at_rows``);
    ``live``: the batch's rows where ``h`` carries padding past them (cut after the head)."""
    n = h.shape[0] if live is None else live
    h = pad_rows(h, rows)  # the GEMM at the bucket's rows (``at_rows``)
    logits = model.logits(h)[:n] if logits_out is None else model.logits(h, logits_out)
    if tokens_out is not None:
        greedy_tokens(logits, tokens_out, tuning)
    return logits


def greedy_tokens(
    logits: torch.Tensor, tokens_out: torch.Tensor, tuning: DecodeTuning | None = None
) -> None:
    """The greedy tokens of logits a cuBLAS head wrote: ``argmax_rows`` on CUDA (two small
    launches, faster than torch's one: docs/experiments.md#argmax-folding), ``torch.argmax`` on
    the CPU (same tokens)."""
    if logits.is_cuda and logits.stride(-1) == 1:
        argmax_rows(logits, tokens_out, tuning=tuning)
    else:
        torch.argmax(logits, -1, out=tokens_out)


__all__ = ["cublas_head", "greedy_tokens"]
