"""Rows, table and plot of `stepgraph bench`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from .floor import NO_SPEC, Bandwidth


@dataclass
class Row:
    mode: str  # ours (eager, graph, exact, compile) or a peer (hf-eager, hf-static-compile)
    bs: int
    context: int
    ms_per_token: float | None
    tokens_per_s: float | None
    floor_fraction: float | None  # floor ms (read stream) / measured ms; 1.0 = at the floor
    capture_s: float | None = None  # ours: capture of all buckets; peers: compile time
    pool_mib: float | None = None
    note: str = ""
    kernels_per_step: float | None = None  # ours: device kernels one step launches
    spec_fraction: float | None = None  # the same bytes at the GPU's specification bandwidth
    floor_ms: float | None = None  # this row's floor where it is not its point's (FP8 weights)


# the table's columns: name and width (the first left-aligned, the rest right-aligned)
COLUMNS = {
    "mode": 18,
    "bs": 4,
    "ctx": 7,
    "ms/tok": 9,
    "tok/s": 10,
    "floor": 8,
    "of floor": 9,
    "of spec": 8,
    "vs eager": 9,
    "kernels": 8,
}


def _cell(value: float | None, width: int, spec: str, empty: str = "-") -> str:
    return f"{value:{width}{spec}}" if value else f"{empty:>{width}}"


def format_table(rows: list[Row], floor_ms: dict[tuple[int, int], float], bw: Bandwidth) -> str:
    """One line per row: ms per token, the floor (``bw``'s read stream) and the share of it the
    row reaches, the share of the specification bandwidth (``NO_SPEC`` for an unknown GPU)."""
    head = "".join(f"{c:>{w}}" for c, w in COLUMNS.items())
    lines = [bw.header(), f"{'mode':<18}{head[18:]}  note"]
    eager = {(r.bs, r.context): r.ms_per_token for r in rows if r.mode == "eager"}
    no_spec = NO_SPEC if bw.spec_gbps is None else "-"
    for r in sorted(rows, key=lambda r: (r.bs, r.context, r.mode)):
        key = (r.bs, r.context)
        base = eager.get(key)
        speed = f"{base / r.ms_per_token:8.1f}x" if r.ms_per_token and base else f"{'-':>9}"
        floor = r.floor_ms if r.floor_ms is not None else floor_ms[key]
        lines.append(
            f"{r.mode:<18}{r.bs:>4}{r.context:>7}{_cell(r.ms_per_token, 9, '.3f')}"
            f"{_cell(r.tokens_per_s, 10, '.0f')}{floor:8.3f}"
            f"{_cell(r.floor_fraction, 9, '.0%')}{_cell(r.spec_fraction, 8, '.0%', no_spec)}"
            f"{speed}{_cell(r.kernels_per_step, 8, '.0f')}  {r.note}"
        )
    return "\n".join(lines)


def write_json(path: str, rows: list[Row], meta: dict) -> None:
    with open(path, "w") as f:
        json.dump(
            {"meta": meta, "rows": [asdict(r) for r in rows], "summary": summary(rows)}, f, indent=1
        )


def summary(rows: list[Row]) -> dict:
    """Headline figures: bs=1 at the smallest context."""
    out = {}
    ones = [r for r in rows if r.bs == 1 and r.ms_per_token]
    if ones:
        ctx = min(r.context for r in ones)
        for r in ones:
            if r.context == ctx:
                out[f"{r.mode}_ms_bs1_ctx{ctx}"] = round(r.ms_per_token, 3)
                if r.floor_fraction:
                    out[f"{r.mode}_floor_bs1_ctx{ctx}"] = round(r.floor_fraction, 3)
                if r.spec_fraction:
                    out[f"{r.mode}_spec_bs1_ctx{ctx}"] = round(r.spec_fraction, 3)
    return out


FLOOR_LABEL = "floor: (weights + live KV) / read-stream bandwidth"


def _tick(context: int) -> str:
    return f"{context // 1024}k" if context >= 1024 and context % 1024 == 0 else str(context)


def plot(
    path: str,
    rows: list[Row],
    *,
    title: str = "stepgraph bench",
    floor_ms: dict[tuple[int, int], float] | None = None,
) -> None:
    """ms per decode step against context, one panel per batch size, on linear axes from 0:
    our modes solid, the transformers peers (``hf-*``) dashed, the bandwidth floor dotted.
    ``title`` names the device and the model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r.bs for r in rows})
    order = {m: i for i, m in enumerate(("eager", "graph", "exact", "compile"))}
    modes = sorted({r.mode for r in rows}, key=lambda m: (m.startswith("hf-"), order.get(m, 9), m))
    colors = {m: f"C{i}" for i, m in enumerate(modes)}
    # distinct markers: exact lies on graph's line where the two agree, and stays visible
    markers = dict(zip(modes, "o^xDsP*"))
    contexts = sorted({r.context for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.5 * len(sizes) + 1, 4.2), squeeze=False)
    for ax, bs in zip(axes[0], sizes):
        for mode in modes:
            pts = sorted(
                (r.context, r.ms_per_token)
                for r in rows
                if r.bs == bs and r.mode == mode and r.ms_per_token
            )
            if pts:
                peer = mode.startswith("hf-")
                style = "--" if peer else "-"
                ax.plot(
                    *zip(*pts),
                    color=colors[mode],
                    marker=markers[mode],
                    markersize=7,
                    linestyle=style,
                    label=mode,
                )
        if floor_ms:
            pts = sorted((c, ms) for (b, c), ms in floor_ms.items() if b == bs)
            ax.plot(*zip(*pts), color="black", linestyle=":", marker="_", label=FLOOR_LABEL)
        ax.set_title(f"batch size {bs}")
        ax.set_xlabel("context (tokens of KV per request)")
        ax.set_xticks(contexts, [_tick(c) for c in contexts])
        ax.set_xlim(0, max(contexts) * 1.08)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.1)  # from 0, with room above the highest point
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("ms per decode step")
    legend = {}  # label -> handle, over every panel (a peer may run at small sizes only)
    for ax in axes[0]:
        legend.update(zip(*reversed(ax.get_legend_handles_labels())))
    ncol = min(len(legend), 3)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=ncol, fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.03 + 0.06 * -(-len(legend) // ncol), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
