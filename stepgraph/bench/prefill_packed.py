"""`stepgraph bench --prefill`, part two: packed prefill of ``bs`` prompts of ``n`` tokens in one
forward (``ModelRunner.prefill``), beside transformers' batched forward of the same prompts on
the same weights (SDPA, only the last token's logits: ``logits_to_keep=1``, as its generate
does) and the compute floor.

The floor is the step's FLOPs at ``PEAK_TFLOPS`` (the H200's dense bf16 rate measured for this
kind of machine): every projection over every token, causal attention, and the LM head over
each prompt's last token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

PACKED_POINTS = ((1, 512), (8, 512), (32, 512))  # (prompts, tokens each)
CPU_POINTS = ((1, 16), (4, 16))
PEAK_TFLOPS = 790.0  # H200 dense bf16 matmul, measured (docs of the device; DESIGN.md §9)


@dataclass
class PackedRow:
    prompts: int
    tokens_each: int
    ours_ms: float
    piecewise_ms: float | None  # None: no captured shape holds the batch (it would run eagerly)
    graph_ms: float | None  # GraphPrefill: the whole forward from one graph; None: no bucket
    hf_ms: float | None  # None: the peer did not run (error in hf_error)
    floor_ms: float
    ours_of_floor: float  # floor_ms / our best of eager, piecewise and graph
    speedup_vs_hf: float | None  # HF's ms / our best
    max_rel_logit_diff_vs_hf: float | None


def prefill_flops(mr, prompts: int, n: int) -> float:
    """FLOPs of prefilling ``prompts`` prompts of ``n`` tokens (module docstring)."""
    c = mr.config
    proj = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    proj += 3 * c.hidden_size * c.intermediate_size  # gate, up, down
    t = prompts * n
    attn = 2 * 2 * c.head_dim * c.num_heads * prompts * n * (n + 1) // 2  # QK^T and PV, causal
    return float(c.num_layers * (2 * proj * t + attn) + 2 * c.hidden_size * c.vocab_size * prompts)


def run_packed(
    mr, points, time_ms, piecewise=None, with_hf: bool = True, graph=None
) -> tuple[list[PackedRow], str | None]:
    """One row per ``(prompts, n)`` point; returns the rows and the peer's error, if any."""
    hf, hf_error = None, None
    if with_hf:
        try:
            from .peers import build_hf_model

            hf = build_hf_model(mr)
        except Exception as e:  # a missing or failing peer is reported, never fatal
            hf_error = f"{type(e).__name__}: {e}"[:300]
    rows, g = [], torch.Generator().manual_seed(1)
    for prompts, n in points:
        ids = torch.randint(1, mr.config.vocab_size, (prompts, n), generator=g)
        pages = [mr.kv_cache.reserve(n) for _ in range(prompts)]
        try:
            peer = hf if hf_error is None else None
            row, err = _point(mr, ids, pages, time_ms, piecewise, graph, peer)
        finally:
            for p in pages:
                mr.kv_cache.release(p)
        hf_error = hf_error or err
        rows.append(row)
    del hf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, hf_error


def _point(mr, ids, pages, time_ms, piecewise, graph, hf) -> tuple[PackedRow, str | None]:
    prompts, n = ids.shape
    lists = ids.tolist()
    ours = mr.prefill(lists, pages).clone()  # [prompts, vocab] float32
    ours_ms = time_ms(lambda: mr.prefill(lists, pages))
    pw_ms = graph_ms = hf_ms = rel = error = None
    if piecewise is not None and piecewise.can_run([n] * prompts):
        pw_ms = time_ms(lambda: piecewise.prefill(lists, pages))
    if graph is not None and graph.can_run([n] * prompts):
        graph_ms = time_ms(lambda: graph.prefill(lists, pages))
    if hf is not None:
        dev_ids = ids.to(mr.device)
        run = lambda: hf(dev_ids, use_cache=False, logits_to_keep=1)  # noqa: E731
        try:
            with torch.no_grad():
                theirs = run().logits[:, -1].float()
                hf_ms = time_ms(run)
            rel = float((ours - theirs).norm() / theirs.norm())
        except Exception as e:
            error = f"{type(e).__name__}: {e}"[:300]
    floor = prefill_flops(mr, prompts, n) / (PEAK_TFLOPS * 1e12) * 1e3
    best_ms = min(x for x in (ours_ms, pw_ms, graph_ms) if x is not None)
    speedup = None if hf_ms is None else hf_ms / best_ms
    row = PackedRow(
        prompts, n, ours_ms, pw_ms, graph_ms, hf_ms, floor, floor / best_ms, speedup, rel
    )
    return row, error


def format_packed(rows: list[PackedRow], hf_error: str | None, floor: bool = True) -> str:
    """The packed-prefill table; ``floor``: with the GPU compute floor's columns (not on the
    CPU, whose floor the H200's FLOP rate does not give)."""

    def ms(x):
        return "–" if x is None else f"{x:.2f}"

    lines = [
        f"{'prompts':>7} {'tokens':>6} {'eager ms':>8} {'piecewise':>9} {'graph':>7} {'HF ms':>8} "
        + (f"{'floor ms':>8} {'of floor':>8} " if floor else "")
        + f"{'vs HF':>7} {'rel dlogit':>10}"
    ]
    for r in rows:
        vs = "–" if r.speedup_vs_hf is None else f"{r.speedup_vs_hf:.2f}x"
        rel = "–" if r.max_rel_logit_diff_vs_hf is None else f"{r.max_rel_logit_diff_vs_hf:.1e}"
        lines.append(
            f"{r.prompts:>7} {r.tokens_each:>6} {ms(r.ours_ms):>8} {ms(r.piecewise_ms):>9} "
            f"{ms(r.graph_ms):>7} "
            f"{ms(r.hf_ms):>8} "
            + (f"{ms(r.floor_ms):>8} {r.ours_of_floor:>7.0%} " if floor else "")
            + f"{vs:>7} {rel:>10}"
        )
    note = f"floor: FLOPs at {PEAK_TFLOPS:.0f} TFLOP/s, against our best column; " if floor else ""
    lines.append(
        f"{note}graph: GraphPrefill "
        "(whole forward per token bucket); HF: transformers' batched forward (SDPA, "
        "logits_to_keep=1)" + (f"; HF skipped: {hf_error}" if hf_error else "")
    )
    return "\n".join(lines)


def rows_json(rows: list[PackedRow]) -> list[dict]:
    return [asdict(r) for r in rows]


__all__ = [
    "CPU_POINTS",
    "PACKED_POINTS",
    "PEAK_TFLOPS",
    "format_packed",
    "prefill_flops",
    "run_packed",
    "rows_json",
]
