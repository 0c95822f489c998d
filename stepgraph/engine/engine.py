"""``Engine``: serves several requests at once on a ``ModelRunner``.

Each step admits waiting requests whose pages fit and that can start prefilling in this step's
budget (``scheduler.plan_admission``), prefills at most ``max_prefill_tokens`` of their prompt
tokens in one packed forward (``max_prefill_tokens_with_decode`` when the step also decodes; a
longer prompt is split across steps, each chunk attending to the ones before it through the
cache: ``scheduler.py``, ``prefill.py``), decodes
the requests that have a token to feed, through a graph when one holds the batch
(``decode.py``), and samples on the device (``Engine._launch``).

Overlapped (``overlap=True``, the default), a step launches all of that and returns at once
with the tokens of the step before, while the device runs this one; the next decode reads its
input ids from the device (``overlap.py``). Stop ids therefore take effect one step late, and
the token a finished request got in the step in flight is dropped. ``overlap=False`` waits for
each step's tokens (the synchronous loop; the same tokens).

    engine = Engine(ModelRunner.from_preset("tiny"))   # mode: exact on CUDA, eager on the CPU
    engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)   # -> [[...16 ids], [...16 ids]]
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ConfigError, ReplayError, StepGraphError
from ..model.model_runner import ModelRunner
from ..runner.base import raise_other_thread
from .cache_use import EngineCache
from .decode import DecodePath
from .offline import check_prompts, prefill_bar, seeded_generator
from .overlap import InFlight, PendingPages
from .phase_timer import PhaseTimer
from .prefill import build_prefiller, default_prefill, prefill_step
from .prefix_match import check_salt
from .requests import (
    DECODE_VIAS,
    GREEDY,
    MODES,
    PREFILLS,
    EngineStats,
    Request,
    Sampling,
    check_engine_args,
    check_min_tokens,
    check_prompt_ids,
    check_request,
    default_mode,
    own_sampling,
    running_limit,
    stop_id_set,
)
from .scheduler import (
    DEFAULT_MAX_PREFILL_TOKENS,
    DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODE,
    check_budget,
    plan_admission,
    step_prefill_budget,
)
from .step_tokens import StepTokens
from .tp_sync import ScheduleSync


class Engine:
    """Decode through the graph runner (``mode`` "graph" or "exact") or eagerly
    (``mode="eager"``, which never builds a runner). ``mode=None`` (default): the fastest mode
    that equals eager, "exact" on CUDA, "eager" on the CPU (``requests.default_mode``).
    ``runner_config`` defaults to ``RunnerConfig(max_bs=model_runner.max_bs)``; its ``mode`` is
    set from ``mode``.
    ``max_running`` (default and most: ``model_runner.max_bs``): requests running at once, the
    rows of a decode batch.

    ``prefill``: None (default) pads every prefill to a token bucket, from graphs in modes
    "graph" and "exact" ("graph"), eagerly in mode "eager" ("eager"): the same bits, so exact
    equals eager; or "unpadded", "piecewise" (``engine/prefill.py``; ``prefill_config``: their
    arguments). ``max_prefill_tokens``: the most prompt tokens one step prefills, chunked.
    ``max_prefill_tokens_with_decode`` (default 2048, vLLM's latency setting; None: no cap): the
    most a step that also decodes running requests prefills, so a prefill never stalls them for
    long (on the H200 about a few ms for the 1B model). ``decode_via``:
    "runner" (default, ``CudaGraphRunner``) or "configs" (``ConfigGraphRunner`` over the decode
    walk, buckets and backend from ``runner_config``; ``mode="graph"`` only).

    ``prefix_caching`` (default True): a request's prompt starts from the longest prefix of
    full pages already in the KV cache (``prefix_cache.py``; one cache per KV cache, shared by
    the engines over it), and only the rest is prefilled; finished requests leave their full
    pages cached until the pages are needed; a waiting request whose next uncached page another
    request is computing right now waits for it (``scheduler.plan_admission``). False: every
    prompt is prefilled whole."""

    def __init__(
        self,
        model_runner: ModelRunner,
        mode: str | None = None,
        runner_config: Any | None = None,
        *,
        max_running: int | None = None,
        prefill: str | None = None,
        decode_via: str = "runner",
        prefill_config: Any | None = None,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        max_prefill_tokens_with_decode: int | None = DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODE,
        overlap: bool = True,
        check_same_thread: bool = True,
        prefix_caching: bool = True,
    ) -> None:
        if not isinstance(prefix_caching, bool):
            raise ConfigError(f"prefix_caching must be True or False, got {prefix_caching!r}.")
        mode = default_mode(model_runner, decode_via) if mode is None else mode
        self.prefill = prefill = default_prefill(mode) if prefill is None else prefill  # resolved
        check_engine_args(mode, prefill, decode_via)
        check_budget(max_prefill_tokens)
        if max_prefill_tokens_with_decode is not None:
            check_budget(max_prefill_tokens_with_decode, "max_prefill_tokens_with_decode")
        self.max_prefill_tokens = max_prefill_tokens
        self.max_prefill_tokens_with_decode = max_prefill_tokens_with_decode
        self.model_runner = model_runner
        self.mode = mode
        self.decode_via = decode_via
        self.max_running = max_running  # None: model_runner.max_bs (``running_limit``)
        self.decoder = DecodePath(model_runner, mode, decode_via, runner_config)
        self.runner = self.decoder.runner  # CudaGraphRunner (decode_via="runner") or None
        self.config_runner = self.decoder.config_runner  # ConfigGraphRunner ("configs") or None
        self.prefiller = build_prefiller(self, prefill_config)
        self.stats = EngineStats()
        self._owner, self.check_same_thread = threading.current_thread(), check_same_thread
        self._ids = itertools.count()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self.overlap = overlap
        self._inflight: InFlight | None = None  # the step launched last, tokens on the device
        self._draining: list[Request] = []  # budget spent, the last token still in flight
        self.prefix_caching = prefix_caching
        self._cache = EngineCache(model_runner, prefix_caching)
        self.prefix_cache = self._cache.cache  # the KV cache's PrefixCache
        self._pending = PendingPages(self._cache.release)
        self._closed = False
        self._sync = ScheduleSync.for_model(model_runner)  # tensor parallel: rank 0 decides
        self._landed: list[tuple[int, int]] = []  # the last step's (id, token) pairs
        self._shared_gen = None if self._sync is None else torch.Generator(model_runner.device)
        if self._shared_gen is not None:
            self._shared_gen.manual_seed(self._sync.seed)
        self.timer = None
        self._tokens = StepTokens(model_runner)  # the sampling phase (step_tokens.py)

    @property
    def timer(self) -> PhaseTimer | None:
        """A ``PhaseTimer`` that records the host time of each step by phase
        (``phase_timer.py``); None (the default): the step makes no timer call."""
        return self._timer

    @timer.setter
    def timer(self, value: PhaseTimer | None) -> None:
        self._timer = self.decoder.timer = value

    @property
    def max_running(self) -> int | None:
        """The most requests running at once, so the most rows of a decode batch: at most the
        model runner's ``max_bs`` (its default; setting None restores it)."""
        return self._max_running

    @max_running.setter
    def max_running(self, value: int | None) -> None:
        self._max_running = running_limit(self.model_runner, value)

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
        min_tokens: int = 0,
        sampling: Sampling | None = None,
        seed: int | None = None,
        cache_salt: str | None = None,
    ) -> int:
        """Queue a request; its id keys ``finished``. ``ConfigError`` at once (and nothing
        queued) if it could never fit the KV cache; other requests are unaffected. It stops
        after ``max_new_tokens`` or at a sampled id in ``stop_ids`` or the checkpoint's
        ``eos_token_ids`` (the stop id is kept in the output, as transformers does), the stop
        ids only from its ``min_tokens``-th token on; ``ignore_eos`` drops the eos ids
        (``stop_ids`` still apply). ``sampling``: its own temperature and top-k instead of the
        step's, drawn from its own generator, seeded with ``seed`` (None: a random seed).
        ``cache_salt``: the request shares cached prompt pages only with requests that pass the
        same salt (None: with every request without one)."""
        self._check_thread("add_request")
        check_prompt_ids(prompt, "the prompt")  # before len(): text, a number
        what = f"request of {len(prompt)} prompt tokens"
        check_request(self.model_runner, prompt, max_new_tokens, what)
        check_min_tokens(min_tokens, max_new_tokens)
        check_salt(cache_salt)
        stops = self.stop_ids(stop_ids, ignore_eos)
        rid = next(self._ids)
        if seed is None and self._sync is not None:
            seed = self._sync.request_seed(rid)  # the same on every rank
        sampling, generator = own_sampling(sampling, seed, self.model_runner.device)
        self.waiting.append(
            Request(
                rid,
                list(prompt),
                max_new_tokens,
                stop_ids=stops,
                min_tokens=min_tokens,
                sampling=sampling,
                generator=generator,
                cache_salt=cache_salt,
            )
        )
        return rid

    def stop_ids(
        self, stop_ids: Sequence[int] | None = None, ignore_eos: bool = False
    ) -> frozenset[int]:
        """The ids that end a request: ``stop_ids`` plus, unless ``ignore_eos``, the model's
        ``eos_token_ids`` (from the checkpoint's config.json / generation_config.json)."""
        return stop_id_set(self.model_runner.config, stop_ids, ignore_eos)

    @property
    def has_unfinished(self) -> bool:
        """Requests wait or run, or a step's tokens have not landed yet."""
        return bool(self.waiting or self.running or self._draining or self._inflight)

    # -- steps -------------------------------------------------------------------------------

    def step(
        self, sampling: Sampling = GREEDY, generator: torch.Generator | None = None
    ) -> list[tuple[int, int]]:
        """Admit and prefill what fits, decode the running requests once; return the
        ``(request id, new token)`` pairs that reached the host. Overlapped (the default), that
        is the step before's tokens, while this one runs on the device; else this step's. Any
        exception (prefill, decode, sampling) first aborts every waiting and running request
        and frees its pages once the device is idle (``abort_all``), then propagates: a failed
        step leaks nothing."""
        self._check_thread("step")  # before the try: another thread's call aborts nothing
        stats, start, prefills = self.stats, time.perf_counter(), self.stats.prefill_steps
        try:
            out = self._step(sampling, generator)
        except BaseException:
            self.abort_all()
            raise
        stats.count_step(time.perf_counter() - start, prefills)  # prefilled, or decode only
        return out

    def _step(self, sampling: Sampling, generator: torch.Generator | None) -> list[tuple[int, int]]:
        timer = self._timer
        if timer is not None:
            timer.start()
        prev = self._inflight
        generator = generator if generator is not None else self._shared_gen
        for req in [r for r in self.running if r.scheduled >= r.max_new_tokens]:
            # its budget is spent (its last token still in flight): no later step touches its
            # pages, and its running slot is free now, as in the synchronous loop
            self.running.remove(req)
            self._draining.append(req)
            self._cache.insert(req)  # its written pages, cached before they are released
            self._pending.add(prev, req.pages)
            req.pages = []
        self._pending.reclaim(wait=bool(self.waiting))  # a waiting request may need them now
        step = self._launch(sampling, generator, prev)
        if not self.overlap:
            prev, step = step, None  # land this step's own tokens now
        self._inflight = step
        out = self._land(prev, step) if prev is not None else []
        self._pending.reclaim()  # what is already free goes back now (never blocks)
        self._landed = out
        if timer is not None:
            timer.mark("stop_checks")
            timer.end_step()
        return out

    def _launch(
        self, sampling: Sampling, generator: torch.Generator | None, prev: InFlight | None
    ) -> InFlight | None:
        """Admit, prefill one budget, decode once and sample, all on the device; the tokens
        stay there (``InFlight``). Nothing here waits for the device."""
        decoding = [r for r in self.running if 0 < r.scheduled < r.max_new_tokens]
        budget = step_prefill_budget(
            self.max_prefill_tokens, self.max_prefill_tokens_with_decode, bool(decoding)
        )
        self._admit(budget)
        timer = self._timer
        if timer is not None:
            timer.mark("admission")
        logits, rows = [], []
        # one packed forward of this step's chunks: requests whose prompt is now all cached
        prefilling = [r for r in self.running if r.prefilled < len(r.prompt)]
        first = prefill_step(self.prefiller, self.running, budget, self.stats)
        for req in prefilling:  # full prompt pages cached at once, as vLLM caches blocks:
            self._cache.insert(req)  # a later step that matches them reads after the writes
        if first is not None:
            rows, prefill_logits = first
            logits.append(prefill_logits)
        if timer is not None:
            timer.mark("prefill")
        if decoding:
            logits.append(self.decoder.logits(decoding, self.stats, prev))
            self.stats.decode_tokens += len(decoding)
            self.stats.batch_sizes[len(decoding)] += 1
        if not logits:
            return None
        rows += decoding
        host = self.decoder.host_tokens if decoding else None  # stored by the replay itself
        step = self._tokens.launch(logits, rows, len(decoding), sampling, generator, host)
        for req in rows:
            req.scheduled += 1
        if timer is not None:
            timer.mark("sampling")
        return step

    def _admit(self, budget: int) -> None:
        """Start the requests at the head of the queue that fit (``scheduler.plan_admission``):
        pages (each counting only those it must still allocate beyond its cached prefix),
        ``max_running``, what is left of this step's prefill ``budget`` after the running
        requests' chunks, and no page it could find cached being computed right now."""
        cache, count = self._cache, 0
        if self.waiting:  # nothing to plan otherwise: no walk over the running requests
            pending, computing = cache.prefilling(self.running)
            candidates = map(cache.candidate, self.waiting)  # lazily: the head, as far as it goes
            limits = cache.num_available, len(self.running), self.max_running, budget - pending
            count, _ = plan_admission(candidates, *limits, computing)
        if self._sync is not None:  # tensor parallel: rank 0's count on every rank
            rids = [r.rid for r in self.waiting], [r.rid for r in self.running]
            count = self._sync.admit(count, *rids, self._landed, cache.state())
        for _ in range(count):
            req = self.waiting.popleft()
            req.pages, req.cached_tokens = cache.reserve(req)
            req.prefilled = req.cached_tokens  # the prefill starts after the cached prefix
            self.stats.queried_tokens += len(req.prompt)
            self.stats.cached_tokens += req.cached_tokens
            self.running.append(req)
        if self.waiting and not self.running:
            head = self.waiting[0]
            raise ConfigError(
                f"request {head.rid} needs {cache.candidate(head).pages} pages but "
                f"only {cache.num_available} are free or evictable and nothing is running; "
                "pages are held outside this engine."
            )

    def _land(self, step: InFlight, after: InFlight | None) -> list[tuple[int, int]]:
        """Take ``step``'s tokens to the requests (``after``: the step launched since)."""
        out = []
        tokens = step.wait()
        if self._timer is not None:
            self._timer.mark("landing")
        for req, tok in zip(step.rows, tokens):
            if req.closed:  # finished or aborted before this token: dropped
                continue
            output = req.output
            output.append(tok)
            out.append((req.rid, tok))
            # Request.done, inline: the budget, else a stop id once min_tokens are out
            n = len(output)
            if n >= req.max_new_tokens or (tok in req.stop_ids and n >= req.min_tokens and n >= 1):
                self._close(req, after)
                self.finished[req.rid] = req
        self.stats.landed_tokens += len(out)
        return out

    def _close(self, req: Request, after: InFlight | None) -> None:
        """Stop ``req``; its pages go back once the step in flight (if it holds it) has run."""
        req.closed = True
        (self.running if req in self.running else self._draining).remove(req)
        in_flight = after is not None and req.rid in after.row_of
        self._cache.insert(req)  # before the release: the pages are still held
        self._pending.add(after if in_flight else None, req.pages)
        req.pages = []

    def abort(self, rid: int) -> bool:
        """Cancel request ``rid`` (waiting or running); its pages go back after the step in
        flight, the other requests run on. Return False if no such request is unfinished."""
        self._check_thread("abort")
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.closed = True
                return True
        for req in itertools.chain(self.running, self._draining):
            if req.rid == rid:
                self._close(req, self._inflight)
                self._pending.reclaim()
                return True
        return False

    def abort_all(self) -> list[int]:
        """Drop every waiting and running request and the step in flight, wait until the
        device is idle, then free every page; return their ids. Nothing of theirs is cached
        (after a fault their pages may hold anything) and the prefix cache drops every page
        nothing references, since a failed step may have written any page it reached: the KV
        cache is then as free as it was before any request was added."""
        everyone = list(itertools.chain(self.waiting, self.running, self._draining))
        for req in everyone:
            req.closed = True
            self._pending.add(None, req.pages)
            req.pages = []
        self.waiting.clear()
        self.running.clear()
        self._draining.clear()
        self._inflight = None
        if self.model_runner.device.type == "cuda":
            with contextlib.suppress(Exception):  # a faulted device may fail here too
                torch.cuda.synchronize(self.model_runner.device)
        self._pending.reclaim(wait=True)
        self.prefix_cache.clear()
        return [r.rid for r in everyone]

    def drain(self) -> list[tuple[int, int]]:
        """Land the step in flight and free every page it held; return its tokens."""
        step, self._inflight = self._inflight, None
        out = self._land(step, None) if step is not None else []
        self._pending.reclaim(wait=True)
        return out

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
        """New token ids of each prompt, in order, run to completion over the step loop. Every
        prompt is checked before any is queued: one that cannot fit raises ``ConfigError``
        naming it, and nothing runs. A prefill bar shows on stderr once prefill is slow."""
        self._check_thread("generate")
        check_prompts(self.model_runner, prompts, max_new_tokens)
        generator = seeded_generator(seed, self.model_runner.device)
        sampling = Sampling(temperature, top_k)  # checks them before anything is queued
        stops = dict(stop_ids=stop_ids, ignore_eos=ignore_eos)  # see add_request
        rids = [self.add_request(p, max_new_tokens, **stops) for p in prompts]
        bar = prefill_bar(sum(map(len, prompts)))
        try:
            while any(rid not in self.finished for rid in rids):
                st = self.stats
                prefilled, work = st.prefill_tokens, (st.decode_tokens, st.landed_tokens)
                self.step(sampling, generator)
                prefilled = st.prefill_tokens - prefilled
                if not prefilled and (st.decode_tokens, st.landed_tokens) == work:  # a spin
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
        self.drain()  # every page back before returning
        return [self.finished.pop(rid).output for rid in rids]

    def shutdown(self) -> None:
        """Release the graph runners and drop the prefix cache's unreferenced pages; any
        later step, request or generate raises."""
        self._closed = True
        self.prefix_cache.clear()
        self.decoder.shutdown()
        if self.prefiller is not self.model_runner:
            self.prefiller.shutdown()


__all__ = ["DECODE_VIAS", "Engine", "EngineStats", "MODES", "PREFILLS", "Request", "Sampling"]
