"""A load generator for `stepgraph serve` that speaks the OpenAI API (httpx, streamed
``/v1/completions``), at concurrency 1, 16 and 64, measured as `vllm bench serve` measures
(``stepgraph.bench.serve_metrics``): TTFT, TPOT and ITL (p50, p99) and output tokens/s.

    python benchmarks/serve_load.py --launch --model llama-3.2-1b        # starts the server
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model tiny
    python benchmarks/serve_load.py --launch --model tiny --device cpu --quick   # smoke test

The workloads are `stepgraph bench --serve`'s, so that the figures compare with the engine's
offline ones: concurrency 1 runs its latency case (512 prompt tokens, 256 new, one request at
a time); 16 and 64 run its 64 seeded requests (prompts of 128-1024 tokens, 128 new, eos
ignored) with at most that many in flight (vLLM's ``--max-concurrency``). A request's clock
starts when it is sent; a chunk's tokens are stamped when it arrives. The requests go over
kept-alive connections of the script's own (``--client raw``; ``--client httpx``: httpx's pool,
which on the CPU box sent 64 requests at once over up to 0.24 s instead of 16 ms). Before the
clock starts both workloads run once untimed (first-use compiles: Triton compiles a prefill
kernel variant in ~800 ms on the H200). Each use of a workload sends its prompt lengths with
fresh token ids: a caching server would otherwise serve the rehearsal's prompts from its
prefix cache (an H100 run that did measured a 2.7 ms TTFT at concurrency 1 and 131% of the
offline throughput at 64); each level's hit rate is reported. Beside each level: the server's
own TPOT (its stamps as the engine's tokens reach it, ``/metrics``), so that HTTP's share
shows, its engine steps (graph, eager, prefill) and the longest gap between two tokens of a
request (a stall shows there), with where it fell: the request and token, its time into the
level, how many other requests were decoding across it and got no token in it (all of them:
the engine, the server or this script paused), which requests got their first token at its
end (a prefill ran in it) and which waited for one across it, with their prompt tokens, and
how long this script's own event loop paused inside it (a task that wakes every ms records
each wake-up more than 5 ms late). The JSON keeps every request's TTFT and longest gap.

``--max-prefill-tokens-with-decode 2048,1024,512`` (with ``--launch``) serves once per value
(the server's flag of that name: the prompt tokens a step that also decodes prefills, at most;
0: no cap) and reports each run and a table of ITL p99 and the longest gap by value, in one
call.

``--launch`` runs the server as another process (`python -m stepgraph serve`, ``--engine``
passed on: the engine in a process of its own, or a thread), stops it with SIGTERM at the end,
and reports its exit status and whether its engine process is gone. ``--offline`` then runs
`stepgraph bench --serve --peers none` on the same model (the engine alone, the same 64
requests) and reports each level's output tokens/s as a share of that offline figure.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import httpx

from stepgraph.bench.serve_metrics import RequestTiming, random_prompts, serving_metrics

VOCAB = {
    "tiny": 512,
    "tiny-qwen2": 512,
    "llama-3.2-1b": 128256,
    "qwen2.5-0.5b": 151936,
    "llama-3.1-8b": 128256,
}
LATENCY_IN, LATENCY_OUT, LATENCY_REQUESTS = 512, 256, 4
MAIN_REQUESTS, MAIN_IN, MAIN_RATIO, MAIN_OUT = 64, 576, 7 / 9, 128  # prompts of 128-1024


def launch(args, cap: int | None = None) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(serve_command(args, cap), stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        sys.stderr.write(line)
        m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        if m:
            return proc, f"http://127.0.0.1:{m.group(1)}"
    raise SystemExit(f"the server exited with status {proc.wait()} before it served")


def serve_command(args, cap: int | None = None) -> list[str]:
    """`stepgraph serve`'s command line for ``--launch`` (``cap``: its prefill cap on steps
    that decode, where given)."""
    cmd = [
        sys.executable,
        "-m",
        "stepgraph",
        "serve",
        "--model",
        args.model,
        "--port",
        "0",
        "--max-running",
        str(args.max_running),
        "--max-context",
        str(args.max_context),
        "--mode",
        args.mode,
        "--engine",
        args.engine,
    ]
    if args.device:
        cmd += ["--device", args.device]
    if cap is not None:
        cmd += ["--max-prefill-tokens-with-decode", str(cap)]
    return cmd


def wait_healthy(url: str, timeout: float = 600.0) -> int | None:
    """Wait for /health to answer 200; the server's engine process id (None: a thread)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200:
                return r.json().get("engine_pid")
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url}/health did not answer 200 within {timeout:.0f} s")


