"""``Fp8Weight``: a projection's weight in FP8 (e4m3) with its float32 scales, and quantization
of a bf16 / float16 / float32 weight on load.

A weight ``[N, K]`` is stored as ``data`` (``torch.float8_e4m3fn``) and ``scale`` (float32):
- per output channel: ``scale [N]``, ``W[n, k] = data[n, k] * scale[n]``;
- per block ``(bn, bk)`` (Hugging Face's fine-grained FP8: 128 x 128): ``scale [ceil(N / bn),
  ceil(K / bk)]``, ``W[n, k] = data[n, k] * scale[n // bn, k // bk]`` (the last, partial blocks
  of N and K take their block's scale).
The kernels (``kernels/proj/fp8_gemv``) apply the scale in registers; ``dequantize`` is the
reference (tests, the CPU path), never a copy that stays in memory on the device.

``quantize_per_channel`` is what vLLM's ``fp8`` method does to a bf16 checkpoint on load:
``scale[n] = amax(|W[n, :]|) / 448`` (448 is e4m3's largest finite value), ``data = W / scale``
rounded to nearest and clamped to +-448. A row of zeros gets scale 1 (its data is all zeros,
so any finite scale dequantizes to the same zeros; 1 keeps the scale a plain number). A row
whose amax / 448 underflows float32 (|W| below about 5e-36) takes scale 1 too: it quantizes to
zeros, an absolute error below 5e-36. Non-finite weights are refused: no scale is ever NaN,
infinite or zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value
# The largest scale whose dequantized weights stay finite in float32: 448 * scale <= FLT_MAX.
MAX_SCALE = torch.finfo(torch.float32).max / E4M3_MAX


def block_grid(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    """The shape of a block-scale tensor: ``(ceil(n / bn), ceil(k / bk))``."""
    return -(-n // block[0]), -(-k // block[1])


def scale_shape(n: int, k: int, block: tuple[int, int] | None) -> tuple[int, ...]:
    """``(n,)`` per channel, else ``block_grid``."""
    return (n,) if block is None else block_grid(n, k, block)


def check_scale_values(scale: torch.Tensor, where: str) -> None:
    """ConfigError naming ``where`` when a scale is NaN, infinite, or so large that 448 times it
    overflows float32 (> ``MAX_SCALE``): such a weight could only dequantize to inf or NaN."""
    s = scale.detach().double()
    if not torch.isfinite(s).all():
        bad = "NaN" if torch.isnan(s).any() else "inf"
        raise ConfigError(f"{where}: a scale is {bad}; the checkpoint is corrupt: re-export it")
    if s.numel() and s.abs().max().item() > MAX_SCALE:
        raise ConfigError(
            f"{where}: a scale of {s.abs().max().item():.3g} exceeds {MAX_SCALE:.4g} (448 times "
            "it overflows float32); the checkpoint is corrupt: re-export it"
        )


@dataclass(frozen=True)
class Fp8Weight:
    """One ``[N, K]`` weight in e4m3 with float32 scales per channel (``block=None``) or per
    ``block = (bn, bk)``. Checked when built: a mismatch is a ConfigError."""

    data: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # float32 [N], or [ceil(N / bn), ceil(K / bk)]
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.data.dtype != FP8_DTYPE or self.data.dim() != 2:
            raise ConfigError(
                f"Fp8Weight.data must be a 2-D torch.float8_e4m3fn tensor; got "
                f"{self.data.dtype} of shape {tuple(self.data.shape)}"
            )
        if self.block is not None:
            block = tuple(int(b) for b in self.block)
            if len(block) != 2 or min(block) < 1:
                raise ConfigError(f"Fp8Weight.block must be two positive sizes; got {self.block}")
            object.__setattr__(self, "block", block)
        want = scale_shape(*self.data.shape, self.block)
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != want:
            raise ConfigError(
                f"Fp8Weight.scale must be float32 of shape {want} for a "
                f"{tuple(self.data.shape)} weight ({self.kind}); got {self.scale.dtype} of "
                f"shape {tuple(self.scale.shape)}"
            )
        if self.scale.device != self.data.device:
            raise ConfigError(
                f"Fp8Weight: data on {self.data.device}, scale on {self.scale.device}"
            )

    @property
    def kind(self) -> str:
        """``"per channel"`` or ``"per 128x128 block"``."""
        return "per channel" if self.block is None else f"per {self.block[0]}x{self.block[1]} block"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        """Bytes a step reads: the e4m3 data and the scales."""
        return self.data.numel() + 4 * self.scale.numel()

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.data.to(device), self.scale.to(device), self.block)

    def expanded_scale(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The scale of every element, ``[N, K]`` (per channel: ``[N, 1]``, broadcasting)."""
        s = self.scale.to(dtype)
        if self.block is None:
            return s[:, None]
        n, k = self.data.shape
        bn, bk = self.block
        return s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale`` in ``dtype`` (float32 by default; float64 for references)."""
        return self.data.to(dtype) * self.expanded_scale(dtype)


def _finite_float(w: torch.Tensor, what: str) -> torch.Tensor:
    if w.dim() != 2 or not w.is_floating_point() or w.dtype == FP8_DTYPE:
        raise ConfigError(
            f"{what}: expected a 2-D bfloat16, float16 or float32 weight; got {w.dtype} of "
            f"shape {tuple(w.shape)}"
        )
    w = w.detach().float()
    if not torch.isfinite(w).all():
        raise ConfigError(f"{what}: the weight holds NaN or inf; it cannot be quantized")
    return w


def _to_e4m3(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def _safe(scale: torch.Tensor) -> torch.Tensor:
    # zero rows / blocks, and amax / 448 underflowing to 0: scale 1 (the data is all zeros)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_per_channel(w: torch.Tensor, what: str = "weight") -> Fp8Weight:
    """``w [N, K]`` in e4m3 with one scale per row, ``amax / 448`` (see the module's note on
    zero rows). Each element's error: at most ``|w| / 16`` (3 mantissa bits, rounding to
    nearest), or ``scale / 1024`` where it falls among e4m3's subnormals."""
    wf = _finite_float(w, what)
    scale = _safe(wf.abs().amax(dim=1) / E4M3_MAX)
    return Fp8Weight(_to_e4m3(wf, scale[:, None]), scale.contiguous())


