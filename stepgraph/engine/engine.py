"""``Engine``: serves several requests at once on a ``ModelRunner``.

Each step admits waiting requests whose pages fit, prefills at most ``max_prefill_tokens`` of
their prompt tokens as one packed forward (``ModelRunner.extend``, or ``PiecewisePrefill`` with
``prefill="piecewise"``; a prompt longer than what is left of the budget is split across steps,
each chunk attending to the ones before it through the cache: ``scheduler.py``), then runs one
decode step of the requests that have a token to feed: through the graph runner when it can
take the batch, else eagerly (``decode.py``). Sampling (greedy, or temperature + top-k with a
seeded generator) runs on the device outside the graph; the one host sync per step reads the
chosen ids.

    engine = Engine(ModelRunner.from_preset("tiny"), mode="graph")
    engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)   # -> [[...16 ids], [...16 ids]]
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import ConfigError, ReplayError, StepGraphError
from ..model.model_runner import ModelRunner
from ..runner.base import raise_other_thread
from .decode import DecodePath
from .prefill import prefill_step
from .requests import (
    DECODE_VIAS,
    GREEDY,
    MODES,
    PREFILLS,
    EngineStats,
    Request,
    Sampling,
    check_engine_args,
    check_request,
    stop_id_set,
)
from .scheduler import DEFAULT_MAX_PREFILL_TOKENS, admit_count, check_budget

PREFILL_PROGRESS_DELAY_S = 2.0  # generate() shows a prefill bar once prefill takes this long


class Engine:
    """Decode through the graph runner (``mode`` "graph" or "exact") or eagerly
    (``mode="eager"``, which never builds a runner). ``runner_config`` defaults to
    ``RunnerConfig(max_bs=model_runner.max_bs)``; its ``mode`` is set from ``mode``.

    ``prefill``: "eager" (default) or "piecewise" (``PiecewisePrefill`` with
    ``prefill_config``, default ``PrefillShapes()``). ``max_prefill_tokens``: the most prompt
    tokens one step prefills; longer prompts are chunked across steps. ``decode_via``:
    "runner" (default, ``CudaGraphRunner``) or "configs" (``ConfigGraphRunner`` over the decode
    walk, buckets and backend from ``runner_config``; ``mode="graph"`` only)."""

    def __init__(
        self,
        model_runner: ModelRunner,
        mode: str = "eager",
        runner_config: Any | None = None,
        *,
        max_running: int | None = None,
        prefill: str = "eager",
        decode_via: str = "runner",
        prefill_config: Any | None = None,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        check_same_thread: bool = True,
    ) -> None:
        check_engine_args(mode, prefill, decode_via, max_running)
        check_budget(max_prefill_tokens)
        self.max_prefill_tokens = max_prefill_tokens
        self.model_runner = model_runner
        self.mode = mode
        self.decode_via = decode_via
        self.max_running = max_running
        self.decoder = DecodePath(model_runner, mode, decode_via, runner_config)
        self.runner = self.decoder.runner  # CudaGraphRunner (decode_via="runner") or None
        self.config_runner = self.decoder.config_runner  # ConfigGraphRunner ("configs") or None
        self.prefiller: Any = model_runner  # anything with extend(chunks) -> logits
        if prefill == "piecewise":
            from ..model.piecewise_prefill import PiecewisePrefill

            self.prefiller = PiecewisePrefill(model_runner, prefill_config)
        self.stats = EngineStats()
        self._owner, self.check_same_thread = threading.current_thread(), check_same_thread
        self._ids = itertools.count()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self._closed = False

    @property
    def check_same_thread(self) -> bool:
        """Refuse other threads' calls (``ReplayError``); False, set only where you serialize
        calls yourself, applies to the engine's runners too (``runner/base.py``)."""
        return self._check_same_thread

    @check_same_thread.setter
    def check_same_thread(self, value: bool) -> None:
        self._check_same_thread = value
        prefill_runners = getattr(self.prefiller, "runners", [])  # PiecewisePrefill's
        for r in (self.runner, self.config_runner, *prefill_runners):
            if r is not None:
                r.check_same_thread = value

    def _check_thread(self, what: str) -> None:
        if self._closed:
            raise ReplayError(
                f"Engine.{what} after shutdown(): its graph runners are released; build a new "
                "Engine."
            )
        if self._check_same_thread and threading.current_thread() is not self._owner:
            raise_other_thread(self, what, self._owner)

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        stop_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
    ) -> int:
        """Queue a request; its id keys ``finished``. ``ConfigError`` at once (and nothing
        queued) if it could never fit the KV cache; other requests are unaffected. It stops
        after ``max_new_tokens`` or at a sampled id in ``stop_ids`` or the checkpoint's
        ``eos_token_ids`` (the stop id is kept in the output, as transformers does);
        ``ignore_eos`` drops the eos ids (``stop_ids`` still apply)."""
        self._check_thread("add_request")
        what = f"request of {len(prompt)} prompt tokens"
        check_request(self.model_runner, prompt, max_new_tokens, what)
        stops = self.stop_ids(stop_ids, ignore_eos)
        rid = next(self._ids)
        self.waiting.append(Request(rid, list(prompt), max_new_tokens, stop_ids=stops))
        return rid

    def stop_ids(
        self, stop_ids: Sequence[int] | None = None, ignore_eos: bool = False
    ) -> frozenset[int]:
        """The ids that end a request: ``stop_ids`` plus, unless ``ignore_eos``, the model's
        ``eos_token_ids`` (from the checkpoint's config.json / generation_config.json)."""
        return stop_id_set(self.model_runner.config, stop_ids, ignore_eos)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- steps -------------------------------------------------------------------------------

    def _admit(self) -> None:
        kv = self.model_runner.kv_cache
        needs = (kv.pages_for(r.kv_tokens) for r in self.waiting)
        for _ in range(
            admit_count(needs, kv.allocator.num_free, len(self.running), self.max_running)
        ):
            req = self.waiting.popleft()
            req.pages = kv.reserve(req.kv_tokens)
            self.running.append(req)
        if self.waiting and not self.running:
            raise ConfigError(
                f"request {self.waiting[0].rid} needs {kv.pages_for(self.waiting[0].kv_tokens)} "
                f"pages but only {kv.allocator.num_free} are free and nothing is running; pages "
                "are held outside this engine."
            )

    def step(
        self, sampling: Sampling = GREEDY, generator: torch.Generator | None = None
    ) -> list[tuple[int, int]]:
        """Admit and prefill what fits, decode the running requests once; return the
        ``(request id, new token)`` pairs of this step. Any exception (prefill, decode,
        sampling) first aborts every waiting and running request and frees its pages
        (``abort_all``), then propagates: a failed step leaks nothing."""
        self._check_thread("step")  # before the try: another thread's call aborts nothing
        try:
            return self._step(sampling, generator)
        except BaseException:
            self.abort_all()
            raise

    def abort_all(self) -> list[int]:
        """Drop every waiting and running request and free its pages; return their ids.
        The KV cache is then as free as it was before they were added."""
        dropped = [r.rid for r in itertools.chain(self.waiting, self.running)]
        pages = [p for r in self.running for p in r.pages]
        self.waiting.clear()
        self.running.clear()
        if pages:
            self.model_runner.kv_cache.release(pages)
        return dropped

    def _step(self, sampling: Sampling, generator: torch.Generator | None) -> list[tuple[int, int]]:
        decoding = [r for r in self.running if r.output]  # requests that have a token to feed
        self._admit()
        logits, sampled = [], []
        # one packed forward of this step's chunks: requests whose prompt is now all cached
        first = prefill_step(self.prefiller, self.running, self.max_prefill_tokens, self.stats)
        if first is not None:
            sampled, rows = first
            logits.append(rows)
        if decoding:
            logits.append(self.decoder.logits(decoding, self.stats))
            self.stats.decode_tokens += len(decoding)
            self.stats.batch_sizes[len(decoding)] += 1
        if not logits:
            return []
        tokens = sampling.sample(torch.cat(logits), generator).tolist()  # the one host sync
        out = []
        for req, tok in zip(sampled + decoding, tokens):
            req.output.append(tok)
            out.append((req.rid, tok))
            if req.done:
                self._finish(req)
        return out

    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        self.model_runner.kv_cache.release(req.pages)
        req.pages = []
        self.finished[req.rid] = req

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int | None = None,
        stop_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
    ) -> list[list[int]]:
        """New token ids of each prompt, in order. Every prompt is checked before any is
        queued: one that cannot fit raises ``ConfigError`` naming it, and nothing runs."""
        self._check_thread("generate")
        for i, p in enumerate(prompts):
            check_request(self.model_runner, p, max_new_tokens, f"prompt {i} ({len(p)} tokens)")
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.model_runner.device).manual_seed(seed)
        sampling = Sampling(temperature, top_k)  # checks them before anything is queued
        stops = dict(stop_ids=stop_ids, ignore_eos=ignore_eos)  # see add_request
        rids = [self.add_request(p, max_new_tokens, **stops) for p in prompts]
        # a bar on stderr once prefill has taken PREFILL_PROGRESS_DELAY_S (stdout stays clean)
        bar = tqdm(
            total=sum(map(len, prompts)), desc="prefill", unit="tok", file=sys.stderr,
            delay=PREFILL_PROGRESS_DELAY_S, leave=False,
        )  # fmt: skip
        try:
            while any(rid not in self.finished for rid in rids):
                prefilled, decoded = self.stats.prefill_tokens, self.stats.decode_tokens
                self.step(sampling, generator)
                prefilled = self.stats.prefill_tokens - prefilled
                if not prefilled and self.stats.decode_tokens == decoded:  # looping would spin
                    raise StepGraphError(
                        f"requests {[r for r in rids if r not in self.finished]} were dropped "
                        "while generating (abort_all from another caller?); nothing is left "
                        "to run. Call generate again."
                    )
                bar.update(min(prefilled, bar.total - bar.n))
        except BaseException:
            self.abort_all()  # step already did on its own faults; add_request may have run
            for rid in rids:
                self.finished.pop(rid, None)
            raise
        finally:
            bar.close()
        return [self.finished.pop(rid).output for rid in rids]

    def shutdown(self) -> None:
        """Release the graph runners; any later step, request or generate raises."""
        self._closed = True
        self.decoder.shutdown()
        if self.prefiller is not self.model_runner:
            self.prefiller.shutdown()


__all__ = ["DECODE_VIAS", "Engine", "EngineStats", "MODES", "PREFILLS", "Request", "Sampling"]