def gone(pid: int | None) -> bool:
    """No such process (or only its zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, TypeError):
        return True


def offline(args) -> float:
    """`stepgraph bench --serve`'s output tokens/s on this model: the engine alone."""
    path = f"/tmp/serve_load_offline_{os.getpid()}.json"
    cmd = [
        sys.executable,
        "-m",
        "stepgraph",
        "bench",
        "--serve",
        "--peers",
        "none",
        "--model",
        args.model,
        "--max-running",
        str(args.max_running),
        "--json",
        path,
    ]
    if args.device:
        cmd += ["--device", args.device]
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    with open(path) as f:
        return json.load(f)["metrics"]["output_throughput"]


SCRAPED = {
    "tpot_sum": "stepgraph_time_per_output_token_seconds_sum",
    "tpot_count": "stepgraph_time_per_output_token_seconds_count",
    "prefix_queries": "stepgraph_prefix_cache_queries_total",
    "prefix_hits": "stepgraph_prefix_cache_hits_total",
    "graph_steps": 'stepgraph_engine_steps{kind="graph"}',
    "eager_steps": 'stepgraph_engine_steps{kind="eager"}',
    "prefill_steps": 'stepgraph_engine_steps{kind="prefill"}',
}


async def scrape(client, url: str) -> dict[str, float]:
    """The server's figures in ``SCRAPED`` from /metrics (0 where absent)."""
    text = (await client.get(url + "/metrics")).text
    out = {}
    for key, name in SCRAPED.items():
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        out[key] = float(m.group(1)) if m else 0.0
    return out


def request_body(model: str, prompt: list[int], max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
        }
    ).encode()


def take_event(data: bytes, ids: list[int], timing: RequestTiming, now: float) -> bool:
    """One server-sent event's tokens into ``ids`` (stamped ``now``); True at ``[DONE]``."""
    if not data.startswith(b"data: "):
        return False
    if data == b"data: [DONE]":
        return True
    chunk = json.loads(data[6:])
    if "error" in chunk:
        raise SystemExit(f"stream error: {chunk['error']}")
    new = chunk["choices"][0].get("token_ids", [])
    ids += new
    timing.token_times += [now] * len(new)
    return False


