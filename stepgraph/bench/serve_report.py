"""The output of `stepgraph bench --serve`: one report dict (the JSON, less the per-request
records), the table on stdout, and the TTFT / TPOT plot by request."""

from __future__ import annotations

import argparse
import json
import math

import torch

from .serve_metrics import decode_step_ms, serving_metrics

STATS = ("mean", "median", "p90", "p99")
METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


MIN_E2E_STEPS = 2  # decode-only steps an end-to-end step time needs: one is no measurement


def _decode_rows(gpu: list[dict], steps, source: str) -> list[dict]:
    rows = []
    for g in gpu:
        e2e, n = decode_step_ms(steps, g["bs"])
        e2e = e2e if n >= MIN_E2E_STEPS else None  # printed "-", null in the JSON
        rows.append(
            {
                **g,
                "e2e_ms": e2e,
                "e2e_steps": n,
                "e2e_over_step": _ratio(e2e, g["step_ms"]),
                "source": source,
            }
        )
    return rows


def _latency(run) -> dict:
    t = run.timings[0]
    n = len(t.token_times)
    return {
        "ttft_ms": t.ttft * 1e3,
        "tpot_ms": t.tpot * 1e3 if t.tpot else None,
        "e2el_ms": t.e2e * 1e3,
        "ms_per_output_token": t.e2e / n * 1e3,
        "input_len": t.input_len,
        "output_len": n,
    }


def _peer(run, ours: dict, main, latency: dict | None) -> dict:
    """A peer's figures and our speed-up over it (peer time / our time: > 1 means ours is
    faster)."""
    if run.skipped:
        return {"skipped": run.skipped}
    out = {"seconds": run.seconds, "note": run.note}
    if run.peer == "hf-cb":
        out["speedup_wall"] = _ratio(run.seconds, ours["duration"])
        out["output_throughput"] = ours["total_output_tokens"] / run.seconds
        if run.timings:
            span = max(t.token_times[-1] for t in run.timings) - min(t.arrival for t in run.timings)
            m = serving_metrics(run.timings, span)
            out.update(
                setup_seconds=run.setup_seconds,
                serving_seconds=span,
                metrics=m,
                speedup_serving=_ratio(span, ours["duration"]),
            )
        same = [a == b for a, b in zip(run.outputs, main.outputs)]
        first = [a[:1] == b[:1] for a, b in zip(run.outputs, main.outputs)]
        out.update(tokens_equal_ours=sum(same), first_token_equal_ours=sum(first))
    else:
        out.update(ttft_ms=run.ttft_ms, tpot_ms=run.tpot_ms)
        if latency:
            out["ms_per_output_token"] = run.seconds / latency["output_len"] * 1e3
            out["speedup_tpot"] = _ratio(run.tpot_ms, latency["tpot_ms"])
            out["speedup_e2e"] = _ratio(out["ms_per_output_token"], latency["ms_per_output_token"])
    return out


def build_report(
    args: argparse.Namespace,
    plan,
    mr,
    main,
    gpu_main: list[dict],
    latency,
    gpu_latency: list[dict],
    peers: dict,
    warmup_s: float,
) -> dict:
    cuda = mr.device.type == "cuda"
    lens = [t.input_len for t in main.timings]
    metrics = serving_metrics(main.timings, main.duration_s)
    lat = _latency(latency) if latency is not None else None
    steps = main.steps
    return {
        "meta": {
            "model": plan.model,
            "dtype": str(mr.dtype).removeprefix("torch."),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "engine_mode": plan.mode,
            "engine_prefill": plan.prefill,
            "max_running": plan.max_running,
            "max_prefill_tokens": args.max_prefill_tokens,
            "max_prefill_tokens_with_decode": args.max_prefill_tokens_with_decode or None,
            "kernels": getattr(mr, "kernels", None),
            "warmup_seconds": warmup_s,  # every prompt once, untimed (kernels compile)
        },
        "workload": {
            "num_requests": len(lens),
            "input_len": args.input_len,
            "range_ratio": args.range_ratio,
            "prompt_len_min": min(lens),
            "prompt_len_max": max(lens),
            "output_len": args.output_len,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "seed": args.seed,
            "ignore_eos": True,
        },
        "metrics": metrics,
        "steps": {
            "steps": len(steps),
            "with_first_tokens": sum(1 for s in steps if s.first_tokens),
            "decode_only": sum(1 for s in steps if s.decode_only),
            "engine_stats": main.engine_stats,
        },
        "decode": _decode_rows(gpu_main, steps, "workload")
        + (_decode_rows(gpu_latency, latency.steps, "latency case") if latency else []),
        "latency": lat,
        "peers": {name: _peer(run, metrics, main, lat) for name, run in peers.items()},
    }


def rate_text(workload: dict) -> str:
    rate = workload["request_rate"]
    return "all queued at once" if rate == "inf" else f"Poisson arrivals at {rate:g} req/s"


def _ms(x: float | None, width: int = 9) -> str:
    return f"{x:{width}.3f}" if x is not None else f"{'-':>{width}}"


