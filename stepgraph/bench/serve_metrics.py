"""The pure parts of `stepgraph bench --serve`: the random workload, the arrival schedule and the
serving metrics, as `vllm bench serve` defines them (no torch, no device).

- Workload (vLLM's random dataset): prompt lengths uniform in ``[floor(len*(1-r)),
  ceil(len*(1+r))]`` for a range ratio ``0 <= r < 1``, token ids uniform in the vocabulary. One
  difference: vLLM draws the output lengths from the same range; here every request generates
  exactly ``output_len`` tokens (eos ignored), so that the token counts are known in advance.
- Arrivals: all at t=0 for an infinite rate; else Poisson (exponential gaps) rescaled, as vLLM
  does, so that the last arrival lands at ``n / rate`` and the run's rate is exactly ``rate``.
- Per request: TTFT = first token - arrival; TPOT = (latency - TTFT) / (output tokens - 1),
  undefined (None, left out of the aggregate, as vLLM leaves it out) for one output token; ITL =
  every gap between consecutive tokens; E2E = last token - arrival.
- Aggregates: mean, std, median (p50), p90 and p99, percentiles linearly interpolated between
  the closest ranks (``numpy.percentile``'s default, as vLLM uses). An empty list gives None
  (vLLM prints 0), so that "no value" never reads as "zero milliseconds".
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """``[low, high]`` of vLLM's random dataset; the 1e-9 keeps ``576 * (1 - 7/9)`` at 128.

    >>> length_bounds(576, 7 / 9)
    (128, 1024)
    """
    low = math.floor(length * (1 - range_ratio) + 1e-9)
    high = math.ceil(length * (1 + range_ratio) - 1e-9)
    return max(low, 1), max(high, 1)


def random_prompts(
    num: int, input_len: int, range_ratio: float, vocab_size: int, seed: int
) -> list[list[int]]:
    """``num`` prompts of random ids in ``[0, vocab_size)``, lengths from ``length_bounds``."""
    rng = random.Random(seed)
    low, high = length_bounds(input_len, range_ratio)
    lengths = [rng.randint(low, high) for _ in range(num)]
    ids = range(vocab_size)
    return [rng.choices(ids, k=n) for n in lengths]


def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each of ``num`` requests arrives, non-decreasing."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(f"{seed}:arrivals")  # apart from the prompts': a rate leaves them alone
    times, t = [], 0.0
    for _ in range(num):
        t += rng.expovariate(rate)
        times.append(t)
    scale = num / rate / times[-1]  # vLLM's rescaling: the last arrival at exactly num / rate
    return [x * scale for x in times]


@dataclass
class RequestTiming:
    """One request's host timestamps (``time.perf_counter`` seconds)."""

    arrival: float
    input_len: int
    token_times: list[float] = field(default_factory=list)  # right after the step of each token

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean gap after the first token; None for a request of one token."""
        n = len(self.token_times)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def percentile(values: Sequence[float], p: float) -> float | None:
    """``numpy.percentile(values, p)`` (linear interpolation); None for no values.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([1.0, 2.0, 3.0, 4.0], 99)
    (2.5, 3.97)
    """
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary_ms(seconds: Sequence[float]) -> dict[str, float | None]:
    """mean, std, median and p90/p99 of ``seconds``, in milliseconds (None when empty)."""
    ms = [s * 1e3 for s in seconds]
    out: dict[str, float | None] = {
        "mean": statistics.fmean(ms) if ms else None,
        "std": statistics.pstdev(ms) if ms else None,
        "median": percentile(ms, 50),
    }
    out.update({f"p{p}": percentile(ms, p) for p in PERCENTILES if p != 50})
    return out


def serving_metrics(requests: Sequence[RequestTiming], duration_s: float) -> dict:
    """vLLM's result keys: counts, throughputs, and ``{mean,std,median,p90,p99}_{ttft,tpot,itl,
    e2el}_ms``; ``duration`` in seconds."""
    done = [r for r in requests if r.token_times]
    n_in = sum(r.input_len for r in done)
    n_out = sum(len(r.token_times) for r in done)
    out: dict = {
        "completed": len(done),
        "duration": duration_s,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(done) / duration_s,
        "output_throughput": n_out / duration_s,
        "total_token_throughput": (n_in + n_out) / duration_s,
    }
    per_request = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [x for r in done for x in r.itls],
        "e2el": [r.e2e for r in done],
    }
    for name, seconds in per_request.items():
        for stat, value in summary_ms(seconds).items():
            out[f"{stat}_{name}_ms"] = value
    return out


@dataclass(frozen=True)
class StepRecord:
    """One ``engine.step()``: when it ended, its wall time (since the previous step ended, which
    is what a decoding request waits between tokens; since the call, after an idle wait), its
    first tokens and decode tokens, and whether it was decode only: no request was waiting for
    its prefill, or the running batch was full so that none could be admitted."""

    end: float
    seconds: float
    first_tokens: int  # requests whose prefill finished in this step
    decode_tokens: int  # requests that already had a token: the decode batch
    decode_only: bool


def used_batch_sizes(steps: Sequence[StepRecord]) -> list[int]:
    """The smallest, median (the lower one: a size the run used) and largest decode batch."""
    sizes = sorted(s.decode_tokens for s in steps if s.decode_tokens)
    if not sizes:
        return []
    return sorted({sizes[0], sizes[(len(sizes) - 1) // 2], sizes[-1]})


def decode_step_ms(steps: Sequence[StepRecord], bs: int) -> tuple[float | None, int]:
    """Median ms of the decode-only steps of batch ``bs``: the ITL a request sees in steady
    decode, host work between steps included. Returns (ms or None, steps counted)."""
    times = [s.seconds * 1e3 for s in steps if s.decode_tokens == bs and s.decode_only]
    return (statistics.median(times) if times else None), len(times)


__all__ = [
    "PERCENTILES",
    "RequestTiming",
    "StepRecord",
    "arrival_times",
    "decode_step_ms",
    "length_bounds",
    "percentile",
    "random_prompts",
    "serving_metrics",
    "summary_ms",
    "used_batch_sizes",
]
