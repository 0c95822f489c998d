"""`GET /metrics` of `stepgraph serve`, in Prometheus text (``prometheus-client``): requests
running and waiting, KV pages free, prompt and generated tokens (counters, and generated
tokens per second over the last ``RATE_WINDOW_S``), TTFT and TPOT histograms, finished requests
by reason (stop, length, abort, error), the engine's steps (graph, eager, prefill) and the
prefix cache's queries and hits in prompt tokens (vLLM's ``prefix_cache_queries`` and
``prefix_cache_hits``: their ratio is the hit rate). Each
server has its own registry, so that several can live in one process (the tests). The engine
thread writes them; a scrape reads."""

from __future__ import annotations

import threading
import time
from collections import deque

RATE_WINDOW_S = 10.0
# seconds; TTFT from a few ms (a short prompt on an idle GPU) to many seconds under load
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# seconds per output token; from one request's GPU decode step to a loaded CPU
TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class TokenRate:
    """Tokens per second over the last ``window`` seconds (``time.perf_counter``) of ``add``
    calls; ``rate`` may be read from another thread."""

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self._events: deque[tuple[float, int]] = deque()
        self._sum = 0
        self._lock = threading.Lock()

    def add(self, n: int, now: float) -> None:
        with self._lock:
            if n:
                self._events.append((now, n))
                self._sum += n
            while self._events and self._events[0][0] <= now - self.window:
                self._sum -= self._events.popleft()[1]

    def rate(self, now: float | None = None) -> float:
        self.add(0, time.perf_counter() if now is None else now)
        return self._sum / self.window


class ServeMetrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.running = Gauge("stepgraph_requests_running", "requests decoding", registry=r)
        self.waiting = Gauge(
            "stepgraph_requests_waiting", "requests handed over, not yet admitted", registry=r
        )
        self.kv_pages_free = Gauge("stepgraph_kv_pages_free", "free KV cache pages", registry=r)
        self.kv_pages_total = Gauge(
            "stepgraph_kv_pages_total", "KV cache pages requests can hold", registry=r
        )
        self.prompt_tokens = Counter("stepgraph_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "stepgraph_generation_tokens", "tokens generated", registry=r
        )
        self.tokens_per_second = Gauge(
            "stepgraph_generation_tokens_per_second",
            f"tokens generated per second over the last {RATE_WINDOW_S:g} s",
            registry=r,
        )
        self.ttft = Histogram(
            "stepgraph_time_to_first_token_seconds",
            "request received to its first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "stepgraph_time_per_output_token_seconds",
            "mean gap between tokens after the first",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "stepgraph_prefix_cache_queries",
            "prompt tokens of admitted requests, looked up in the prefix cache",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "stepgraph_prefix_cache_hits",
            "prompt tokens served from the prefix cache",
            registry=r,
        )
        self.finished = Counter(
            "stepgraph_requests_finished", "requests ended, by reason", ["reason"], registry=r
        )
        self._rate = TokenRate()
        self.tokens_per_second.set_function(self._rate.rate)  # computed at each scrape
        self.engine_steps = Gauge(
            "stepgraph_engine_steps",
            "engine steps since start: decode replayed by a graph, "
            "decode run eagerly, packed prefill forwards",
            ["kind"],
            registry=r,
        )

    def watch(self, engine) -> None:
        """Read ``engine.stats`` at each scrape (plain ints; nothing on the engine's path)."""
        for kind, field in (
            ("graph", "graph_steps"),
            ("eager", "eager_steps"),
            ("prefill", "prefill_steps"),
        ):
            self.engine_steps.labels(kind).set_function(lambda f=field: getattr(engine.stats, f))

    def add_tokens(self, n: int, now: float) -> None:
        self.generation_tokens.inc(n)
        self._rate.add(n, now)

    def add_cache(self, queries: int, hits: int) -> None:
        """Count the engine's new prefix cache queries and hits (tokens)."""
        if queries > 0:
            self.prefix_cache_queries.inc(queries)
        if hits > 0:
            self.prefix_cache_hits.inc(hits)

    def publish(self, running: int, waiting: int, kv_free: int, kv_total: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_pages_free.set(kv_free)
        self.kv_pages_total.set(kv_total)

    def render(self) -> tuple[bytes, str]:
        """The text a scrape gets, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["RATE_WINDOW_S", "ServeMetrics", "TokenRate"]