def print_report(r: dict) -> None:
    meta, w, m = r["meta"], r["workload"], r["metrics"]
    weights = f", {meta['weights'].upper()} weights" if meta.get("weights") else ""
    print(
        f"\nstepgraph bench --serve: {meta['model']} ({meta['dtype']}{weights}, {meta['device']}), "
        f"engine {meta['engine_mode']}, {meta['engine_prefill']} prefill, "
        f"max running {meta['max_running']}"
    )
    print(
        f"workload: {w['num_requests']} requests, prompts {w['prompt_len_min']}-"
        f"{w['prompt_len_max']} tokens (seed {w['seed']}), {w['output_len']} new tokens each "
        f"(eos ignored), {rate_text(w)}"
    )
    print(
        f"{m['completed']} requests in {m['duration']:.3f} s: {m['request_throughput']:.2f} "
        f"req/s, {m['output_throughput']:.0f} output tok/s, {m['total_token_throughput']:.0f} "
        "total tok/s"
    )
    print(f"untimed warm-up before it: every prompt once, {meta['warmup_seconds']:.2f} s")
    s = r["steps"]
    ints = {k: v for k, v in s["engine_stats"].items() if isinstance(v, int)}
    stats = " ".join(f"{k}={v}" for k, v in ints.items())
    print(
        f"engine: {s['steps']} steps ({s['with_first_tokens']} with first tokens, "
        f"{s['decode_only']} decode only); engine.stats: {stats or '-'}"
    )
    print(f"{'ms':<6}" + "".join(f"{x:>10}" for x in STATS))
    for key, name in METRICS:
        print(f"{name:<6}" + "".join(" " + _ms(m[f"{x}_{key}_ms"]) for x in STATS))
    print(
        "decode step: GPU = graph replays back to back (CUDA-event median; CPU: host time); "
        f"end to end = median gap between decode-only steps of that batch (- under "
        f"{MIN_E2E_STEPS} steps)"
    )
    print(f"{'bs':>5}{'context':>9}{'GPU ms':>10}{'e2e ms':>10}{'e2e/GPU':>9}{'steps':>7}  source")
    for d in r["decode"]:
        ratio = f"{d['e2e_over_step']:8.2f}x" if d["e2e_over_step"] else f"{'-':>9}"
        print(
            f"{d['bs']:>5}{d['context']:>9} {_ms(d['step_ms'])} {_ms(d['e2e_ms'])}{ratio}"
            f"{d['e2e_steps']:>7}  {d['source']}, {d['how']}"
        )
    lat = r["latency"]
    if lat:
        print(
            f"latency case (1 request, {lat['input_len']} in, {lat['output_len']} out): TTFT "
            f"{lat['ttft_ms']:.2f} ms, TPOT {_ms(lat['tpot_ms'], 0)} ms, "
            f"{lat['ms_per_output_token']:.3f} ms per output token end to end"
        )
    for name, p in r["peers"].items():
        print(_peer_line(name, p))


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v else "-"


def _peer_line(name: str, p: dict) -> str:
    if "skipped" in p:
        return f"peer {name}: skipped ({p['skipped']})"
    if name == "hf-cb":
        line = (
            f"peer hf-cb (generate_batch, all queued at once): {p['seconds']:.3f} s, "
            f"{p['output_throughput']:.0f} output tok/s; ours {_x(p['speedup_wall'])} faster"
        )
        if "metrics" in p:
            m = p["metrics"]
            line += (
                f"; after its {p['setup_seconds']:.2f} s set-up: {p['serving_seconds']:.3f} s "
                f"({_x(p['speedup_serving'])}), median TTFT {_ms(m['median_ttft_ms'], 0)} ms, "
                f"TPOT {_ms(m['median_tpot_ms'], 0)} ms"
            )
        line += f"; tokens equal ours in {p['tokens_equal_ours']} requests"
    else:
        line = (
            f"peer {name} (latency case): TTFT {_ms(p['ttft_ms'], 0)} ms, TPOT "
            f"{_ms(p['tpot_ms'], 0)} ms ({_x(p.get('speedup_tpot'))} ours), "
            f"{_ms(p.get('ms_per_output_token'), 0)} ms per output token end to end "
            f"({_x(p.get('speedup_e2e'))} ours)"
        )
    return line + (f"; {p['note']}" if p.get("note") else "")


def request_records(main) -> list[dict]:
    """One record per request of a run, its tokens included (to check the work)."""
    return [
        {
            "input_len": t.input_len,
            "output_len": len(t.token_times),
            "arrival_s": t.arrival - main.start,
            "ttft_ms": t.ttft * 1e3,
            "tpot_ms": t.tpot * 1e3 if t.tpot is not None else None,
            "e2el_ms": t.e2e * 1e3,
            "tokens": out,
        }
        for t, out in zip(main.timings, main.outputs)
    ]


def write_report(path: str, report: dict, main) -> None:
    """``report`` plus one record per request of ``main`` (``request_records``)."""
    requests = request_records(main)
    with open(path, "w") as f:
        json.dump({**report, "requests": requests}, f, indent=1)


def plot_requests(path: str, report: dict, main, hf_cb=None) -> None:
    """TTFT and TPOT of each request (in arrival order), ours and hf-cb's where it has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("stepgraph", main.timings)]
    if hf_cb is not None and hf_cb.timings:
        series.append(("transformers generate_batch", hf_cb.timings))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for label, timings in series:
        x = list(range(len(timings)))
        axes[0].plot(x, [t.ttft * 1e3 for t in timings], marker=".", lw=0.8, label=label)
        tpot = [(i, t.tpot * 1e3) for i, t in enumerate(timings) if t.tpot is not None]
        if tpot:
            axes[1].plot(*zip(*tpot), marker=".", lw=0.8, label=label)
    for ax, name in zip(axes, ("TTFT: time to first token", "TPOT: time per output token")):
        ax.set_title(name)
        ax.set_xlabel("request (arrival order)")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    # one legend below both panels: inside an axes it covered the first requests' points
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    meta, w = report["meta"], report["workload"]
    fig.suptitle(
        f"{meta['model']} ({meta['dtype']}) on {meta['device']}: {w['num_requests']} "
        f"requests, {rate_text(w)}"
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))  # room for the legend under the panels
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = [
    "MIN_E2E_STEPS",
    "build_report",
    "plot_requests",
    "print_report",
    "rate_text",
    "request_records",
    "write_report",
]
