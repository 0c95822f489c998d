"""The bandwidth floor of a decode step: the bytes it must read (the weights and the live KV)
over the bandwidth of a read-only stream measured in the same run (``timing.read_bandwidth``),
and the same bytes over the GPU's specification bandwidth, side by side.

A decode step reads far more than it writes, so a read-only stream bounds it; a device-to-device
copy (read plus write) does not, and a step could show more than 100% of a copy's floor."""

from __future__ import annotations

import re
from dataclasses import dataclass

# HBM bandwidth of the vendor's specification, GB/s, by a pattern of torch.cuda.get_device_name()
# (lower case); the first match wins, so the narrower names come first. GH200 and other names
# with more than one memory configuration are left out: their column says "–".
SPEC_GBPS: tuple[tuple[str, float], ...] = (
    (r"\bh200\b", 4800.0),  # H200 SXM and NVL: 141 GB HBM3e
    (r"\bh100\b.*\bpcie\b", 2000.0),
    (r"\bh100\b.*\bnvl\b", 3900.0),
    (r"\bh100\b", 3350.0),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    (r"\bh800\b", 3350.0),
    (r"\bb200\b", 8000.0),
    (r"\ba100\b.*80gb.*\bpcie\b", 1935.0),
    (r"\ba100-sxm4-80gb\b", 2039.0),
    (r"\ba100\b.*40gb", 1555.0),
    (r"\bl40s\b", 864.0),
)
NO_SPEC = "–"  # the spec column of a GPU not in SPEC_GBPS


def spec_gbps(device_name: str) -> float | None:
    """The specification bandwidth of the GPU called ``device_name``, GB/s; None if unknown."""
    name = device_name.lower()
    for pattern, gbps in SPEC_GBPS:
        if re.search(pattern, name):
            return gbps
    return None


def floor_ms(nbytes: int, gbps: float) -> float:
    """Milliseconds to read ``nbytes`` at ``gbps`` GB/s."""
    return nbytes / (gbps * 1e9) * 1e3


def share(floor: float | None, ms: float | None) -> float | None:
    """``floor / ms``: 1.0 is a step at its floor. None where either is unknown."""
    return floor / ms if floor and ms else None


@dataclass(frozen=True)
class Bandwidth:
    """What one bench run divides by: the read stream's GB/s (the floor), the copy's (reported
    only), the specification's (None for an unknown GPU) and the GPU's name."""

    read_gbps: float
    spec_gbps: float | None
    gpu: str
    copy_gbps: float | None = None

    def floor_ms(self, nbytes: int) -> float:
        return floor_ms(nbytes, self.read_gbps)

    def spec_ms(self, nbytes: int) -> float | None:
        return floor_ms(nbytes, self.spec_gbps) if self.spec_gbps else None

    def header(self) -> str:
        spec = f"{self.spec_gbps:.0f} GB/s" if self.spec_gbps else f"{NO_SPEC} (unknown GPU)"
        copy = f"; copy {self.copy_gbps:.0f} GB/s (read + write)" if self.copy_gbps else ""
        return (
            f"{self.gpu}: read stream {self.read_gbps:.0f} GB/s{copy}; specification {spec}\n"
            "floor = (weights + live KV) / read stream; of spec = the same bytes at the "
            "specification bandwidth"
        )


__all__ = ["Bandwidth", "NO_SPEC", "SPEC_GBPS", "floor_ms", "share", "spec_gbps"]
