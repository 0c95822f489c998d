"""``PagedAttentionBackend``: the model's attention over the paged KV cache, and the
``AttentionBackend`` hooks the graph runner calls (``stepgraph.batch``).

The init_* hooks store the step's metadata on the backend; every layer then calls
``backend.rope_attention(layer_id, qkv, positions, cos_table, sin_table)``, which rotates q and k,
writes the new K/V into the pages and attends. On CUDA the rotation and the write are one launch
(``rope_kv``); on the CPU they are the torch ops of ``rope_kv_reference``.

- Decode on CUDA: ``flash_decode`` with an explicit split count, always. Eager steps take it from
  the ladder at the live maximum length (the batch's HOST copy of ``seq_lens``: no device sync)
  and at the rows of the graph bucket the batch would replay in (``geometry_bs``), so that mode
  "exact", which retunes the captured nodes per step at its bucket's rows, runs the same split
  count; captured steps use the bucket's split count at ``max_context_len``. Graphs share one
  workspace allocated at ``max_bs``; eager steps use their own, grown lazily.
- Decode on the CPU: ``paged_decode_reference`` (the Triton interpreter is too slow for models).
- Prefill ("extend"): packed chunks of several prompts (``extend_batch.ExtendBatch``); their K/V
  are written at their slots, then each chunk attends to its request's cached prefix and to
  itself, causally, through the pages (``prefill_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batch import ForwardBatch
from ..buckets import replay_bucket
from ..errors import CaptureError, ConfigError
from ..kernels.decode.flash_decode import DEFAULT_MAX_SPLITS, DecodeWorkspace, flash_decode
from ..kernels.decode.reference import paged_decode_reference
from ..kernels.decode.splits import ladder_for, num_splits_for
from ..kernels.elementwise.rope_kv import rope_kv, rope_kv_reference
from ..tuning import DecodeTuning, default_tuning
from .kv_cache import KVCache
from .prefill.extend_batch import ExtendBatch
from .prefill.prefill_attention import extend_attention

SEQ_LEN_FILL_VALUE = 1  # a padded graph row attends to one slot of scratch page 0


@dataclass
class DecodeMetadata:
    block_table: torch.Tensor  # [bs, max_pages] int32
    seq_lens: torch.Tensor  # [bs] int32, including the new token
    out_cache_loc: torch.Tensor  # [bs] int64, slot of the new token's K/V
    num_splits: int  # split-KV geometry of flash_decode (1 on the CPU path)
    workspace: DecodeWorkspace | None  # None on the CPU path
    from_graph: bool  # set by a capture/replay hook, for the runner's static batch


class PagedAttentionBackend:
    """Decode and prefill attention of a Llama/Qwen2 model over a ``KVCache``."""

    def __init__(
        self,
        kv_cache: KVCache,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        max_context_len: int,
        max_splits: int = DEFAULT_MAX_SPLITS,
        use_kernel: bool | None = None,
        tuning: DecodeTuning | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        # the ladder, the attention variant and PDL (None: DecodeTuning.default())
        self.tuning = default_tuning(tuning)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.device = torch.device(device)
        self.max_context_len = max_context_len
        self.max_splits = max_splits
        self.sm_scale = head_dim**-0.5
        self.use_kernel = self.device.type == "cuda" if use_kernel is None else use_kernel
        self.num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else 1
        )
        self.graph_workspace: DecodeWorkspace | None = None  # [max_bs, ...], for captured steps
        self._eager_workspace: DecodeWorkspace | None = None  # grown lazily, reused
        self.meta: DecodeMetadata | ExtendBatch | None = None
        self._graph_meta: dict[int, DecodeMetadata] = {}  # bucket -> metadata of its graph
        # the buckets of the graph runner over this backend (it sets them; None: the defaults)
        self.graph_buckets: list[int] | None = None

    # -- geometry ----------------------------------------------------------------------------

    def splits_for(self, t_kv: int, bs: int) -> int:
        """Split count of the ladder for live maximum KV length ``t_kv`` (a host int)."""
        if not self.use_kernel:
            return 1
        return num_splits_for(
            t_kv,
            self.num_kv_heads,
            bs,
            self.num_sms,
            self.max_splits,
            head_dim=self.head_dim,
            ladder=self.tuning.split,
        )

    @property
    def split_keys(self):
        """The ladder ``splits_for`` takes, as ``split_keys(t_kv, n_kv_heads, bs, num_sms)``:
        exact mode retunes the captured graphs with it (``graph_update.exec_updater``)."""
        return ladder_for(self.head_dim, self.tuning.split)

    def bucket_splits(self, bs: int) -> int:
        """The split count a graph of bucket ``bs`` is captured with (``max_context_len``)."""
        return self.splits_for(self.max_context_len, bs)

    def geometry_bs(self, bs: int) -> int:
        """The rows a step of ``bs`` rows is shaped for: the graph bucket it replays in
        (``graph_buckets``, else the default buckets), or ``bs`` above the largest. Eager steps
        choose their kernels and split counts on it too, so that mode "exact" (a bucket's graph,
        retuned per step) runs what eager runs."""
        return replay_bucket(bs, self.graph_buckets)

    def _workspace(self, bs: int) -> DecodeWorkspace | None:
        if not self.use_kernel:
            return None
        ws = self._eager_workspace
        if ws is None or ws.partial_lse.shape[0] < bs:
            ws = DecodeWorkspace.allocate(
                bs, self.num_heads, self.head_dim, self.max_splits, self.device
            )
            self._eager_workspace = ws
        return ws

    # -- AttentionBackend hooks --------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare an eager decode step (split count from the host copy of ``seq_lens``)."""
        bs = batch.batch_size
        t_kv = batch.max_seq_len
        if t_kv is None:
            t_kv = int(batch.seq_lens_cpu.max()) if bs else 0
        self.meta = DecodeMetadata(
            block_table=batch.block_table,
            seq_lens=batch.seq_lens,
            out_cache_loc=batch.out_cache_loc,
            num_splits=self.splits_for(t_kv, self.geometry_bs(max(bs, 1))),
            workspace=self._workspace(bs),
            from_graph=False,
        )

    def init_cuda_graph_state(self, max_bs: int) -> None:
        if self.use_kernel:
            self.graph_workspace = DecodeWorkspace.allocate(
                max_bs, self.num_heads, self.head_dim, self.max_splits, self.device
            )

    def init_forward_metadata_capture_cuda_graph(self, bs: int, batch: ForwardBatch) -> None:
        if self.use_kernel and (
            self.graph_workspace is None or self.graph_workspace.partial_lse.shape[0] < bs
        ):
            raise CaptureError(
                f"capturing bucket {bs} before init_cuda_graph_state(max_bs >= {bs}); the "
                "graph runner calls it once before capture, so call it first."
            )
        self.meta = self._graph_meta[bs] = DecodeMetadata(
            block_table=batch.block_table,
            seq_lens=batch.seq_lens,
            out_cache_loc=batch.out_cache_loc,
            num_splits=self.bucket_splits(bs),
            workspace=self.graph_workspace,
            from_graph=True,
        )

    def init_forward_metadata_replay_cuda_graph(self, bs: int, batch: ForwardBatch) -> None:
        # The static buffers already hold the live batch and a CUDA graph replays the captured
        # geometry; re-pointing the metadata at this bucket (built once, at capture) serves the
        # CPU stand-in, which re-runs the forward in Python. Once per token: keep it a lookup.
        self.meta = self._graph_meta[bs]

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return SEQ_LEN_FILL_VALUE

    def is_prepared_for(self, batch: ForwardBatch) -> bool:
        """``True`` if a capture/replay hook prepared exactly this (static) batch.

        Eager batches never alias the runner's live static buffers, so comparing addresses and
        shapes (host attributes, no sync) tells the runner's forward from an eager one."""
        m = self.meta
        return (
            isinstance(m, DecodeMetadata)
            and m.from_graph
            and m.block_table.data_ptr() == batch.block_table.data_ptr()
            and m.seq_lens.data_ptr() == batch.seq_lens.data_ptr()
            and m.seq_lens.shape == batch.seq_lens.shape
        )

    # -- prefill ----------------------------------------------------------------------------

    def init_extend_metadata(self, batch: ExtendBatch) -> None:
        """Prepare the prefill of the packed chunks of ``batch``."""
        self.meta = batch

    # -- the layers' call --------------------------------------------------------------------

    def rope_attention(
        self,
        layer_id: int,
        qkv: torch.Tensor,  # [T, (n_heads + 2 * n_kv_heads) * head_dim]
        positions: torch.Tensor,  # [T] int64
        cos_table: torch.Tensor,  # [max_positions, head_dim]
        sin_table: torch.Tensor,  # [max_positions, head_dim]
    ) -> torch.Tensor:  # [T, n_heads, head_dim]
        """Rotate q and k at ``positions``, write K/V into the pages of layer ``layer_id`` and
        attend: one ``rope_kv`` launch on CUDA, then the attention kernels."""
        m = self._meta()
        k_cache = self.kv_cache.k_caches[layer_id]
        v_cache = self.kv_cache.v_caches[layer_id]
        slots = m.slots if isinstance(m, ExtendBatch) else m.out_cache_loc
        args = (qkv, positions, cos_table, sin_table, k_cache, v_cache, slots, self.num_heads)
        if self._fused_rope(qkv, k_cache):
            q = rope_kv(*args)
        else:
            q = rope_kv_reference(*args)[0]
        return self._attend(m, q, k_cache, v_cache)

    def _fused_rope(self, qkv: torch.Tensor, k_cache: torch.Tensor) -> bool:
        half = self.head_dim // 2
        return (
            qkv.is_cuda
            and half & (half - 1) == 0
            and qkv.stride(-1) == 1
            and k_cache.is_contiguous()
        )

    def _meta(self) -> DecodeMetadata | ExtendBatch:
        if self.meta is None:
            raise ConfigError(
                "attention called before init_forward_metadata / init_extend_metadata; "
                "run the model through ModelRunner.forward or ModelRunner.extend."
            )
        return self.meta

    def _attend(self, m, q, k_cache, v_cache, use_pdl=None) -> torch.Tensor:  # [T, heads, dim]
        """Attention of ``q`` once this step's K/V are in the pages (``use_pdl``: the decode
        kernels', ``kernels/pdl.resolve_pdl``)."""
        if isinstance(m, ExtendBatch):
            return extend_attention(q, k_cache, v_cache, m, self.sm_scale)
        if self.use_kernel:
            return flash_decode(
                q,
                k_cache,
                v_cache,
                m.block_table,
                m.seq_lens,
                num_splits=m.num_splits,
                workspace=m.workspace,
                sm_scale=self.sm_scale,
                num_sms=self.num_sms,
                use_pdl=use_pdl,
                tuning=self.tuning,
            )
        return paged_decode_reference(
            q, k_cache, v_cache, m.block_table, m.seq_lens, sm_scale=self.sm_scale
        )

    def decode_attention(
        self,
        layer_id: int,
        q: torch.Tensor,  # [bs, n_heads, head_dim], rotated
        use_pdl: bool | int | None = None,  # kernels/pdl.resolve_pdl's (the fused step's mode)
    ) -> torch.Tensor:  # [bs, n_heads, head_dim]
        """Decode attention of layer ``layer_id`` once this step's K/V are already in its pages
        (the fused decode step's qkv kernel writes them): the kernels ``rope_attention`` runs
        after its ``rope_kv`` launch, same geometry, same results."""
        m = self._meta()
        if not isinstance(m, DecodeMetadata):
            raise ConfigError(
                "decode_attention needs decode metadata; a prefill goes through rope_attention."
            )
        kv = self.kv_cache
        return self._attend(m, q, kv.k_caches[layer_id], kv.v_caches[layer_id], use_pdl)


__all__ = ["DecodeMetadata", "PagedAttentionBackend", "SEQ_LEN_FILL_VALUE"]
