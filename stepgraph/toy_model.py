"""A small paged "model" with the ModelRunner interface, for tests and runner benchmarks.

Each layer does a projection, writes the new token's state into a paged cache at
``out_cache_loc``, and runs an attention-like masked mean over the request's first ``seq_len``
cached slots, found through ``block_table``. The lengths and tables come from the attention
backend's metadata, exactly as a real model's attention reads them, so the runner's static
buffers, padding and hooks are exercised for real. About ``10 * num_layers`` kernels a step.
"""

from __future__ import annotations

import torch

from .batch import ForwardBatch, pack_batch
from .runner.capture import is_capture_mode


class ToyAttentionBackend:
    """Holds the per-step metadata (``seq_lens``, ``block_table``) the layers read."""

    def __init__(self) -> None:
        self.seq_lens: torch.Tensor | None = None  # [bs] int32
        self.block_table: torch.Tensor | None = None  # [bs, max_pages] int32
        self.calls: list[tuple[str, int]] = []  # hook log, for tests

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.seq_lens, self.block_table = batch.seq_lens, batch.block_table

    def init_cuda_graph_state(self, max_bs: int) -> None:
        self.calls.append(("state", max_bs))

    def init_forward_metadata_capture_cuda_graph(self, bs: int, batch: ForwardBatch) -> None:
        self.calls.append(("capture", bs))
        self.seq_lens, self.block_table = batch.seq_lens, batch.block_table

    def init_forward_metadata_replay_cuda_graph(self, bs: int, batch: ForwardBatch) -> None:
        # Static buffers already hold the live values; re-point at this bucket's views.
        self.seq_lens, self.block_table = batch.seq_lens, batch.block_table

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1


class ToyModelRunner:
    def __init__(
        self,
        *,
        vocab: int = 97,
        hidden: int = 32,
        num_layers: int = 3,
        num_pages: int = 64,
        page_size: int = 4,
        max_pages_per_request: int = 8,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        sync_in_forward: bool = False,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.device = torch.device(device)
        self.dtype = dtype
        self.page_size = page_size
        self.max_pages_per_request = max_pages_per_request
        self.max_context_len = max_pages_per_request * page_size
        self.num_pages, self.vocab_size = num_pages, vocab  # bounds of the runner's value checks
        self.attn_backend = ToyAttentionBackend()
        self.sync_in_forward = sync_in_forward
        self.capture_mode_seen = False

        def rand(*shape):
            return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(self.device, dtype)

        self.embed = rand(vocab, hidden)  # [vocab, hidden]
        self.layers = [(rand(hidden, hidden), rand(hidden)) for _ in range(num_layers)]
        self.lm_head = rand(hidden, vocab)  # [hidden, vocab]
        # Per-layer paged cache: [num_pages * page_size, hidden]; page 0 is scratch.
        self.kv = [
            (torch.randn(num_pages * page_size, hidden, generator=g)).to(self.device, dtype)
            for _ in range(num_layers)
        ]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[bs, vocab]`` of a decode batch."""
        # Eager steps prepare their own metadata; under capture the runner's capture hook did,
        # pointing it at the static buffers (the sglang/pymllm convention).
        if is_capture_mode():
            self.capture_mode_seen = True
        else:
            self.attn_backend.init_forward_metadata(batch)
        if self.sync_in_forward:
            _ = int(batch.seq_lens.max())  # a host sync: uncapturable on purpose
        meta = self.attn_backend
        span = torch.arange(self.page_size, device=self.device)
        # slots: [bs, max_pages * page_size], the request's cache slots in order
        slots = (meta.block_table.long()[:, :, None] * self.page_size + span).flatten(1)
        keep = torch.arange(slots.shape[1], device=self.device)[None, :] < meta.seq_lens[:, None]
        weights = keep.to(self.dtype) / meta.seq_lens[:, None].to(self.dtype)  # [bs, S]
        pos = torch.sin(batch.positions.to(self.dtype))[:, None]  # [bs, 1]
        h = self.embed[batch.input_ids] + pos  # [bs, hidden]
        for (w, b), cache in zip(self.layers, self.kv):
            h = torch.tanh(h @ w + b)
            cache[batch.out_cache_loc] = h  # write this token's state
            ctx = (cache[slots] * weights[:, :, None]).sum(1)  # [bs, hidden]
            h = h + ctx
        return h @ self.lm_head

    def eager_reference(self, batch: ForwardBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Eager logits of ``batch`` and the cache state it leaves, with the cache restored
        afterwards (so a replay of the same batch starts from the same state)."""
        saved = self.clone_state()
        logits = self.forward(batch).clone()
        after = self.clone_state()
        self.load_state(saved)
        return logits, after

    def clone_state(self) -> list[torch.Tensor]:
        return [c.clone() for c in self.kv]

    def load_state(self, state: list[torch.Tensor]) -> None:
        for c, s in zip(self.kv, state):
            c.copy_(s)

    def random_batch(
        self, bs: int, g: torch.Generator, *, packed: bool = False, max_len: int | None = None
    ) -> ForwardBatch:
        """``bs`` requests with distinct pages (never page 0), random lengths (at most
        ``max_len``, default the whole context) and tokens."""
        num_pages = self.kv[0].shape[0] // self.page_size
        width = self.max_pages_per_request
        if bs * width > num_pages - 1:
            raise ValueError(f"{bs} requests need {bs * width + 1} pages; build the toy with more")
        pages = (torch.randperm(num_pages - 1, generator=g)[: bs * width] + 1).view(bs, width)
        top = min(max_len or width * self.page_size, width * self.page_size)
        seq_lens = torch.randint(1, top + 1, (bs,), generator=g, dtype=torch.int32)
        last = seq_lens.long() - 1  # position of the token fed this step
        page = pages.gather(1, (last // self.page_size)[:, None])[:, 0]
        batch = ForwardBatch(
            input_ids=torch.randint(1, self.embed.shape[0], (bs,), generator=g),
            positions=last,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens.clone(),
            block_table=pages.to(torch.int32),
            out_cache_loc=page * self.page_size + last % self.page_size,
        )
        if packed:  # built on the host and copied once, as an engine does
            batch.packed_cpu = pack_batch(batch)
        for name, t in batch.device_tensors().items():
            setattr(batch, name, t.to(self.device))
        if packed:
            batch.packed = batch.packed_cpu.to(self.device)
        return batch