class RawClient:
    """Keep-alive HTTP/1.1 connections of the load generator's own (``--client raw``, the
    default): a streamed POST written at once, its chunked events read as they come. httpx's
    pool hands requests to its kept-alive connections late when 64 start at once (on the CPU
    box: first response headers up to 0.8 s after the request, against 21 ms with these), which
    spreads the arrivals the server sees."""

    def __init__(self, url: str) -> None:
        host, _, port = url.split("//", 1)[1].partition(":")
        self.host, self.port, self.idle = host, int(port or 80), []

    async def _conn(self, fresh: bool = False):
        if self.idle and not fresh:
            return self.idle.pop()
        return await asyncio.open_connection(self.host, self.port)

    async def one(self, body: bytes, timing: RequestTiming) -> list[int]:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        ids: list[int] = []
        timing.arrival = time.perf_counter()
        for fresh in (False, True):  # a kept-alive connection the server closed: once more
            r, w = await self._conn(fresh)
            w.write(head + body)
            status = await r.readline()
            if status:
                break
            w.close()
        headers = {}
        while (line := await r.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        if not status.startswith(b"HTTP/1.1 200"):
            text = await r.read(int(headers.get("content-length", 300)))
            raise SystemExit(f"{status.decode().strip()}: {text.decode()[:300]}")
        buf = b""
        while True:  # chunked: one chunk per event the server sent
            size = int((await r.readline()).split(b";")[0], 16)
            data = await r.readexactly(size + 2)
            if size == 0:
                break
            now, (*events, buf) = time.perf_counter(), (buf + data[:-2]).split(b"\n\n")
            for e in events:
                take_event(e, ids, timing, now)
        self.idle.append((r, w))
        return ids

    async def close(self) -> None:
        for _, w in self.idle:
            w.close()


async def one(client, url, body: bytes, timing: RequestTiming) -> list[int]:
    """One streamed request through httpx (``--client httpx``)."""
    if isinstance(client, RawClient):
        return await client.one(body, timing)
    ids: list[int] = []
    timing.arrival = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    async with client.stream("POST", url + "/v1/completions", content=body, headers=headers) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if take_event(line.encode(), ids, timing, time.perf_counter()):
                break
    return ids


async def level(client, url, model, prompts, max_tokens, concurrency) -> dict:
    """Every prompt once, at most ``concurrency`` in flight; vLLM's metrics of the run."""
    timings = [RequestTiming(0.0, len(p)) for p in prompts]
    bodies = [request_body(model, p, max_tokens) for p in prompts]  # before the clock
    # its streams' chunks land the moment they are read: a pause of the load generator's own
    # event loop stalls every stream at once, as an engine pause would (``watch_loop``)
    gate = asyncio.Semaphore(concurrency)

    async def go(i):
        async with gate:
            return await one(client, url, bodies[i], timings[i])

    stalls: list[tuple[float, float]] = []
    watch = asyncio.ensure_future(watch_loop(stalls))
    t0 = time.perf_counter()
    try:
        outputs = await asyncio.gather(*(go(i) for i in range(len(prompts))))
    finally:
        watch.cancel()
    short = [i for i, o in enumerate(outputs) if len(o) != max_tokens]
    if short:
        raise SystemExit(f"requests {short[:5]} returned fewer than {max_tokens} tokens")
    duration = max(t.token_times[-1] for t in timings) - t0
    out = serving_metrics(timings, duration)
    out.update(request_figures(timings))
    out["gap"] = gap = longest_gap(timings, t0)
    out["max_gap_ms"] = gap["ms"] if gap else 0.0  # a stall shows
    out["client_stall_ms"] = max((b - a for a, b in stalls), default=0.0) * 1e3
    if gap:  # the client's own pauses inside the gap: the load generator's share of it
        start = t0 + gap["at_ms"] / 1e3
        gap["client_stall_ms"] = paused_within(stalls, start, start + gap["ms"] / 1e3) * 1e3
    return out


def paused_within(stalls: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of the ``(from, to)`` pauses that fall inside ``[start, end]``."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in stalls)


CLIENT_TICK_S, CLIENT_STALL_S = 0.001, 0.005


async def watch_loop(stalls: list[tuple[float, float]]) -> None:
    """Wake every ms on the load generator's own event loop; record ``(from, to)`` of every
    wake-up more than 5 ms late (the client, not the server, held the streams then)."""
    last = time.perf_counter()
    while True:
        await asyncio.sleep(CLIENT_TICK_S)
        now = time.perf_counter()
        if now - last > CLIENT_TICK_S + CLIENT_STALL_S:
            stalls.append((last + CLIENT_TICK_S, now))
        last = now


def request_figures(timings: list[RequestTiming]) -> dict:
    """Every request's TTFT and longest gap between two of its tokens, ms, in send order."""
    return {
        "ttft_ms_per_request": [round(t.ttft * 1e3, 3) for t in timings],
        "max_gap_ms_per_request": [round(max(t.itls, default=0.0) * 1e3, 3) for t in timings],
    }


LANDED_WITH_S = 0.002  # first tokens this soon after a gap's end came from the step that ended it


def longest_gap(timings: list[RequestTiming], t0: float) -> dict | None:
    """Where the longest gap between two tokens of one request fell (None: no request had two
    tokens): ``request`` (send order) and ``token`` (the gap is between tokens ``token`` and
    ``token + 1``, from 0), ``at_ms`` its start after ``t0``; ``decoding``: the other requests
    that had their first token before it and their last after it, ``stalled``: how many of them
    got no token inside it, 2 ms off either end (all: the engine or the server paused, not this
    stream);
    ``first_tokens``: requests whose first token landed inside it, more than 2 ms after its
    start and up to 2 ms after its end (their prefills ended in it), ``their_prompt_tokens``:
    their prompts' tokens, summed;
    ``waiting``: requests sent before its end whose first token came after its start (queued
    or prefilling across some of it: a chunked prefill's first token lands only after its last
    chunk), ``waiting_prompt_tokens``: their prompts' tokens."""
    best = None
    for i, t in enumerate(timings):
        for k, gap in enumerate(t.itls):
            if best is None or gap > best[0]:
                best = (gap, i, k)
    if best is None:
        return None
    gap, i, k = best
    start, end = timings[i].token_times[k], timings[i].token_times[k + 1]
    decoding = stalled = firsts = prompt = waiting = waiting_prompt = 0
    for j, t in enumerate(timings):
        if j == i or not t.token_times:
            continue
        times = t.token_times
        if t.arrival < end and times[0] > start + LANDED_WITH_S:
            waiting += 1
            waiting_prompt += t.input_len
        if times[0] <= start and times[-1] >= end:
            decoding += 1  # a token within 2 ms of either end came from that end's step
            after = times[bisect.bisect_right(times, start + LANDED_WITH_S)]
            stalled += after >= end - LANDED_WITH_S
        if start + LANDED_WITH_S < times[0] <= end + LANDED_WITH_S:
            firsts += 1
            prompt += t.input_len
    return {
        "ms": gap * 1e3,
        "request": i,
        "token": k,
        "at_ms": (start - t0) * 1e3,
        "decoding": decoding,
        "stalled": stalled,
        "first_tokens": firsts,
        "their_prompt_tokens": prompt,
        "waiting": waiting,
        "waiting_prompt_tokens": waiting_prompt,
    }


def describe_gap(gap: dict | None) -> str:
    """One line of ``longest_gap``'s figures."""
    if gap is None:
        return "longest token gap: none (no request had two tokens)"
    return (
        f"longest token gap {gap['ms']:.1f} ms: request {gap['request']}, tokens "
        f"{gap['token']}-{gap['token'] + 1}, at {gap['at_ms']:.0f} ms; of {gap['decoding']} "
        f"other requests decoding across it, {gap['stalled']} got no token in it; "
        f"{gap['first_tokens']} first tokens landed in it ({gap['their_prompt_tokens']} prompt "
        f"tokens); {gap['waiting']} requests waited for a first token across it "
        f"({gap['waiting_prompt_tokens']} prompt tokens); the load generator itself paused "
        f"{gap.get('client_stall_ms', 0.0):.1f} ms of it"
    )


def fresh_ids(prompts: list[list[int]], vocab: int, tag: str) -> list[list[int]]:
    """``prompts``' lengths with new random ids (seeded by ``tag``): the same work, and nothing
    a server's prefix cache holds from an earlier use of the workload (a rehearsal or another
    level), which it would serve instead of prefilling."""
    rng = random.Random(tag)
    ids = range(vocab)
    return [rng.choices(ids, k=len(p)) for p in prompts]


async def run_levels(url, args, main_prompts, lat_prompts, outs) -> list[dict]:
    """The warm-up, then each level; the same connections throughout (warm connections, as a
    client that keeps its connections alive sees the server); /metrics through httpx. Every
    use of a workload (the rehearsal, each level) sends its prompts' lengths with fresh ids
    (``fresh_ids``), so that the prefix cache of a caching server serves none of them: each
    level's hit rate is reported."""
    most = max(map(int, args.concurrency.split(",")))
    limits = httpx.Limits(max_connections=most + 4, max_keepalive_connections=most + 4)
    vocab, rows = VOCAB[args.model], []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as scraper:
        client = RawClient(url) if args.client == "raw" else scraper
        t = time.perf_counter()  # a rehearsal of both workloads: first-use compiles happen here
        warm = f"{args.seed}:warm-up"
        await level(client, url, args.model, fresh_ids(main_prompts, vocab, warm), outs[0], most)
        await level(client, url, args.model, fresh_ids(lat_prompts, vocab, warm), 8, 1)
        print(f"warm-up: {time.perf_counter() - t:.1f} s", file=sys.stderr)
        for i, c in enumerate(map(int, args.concurrency.split(","))):
            name, prompts, out = (
                ("latency", lat_prompts, outs[1]) if c == 1 else ("main", main_prompts, outs[0])
            )
            prompts = fresh_ids(prompts, vocab, f"{args.seed}:level {i}")
            before = await scrape(scraper, url)
            m = await level(client, url, args.model, prompts, out, c)
            d = {k: v - before[k] for k, v in (await scrape(scraper, url)).items()}
            n = d.pop("tpot_count")
            m["server_tpot_ms"] = d.pop("tpot_sum") / n * 1e3 if n else None
            queries, hits = d.pop("prefix_queries"), d.pop("prefix_hits")
            m["prefix_hit_rate"] = hits / queries if queries else None
            m.update(level=name, concurrency=c, output_len=out, server_steps=d)
            rows.append(m)
        if isinstance(client, RawClient):
            await client.close()
    return rows


def report(rows: list[dict]) -> None:
    head = (
        f"{'level':>10} {'conc':>4} {'reqs':>4} {'out tok/s':>10} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'srv TPOT':>8}"
    )
    print(head)
    f = lambda x: "-" if x is None else f"{x:.3f}"
    for m in rows:
        print(
            f"{m['level']:>10} {m['concurrency']:>4} {m['completed']:>4} "
            f"{m['output_throughput']:>10.1f} {f(m['median_ttft_ms']):>9} "
            f"{f(m['p99_ttft_ms']):>9} {f(m['median_tpot_ms']):>9} {f(m['p99_tpot_ms']):>9} "
            f"{f(m['median_itl_ms']):>8} {f(m['p99_itl_ms']):>8} "
            f"{f(m['server_tpot_ms']):>8}"
        )
    print("ms; srv TPOT: the server's engine's mean TPOT over the same requests")
    for m in rows:
        steps = ", ".join(f"{k} {v:.0f}" for k, v in m["server_steps"].items())
        hits = m.get("prefix_hit_rate")
        hits = "not reported" if hits is None else f"{hits:.1%}"
        print(
            f"{m['level']} (concurrency {m['concurrency']}): engine {steps}; prefix cache hit "
            f"rate {hits}; the load generator's longest pause {m['client_stall_ms']:.1f} ms"
        )
        print(f"  {describe_gap(m['gap'])}")
        ttfts = " ".join(f"{x:.1f}" for x in m["ttft_ms_per_request"])
        print(f"  TTFT per request, ms, in send order: {ttfts}")


def report_caps(runs: list[dict]) -> None:
    """One row per prefill cap and level: what the cap trades (ITL p99, the longest gap)
    against throughput and TTFT."""
    print(
        f"{'prefill cap':>11} {'conc':>4} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p99':>8} {'longest gap':>11} {'prefill steps':>13}"
    )
    for run in runs:
        cap = run["max_prefill_tokens_with_decode"]
        for m in run["levels"]:
            print(
                f"{'none' if cap == 0 else cap:>11} {m['concurrency']:>4} "
                f"{m['output_throughput']:>10.1f} {m['median_ttft_ms']:>9.3f} "
                f"{m['p99_ttft_ms']:>9.3f} {m['p99_itl_ms']:>8.3f} {m['max_gap_ms']:>11.1f} "
                f"{m['server_steps']['prefill_steps']:>13.0f}"
            )
    print("ms; prefill cap: --max-prefill-tokens-with-decode of the server (none: 0, no cap)")


def prefill_caps(text: str | None) -> list[int | None]:
    """``--max-prefill-tokens-with-decode``'s comma list as ints >= 0 (``[None]``: not given,
    the server's default); ``ValueError`` naming the flag."""
    if text is None:
        return [None]
    try:
        caps = [int(x) for x in text.split(",")]
    except ValueError:
        caps = []
    if not caps or any(c < 0 for c in caps):
        raise ValueError(
            f"--max-prefill-tokens-with-decode takes whole numbers >= 0, comma separated "
            f"(0: no cap), got {text!r}"
        )
    return caps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server")
    where.add_argument("--launch", action="store_true", help="start `stepgraph serve` here")
    p.add_argument("--model", default="llama-3.2-1b", help="served model (a preset: its vocab)")
    p.add_argument("--device", default=None, help="--launch: the server's --device")
    p.add_argument("--mode", default="graph", help="--launch: the server's --mode")
    p.add_argument("--engine", default="process", help="--launch: the server's --engine")
    p.add_argument("--offline", action="store_true", help="also `stepgraph bench --serve`")
    p.add_argument(
        "--client",
        default="raw",
        choices=("raw", "httpx"),
        help="the streamed requests' client: connections of our own, or httpx's "
        "pool (it measured every H200 figure of 2026-12-01)",
    )
    p.add_argument("--max-running", type=int, default=64, help="--launch: --max-running")
    p.add_argument("--max-context", type=int, default=2048, help="--launch: --max-context")
    p.add_argument("--concurrency", default="1,16,64", help="levels, comma list")
    p.add_argument("--quick", action="store_true", help="small workloads (a smoke test)")
    p.add_argument("--json", default=None, help="write the metrics of every level here")
    p.add_argument("--seed", type=int, default=0, help="workload seed (bench --serve's: 0)")
    p.add_argument(
        "--max-prefill-tokens-with-decode",
        default=None,
        metavar="N[,N...]",
        help="--launch: the server's flag of that name, one server per value (e.g. "
        "2048,1024,512; 0: no cap); default: the server's",
    )
    args = p.parse_args()
    try:
        caps = prefill_caps(args.max_prefill_tokens_with_decode)
    except ValueError as e:
        print(f"serve_load.py: {e}", file=sys.stderr)
        return 2
    if caps != [None] and not args.launch:
        print(
            "serve_load.py: --max-prefill-tokens-with-decode sets the server's cap, so it "
            "needs --launch; start the server at --url with it instead",
            file=sys.stderr,
        )
        return 2
    vocab = VOCAB[args.model]
    n_main, n_lat = (8, 2) if args.quick else (MAIN_REQUESTS, LATENCY_REQUESTS)
    out_main, out_lat = (16, 32) if args.quick else (MAIN_OUT, LATENCY_OUT)
    main_prompts = random_prompts(n_main, MAIN_IN, MAIN_RATIO, vocab, args.seed)
    lat_prompts = random_prompts(n_lat, LATENCY_IN, 0.0, vocab, args.seed + 1)
    runs = []
    for cap in caps:
        if cap is not None:
            print(f"== --max-prefill-tokens-with-decode {cap}", flush=True)
        runs.append(serve_run(args, cap, main_prompts, lat_prompts, (out_main, out_lat)))
    out = {"model": args.model, "engine": args.engine, "runs": runs}
    out.update(levels=runs[-1]["levels"], server_exit=runs[-1]["server_exit"])  # as before
    if len(runs) > 1:
        report_caps(runs)
    if args.offline:  # the engine's default cap offline; each run's share of it
        out["offline_output_throughput"] = base = offline(args)
        for run in runs:
            cap = run["max_prefill_tokens_with_decode"]
            print(
                f"engine offline (bench --serve): {base:.1f} output tok/s; over HTTP"
                + ("" if cap is None else f" (prefill cap {cap})")
                + ": "
                + ", ".join(
                    f"c{m['concurrency']} {m['output_throughput'] / base:.0%}"
                    for m in run["levels"]
                )
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(r["server_exit"] in (None, 0) for r in runs) else 1


def serve_run(args, cap: int | None, main_prompts, lat_prompts, outs) -> dict:
    """One server (launched with ``cap`` where given, or the one at ``--url``): every level,
    reported; the server stopped with SIGTERM and its exit checked."""
    proc, url = launch(args, cap) if args.launch else (None, args.url.rstrip("/"))
    rows, status, child = [], None, None
    try:
        child = wait_healthy(url)
        rows = asyncio.run(run_levels(url, args, main_prompts, lat_prompts, outs))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            status = proc.wait(120)
            sys.stderr.write(proc.stderr.read())
    report(rows)
    run = {"max_prefill_tokens_with_decode": cap, "levels": rows, "server_exit": status}
    if proc is not None:
        run["engine_process_gone"] = None if child is None else gone(child)
        where = (
            ""
            if child is None
            else f"; its engine process {child}: " + ("gone" if gone(child) else "STILL RUNNING")
        )
        print(f"server: exit status {status} after SIGTERM{where}")
    return run


if __name__ == "__main__":
    sys.exit(main())