def quantize_per_block(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), what: str = "weight"
) -> Fp8Weight:
    """``w [N, K]`` in e4m3 with one scale per ``block`` (Hugging Face's fine-grained FP8
    layout: its ``weight_scale_inv``), ``amax / 448`` of each block."""
    wf = _finite_float(w, what)
    n, k = wf.shape
    bn, bk = block
    gn, gk = block_grid(n, k, block)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32, device=wf.device)
    padded[:n, :k] = wf.abs()
    amax = padded.view(gn, bn, gk, bk).amax(dim=(1, 3))
    scale = _safe(amax / E4M3_MAX).contiguous()
    grid = Fp8Weight(torch.zeros(n, k, dtype=FP8_DTYPE, device=wf.device), scale, (bn, bk))
    return Fp8Weight(_to_e4m3(wf, grid.expanded_scale()), scale, (bn, bk))


def concat_rows(parts: list[Fp8Weight], what: str = "weight") -> Fp8Weight:
    """The weights of ``parts`` stacked on the output dim (fused q/k/v, gate/up), one format.
    Block scales stack only where every part but the last fills whole row blocks."""
    if not parts:
        raise ConfigError(f"{what}: nothing to concatenate")
    kinds = {(p.block, p.shape[1]) for p in parts}
    if len(kinds) != 1:
        raise ConfigError(
            f"{what}: parts differ in scale layout or K: "
            f"{[(p.kind, tuple(p.shape)) for p in parts]}; they must share one"
        )
    block = parts[0].block
    if block is not None and any(p.shape[0] % block[0] for p in parts[:-1]):
        raise ConfigError(
            f"{what}: output sizes {[p.shape[0] for p in parts]} are not multiples of the "
            f"{block[0]}-row scale blocks, so their block scales cannot be stacked"
        )
    data = torch.cat([p.data for p in parts])
    return Fp8Weight(data, torch.cat([p.scale for p in parts]).contiguous(), block)


__all__ = [
    "E4M3_MAX",
    "FP8_DTYPE",
    "Fp8Weight",
    "MAX_SCALE",
    "block_grid",
    "check_scale_values",
    "concat_rows",
    "quantize_per_block",
    "quantize_per_channel",
    "scale_shape",
]
