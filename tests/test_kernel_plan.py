"""``model/decode/kernel_plan``: what ``stepgraph info --model`` says runs at each bucket, printed
from ``model/decode/step_plan.plan_step``. The 1B preset's plan as measured and committed; models
without measured tiles and float32 on the reference kernels; and the plan equals what
``fused_decode_step`` actually launches (spies on the tiny preset, with the tables set for it):
the forms, the tiles each launcher is handed, the PDL mode, the attention's launches; plans
are cached, and the step's modules hold no rule of their own."""

from __future__ import annotations

import pytest
import torch

from stepgraph.bench.workload import Point, build_model_runner, decode_batch, fill_kv_random
from stepgraph.cli import main
from stepgraph.kernels.proj.proj_tiles import block_m
from stepgraph.model.config import PRESETS
from stepgraph.model.decode import fused_decode, fused_mlp, kernel_plan, step_attention, step_plan
from stepgraph.tuning import DecodeTuning, NormHandoff


def by_bucket(config, elem_bytes=2, tuning=None):
    plan = kernel_plan.kernel_plan(config, elem_bytes, tuning=tuning)
    return {b: (path, choices) for b, path, choices in plan}


def test_the_1b_plan_as_committed():
    plan = by_bucket(PRESETS["llama-3.2-1b"])
    assert sorted(plan) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert plan[1][0] == "fused, one row (GEMV)"
    assert plan[1][1]["qkv"] == "qkv_rope 4x1024 w4"  # the launcher's one-row halving
    sums = ", the norm from the sums of squares"
    # 2-16 rows: one plan of projections, the handoff and the 16-row tiles from bucket 2
    proj = {b: {p: c for p, c in plan[b][1].items() if p != "attention"} for b in plan}
    assert proj[2] == proj[4] == proj[8] == proj[16] and plan[2][0] == plan[16][0]
    # the attention: split + combine to bucket 8, one launch with the merge at 16-32,
    # one split from 48 (the ladder's cap); keys in the step's order
    attn = {b: plan[b][1]["attention"] for b in plan}
    # one row: the split detached, the combine's trigger before its wait; from two rows
    # the combine's at its exit
    pdl = "; the combine with PDL, trigger at its"
    assert attn[1] == (
        "split_kv + combine (up to 64 splits; the split launched plainly, "
        "trigger at its start; the combine with PDL, trigger before its wait)"
    )
    assert attn[8] == f"split_kv + combine (up to 8 splits{pdl} exit)"
    assert attn[16].startswith("split_kv_fold, one launch (up to 4 splits; the last of each row")
    assert attn[32].startswith("split_kv_fold, one launch (up to 2 splits")
    assert attn[48] == attn[64] == "split_kv_fold, one launch (one split at every context)"
    assert list(plan[8][1]) == ["qkv", "attention", "o_proj", "gate_up", "down", "lm_head"]
    for b in (2, 8):
        c = plan[b][1]
        assert c["qkv"].startswith("qkv_rope ") and "TMA" not in c["qkv"]
        assert c["qkv"].endswith(f"{sums} (layer 0: norm, then qkv_rope 32x256 w4 s3 split4)")
        assert c["gate_up"] == "gate_up_silu 64x128 w4 s4 TMA1" + sums  # the _normed tile
        assert c["o_proj"] == "gemv_residual 32x128 w4 s4 split4 TMA2"  # four splits
        assert c["down"] == "gemv_residual 64x128 w4 s5 split4 TMA1"
        assert c["lm_head"] == "lm_head 256x64 w8 s3 TMA2" + sums
    # 17-32 rows: qkv and the LM head fused; 33-64: qkv's cuBLAS GEMM on the handoff
    assert plan[32][1]["qkv"] == (
        f"qkv_rope 16x128 w4 s5 split4 TMA1{sums} (layer 0: norm, "
        "then qkv_rope 16x128 w4 s5 split4 TMA1)"
    )
    assert plan[32][1]["lm_head"] == "lm_head 256x64 w8 s3 TMA1" + sums
    assert (
        plan[48][1]["qkv"]
        == plan[64][1]["qkv"]
        == (
            "cuBLAS + RoPE/KV write, the norm from the sums of squares in the RoPE kernel "
            "(layer 0: norm + cuBLAS + RoPE/KV write)"
        )
    )
    assert plan[32][1]["gate_up"].endswith(sums)
    assert plan[64][1]["gate_up"] == "gate_up_silu 64x128 w4 s3 TMA1" + sums
    assert plan[64][1]["lm_head"] == (
        "cuBLAS + head_scale, the norm from the sums of squares "
        "(its 1 / RMS and the greedy tokens in one launch)"
    )
    assert plan[64][1]["o_proj"] == "gemv_residual 32x128 w4 s4 split2 TMA2"


def test_unmeasured_shapes_and_float32_run_the_reference_kernels():
    for config, elem, fused in (
        (PRESETS["llama-3.1-8b"], 2, (2, 4, 8, 16)),
        (PRESETS["llama-3.2-1b"], 4, ()),
        (PRESETS["qwen2.5-0.5b"], 2, ()),
    ):
        plan = by_bucket(config, elem)
        assert plan[1][0] == "fused, one row (GEMV)"
        for b in plan:
            if b > 1 and b not in fused and b not in DecodeTuning().reference_rows:
                assert plan[b][1] == {} and plan[b][0].startswith("reference kernels (")
    eight = by_bucket(PRESETS["llama-3.1-8b"])  # measured at 2-16 rows (BLOCK_M 16) only
    assert eight[8][1]["qkv"].startswith("cuBLAS + RoPE/KV write, the norm from the sums")
    assert eight[8][1]["gate_up"].endswith("the norm from the sums of squares")
    assert eight[16][1]["gate_up"].endswith("the norm from the sums of squares")
    proj = {b: {p: c for p, c in eight[b][1].items() if p != "attention"} for b in (2, 4, 8)}
    assert proj[2] == proj[4] == proj[8]  # one plan for 2-16 rows
    # the merge lost at the 8B's head_dim 128: split + combine at 16
    assert eight[16][1]["attention"].startswith("split_kv + combine (up to 4 splits; the combine")
    assert eight[32][0].startswith("reference kernels (")


def test_info_prints_the_plan(capsys):
    assert main(["info", "--model", "llama-3.2-1b"]) == 0
    out = capsys.readouterr().out
    assert "decode kernels of llama-3.2-1b (bfloat16" in out
    assert "  bs bucket 2: fused, tensor cores (M padded to 16)\n" in out
    assert "  bs bucket 8: fused, tensor cores (M padded to 16)\n" in out  # PDL there
    assert "  bs bucket 32: fused, tensor cores (M padded to 32)\n" in out  # PDL there
    assert "    attention split_kv_fold, one launch (up to 2 splits;" in out
    assert "above 64 rows: reference kernels" in out
    assert main(["info", "--model", "no-such-model"]) == 2  # one line, naming the flag
    assert "argument --model: 'no-such-model' is neither a preset" in capsys.readouterr().err


def test_info_prints_the_fp8_plan(capsys):
    """``--quantization fp8``: the projections' tiles from the FP8 table, each marked with
    what its activations run as; the LM head stays in the model's dtype, unmarked."""
    from stepgraph.kernels.proj.tile_table import FP8_TILES

    assert main(["info", "--model", "llama-3.2-1b", "--quantization", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "(bfloat16, FP8 (e4m3) projection weights per channel," in out
    fp8 = {
        b: c
        for b, _, c in kernel_plan.kernel_plan(
            PRESETS["llama-3.2-1b"], 2, None, None, "fp8-channel"
        )
    }
    assert fp8[1]["o_proj"] == "gemv_residual 8x2048 w4 e4m3 GEMV"  # the one-row GEMV
    assert FP8_TILES[("gemv_residual", 2048, 2048, 1)] == kernel_plan.Tile(8, 2048, 4)
    assert fp8[32]["down"].startswith("gemv_residual 64x256 w4 s3 split8 TMA1 W8A8")
    assert "    down      gemv_residual 64x256 w4 s3 split8 TMA1 W8A8" in out
    for b, pieces in fp8.items():
        assert "W8" not in pieces["lm_head"] and "W8" not in pieces["attention"]
        forms = ("e4m3 GEMV",) if b == 1 else ("W8A8", "W8A16")
        assert all(
            sum(f in c for f in forms) == 1
            for p, c in pieces.items()
            if p not in ("lm_head", "attention")
        ), (b, pieces)
    # block scales: every projection from two rows W8A8 (the block-scaled x rounded to e4m3)
    block = {
        b: c
        for b, _, c in kernel_plan.kernel_plan(
            PRESETS["llama-3.2-1b"], 2, None, None, "fp8-block", (128, 128)
        )
    }
    for b, pieces in block.items():
        projs = [c for p, c in pieces.items() if p not in ("lm_head", "attention")]
        assert projs and all(("W8A8" in c) == (b > 1) for c in projs), (b, pieces)
    assert main(["info", "--model", "llama-3.2-1b", "--quantization", "fp8-block"]) == 0
    assert "per 128x128 block" in capsys.readouterr().out
    plain = by_bucket(PRESETS["llama-3.2-1b"])
    assert not any("W8" in c for _, pieces in plain.values() for c in pieces.values())


@pytest.fixture(scope="module")
def mr():
    runner = build_model_runner("tiny", "cpu", torch.float32, max_bs=17, max_context=64)
    fill_kv_random(runner)
    return runner


def expected(piece: str, choice: str) -> set[str]:
    """The spy's names for what ``choice`` (a plan line) launches for ``piece``."""
    if "cuBLAS" in choice and "sums" in choice:  # on the handoff (qkv: from layer 1)
        return {f"{piece} cublas handoff"} | ({f"{piece} cublas"} if "layer 0" in choice else set())
    if "cuBLAS" in choice:
        return {f"{piece} cublas"}
    if "the norm from the sums of squares" in choice:
        layer0 = choice.split(" (layer 0: ")[1][:-1] if "(layer 0: " in choice else None
        return {f"{piece} handoff"} | (expected(piece, layer0) if layer0 else set())
    return {f"{piece} sep" if choice.startswith("norm, then") else f"{piece} fused"}


@pytest.mark.parametrize("handoff", [True, False])
def test_the_plan_is_what_the_step_runs(mr, monkeypatch, handoff):
    cfg = mr.config
    shapes = kernel_plan.piece_shapes(cfg)
    layer = mr.model.layers[0]
    assert shapes["qkv"] == tuple(layer.self_attn.qkv_proj.weight.shape)
    assert shapes["down"] == tuple(layer.mlp.down_proj.weight.shape)
    cublas = {("qkv_rope", *shapes["qkv"], 32), ("lm_head", *shapes["lm_head"], 32)}
    separate = {("gate_up_silu", *shapes["gate_up"], 16), ("qkv_rope", *shapes["qkv"], 16)}

    def table(keys):  # the bf16 tables' element-size check lifted for this float32 model
        return lambda kernel, m, n, k, e=2, tables=None: (kernel, n, k, block_m(m)) in keys

    # every choice of the step is the plan's: its rules are patched in one module
    monkeypatch.setattr(step_plan, "separate_norm", table(separate))
    monkeypatch.setattr(step_plan, "prefer_cublas", table(cublas))
    monkeypatch.setattr(step_plan, "measured", lambda *a: True)
    tuning = DecodeTuning(handoff=NormHandoff(enabled=handoff))  # the step's and the plan's
    ran: list[str] = []

    def spy(name, fn, what, mod=fused_decode):
        def call(*a, **k):
            ran.append(what(a, k))
            return fn(*a, **k)

        monkeypatch.setattr(mod, name, call)

    def kind(piece):
        return lambda a, k: (
            f"{piece} handoff"
            if k.get("ssq") is not None
            else f"{piece} sep"
            if len(a) > 1 and a[1] is None
            else f"{piece} fused"
        )

    spy("qkv_rope", fused_decode.qkv_rope, kind("qkv"))
    spy(
        "rope_kv",
        fused_decode.rope_kv,
        lambda a, k: "qkv cublas handoff" if k.get("ssq") is not None else "qkv cublas",
    )
    spy("gate_up_silu", fused_mlp.gate_up_silu, kind("gate_up"), fused_mlp)
    spy("silu_mul", fused_mlp.silu_mul, lambda a, k: "gate_up cublas", fused_mlp)
    spy("lm_head_argmax", fused_decode.lm_head_argmax, kind("lm_head"))
    spy("_cublas_head", fused_decode._cublas_head, lambda a, k: "lm_head cublas")
    spy("head_scale", fused_decode.head_scale, lambda a, k: "lm_head cublas handoff")
    spy("embed_rmsnorm", fused_decode.embed_rmsnorm, lambda a, k: "embed with the norm")
    plan = by_bucket(cfg, tuning=tuning)
    owns = []
    for bs in (1, 3, 5, 17):  # buckets 1 (one row), 4 and 8 (M padded to 16, the handoff's from
        # 2 rows), 32 (qkv and the LM head on cuBLAS in this test's table)
        ran.clear()
        batch, pages = decode_batch(mr, Point(bs, 20), seed=bs)
        try:
            mr.attn_backend.init_forward_metadata(batch)
            fused_decode.fused_decode_step(
                mr.model, mr.attn_backend, batch.input_ids, batch.positions, tuning=tuning
            )
        finally:
            for p in pages:
                mr.kv_cache.release(p)
        choices = plan[fused_decode.kernel_class(bs, mr.attn_backend)][1]
        for piece in ("qkv", "gate_up", "lm_head"):
            c = choices[piece]
            seen = {r for r in ran if r.startswith(piece)}
            assert seen == expected(piece, c), (bs, piece, c, seen)
            ho = handoff and bs > 1 and ("cuBLAS" not in c or piece != "gate_up")
            assert ("sums of squares" in c) == ho
        # layer 0's norm as its own kernel (cuBLAS qkv, SEPARATE_NORM): run with the embedding
        first = choices["qkv"].split(" (layer 0: ")[-1]
        own = "cuBLAS" in first or first.startswith("norm, then")
        assert ran.count("embed with the norm") == own, (bs, choices["qkv"])
        owns.append(own)
    assert owns == [False, True, True, True]


def launcher_spies(monkeypatch, ran: list) -> None:
    """Record each projection launcher's (name, tile handed, use_pdl) and the attention's
    (fold or split + combine, its PDL, its merge block)."""

    def spy(mod, name):
        real = getattr(mod, name)

        def call(*a, **k):
            ran.append((name, k.get("blocks"), k.get("use_pdl")))
            return real(*a, **k)

        monkeypatch.setattr(mod, name, call)

    spy(fused_decode, "qkv_rope")
    spy(fused_decode, "lm_head_argmax")
    spy(fused_mlp, "gate_up_silu")
    spy(fused_mlp, "gemv_residual")
    real_fd = step_attention.flash_decode

    def fold(*a, **k):
        ran.append(("fold", k["use_pdl"], k["merge_splits"]))
        return real_fd(*a, **k)

    monkeypatch.setattr(step_attention, "flash_decode", fold)


@pytest.mark.parametrize("cublas_at", [(), (16,), (32,)])
def test_the_step_executes_the_plan_launch_by_launch(mr, monkeypatch, cublas_at):
    """At buckets 1, 4, 8 and 32 (live rows 1, 3, 5, 17) and with qkv, gate-up and the LM head
    on cuBLAS at no class, the 16-row class or the 32-row one, every fused launcher is handed
    the plan's tile and PDL mode, in the plan's order, and the attention launches as the plan
    says: nothing is chosen outside ``plan_step``."""
    cfg = mr.config
    shapes = kernel_plan.piece_shapes(cfg)
    cublas = {
        (kernel, *shapes[p], bm)
        for bm in cublas_at
        for p, kernel in (("qkv", "qkv_rope"), ("gate_up", "gate_up_silu"), ("lm_head", "lm_head"))
    }
    monkeypatch.setattr(
        step_plan,
        "prefer_cublas",
        lambda kernel, m, n, k, e=2, tables=None: (kernel, n, k, block_m(m)) in cublas,
    )
    monkeypatch.setattr(step_plan, "measured", lambda *a: True)
    tuning = DecodeTuning()
    ran: list = []
    launcher_spies(monkeypatch, ran)
    layers = len(mr.model.layers)
    for bs in (1, 3, 5, 17):
        ran.clear()
        plan = fused_decode.step_plan(bs, mr.model, mr.attn_backend, tuning)
        assert plan.fused and plan.rows == bs
        assert plan.bucket == fused_decode.kernel_class(bs, mr.attn_backend)
        batch, pages = decode_batch(mr, Point(bs, 20), seed=bs)
        try:
            mr.attn_backend.init_forward_metadata(batch)
            # the plan the step looks up is the one computed before: cached, not recomputed
            assert fused_decode.step_plan(bs, mr.model, mr.attn_backend, tuning) is plan
            fused_decode.fused_decode_step(
                mr.model, mr.attn_backend, batch.input_ids, batch.positions, tuning=tuning
            )
        finally:
            for p in pages:
                mr.kv_cache.release(p)
        want = []
        for i in range(layers):
            qkv = plan.qkv if i else plan.qkv0
            if qkv.how not in ("cublas", "cublas_handoff"):
                want.append(("qkv_rope", qkv.tile, plan.use_pdl))
            a = plan.attention
            assert a.splits == mr.attn_backend.bucket_splits(plan.bucket)
            if a.fold:
                want.append(("fold", a.pdl, a.splits))
            want.append(("gemv_residual", plan.o_proj.tile, plan.use_pdl))
            if plan.gate_up.how != "cublas":
                want.append(("gate_up_silu", plan.gate_up.tile, plan.use_pdl))
            want.append(("gemv_residual", plan.down.tile, plan.use_pdl))
        if plan.lm_head.how in ("fused", "handoff"):
            want.append(("lm_head_argmax", plan.lm_head.tile, plan.use_pdl))
        assert ran == want, (bs, cublas_at)
        cub = block_m(bs) in cublas_at
        assert (plan.gate_up.how == "cublas") == cub and (plan.qkv0.how == "cublas") == cub


def test_plans_are_cached_per_tuning_and_shapes(monkeypatch):
    """``plan_step`` computes a plan once per (shapes, rows, bucket) and tuning; another tuning
    or other shapes get their own."""
    calls = []
    real = step_plan._plan
    monkeypatch.setattr(step_plan, "_plan", lambda *a: calls.append(a[1:3]) or real(*a))
    one = kernel_plan.config_shapes(PRESETS["llama-3.2-1b"])
    t, u = DecodeTuning(), DecodeTuning(handoff=NormHandoff(enabled=False))
    first = step_plan.plan_step(one, 8, 8, t)
    assert step_plan.plan_step(one, 8, 8, t) is first and calls == [(8, 8)]
    assert step_plan.plan_step(one, 5, 8, t).rows == 5 and len(calls) == 2
    assert step_plan.plan_step(one, 8, 8, u).handoff is False and first.handoff is True
    other = kernel_plan.config_shapes(PRESETS["llama-3.1-8b"])
    assert step_plan.plan_step(other, 8, 8, t) is not first and len(calls) == 4


def test_the_step_modules_hold_no_rule_of_their_own():
    """The table lookups that decide the step (cuBLAS, the separate norm, the tiles, the
    measured shapes, the PDL buckets) are read by ``step_plan`` alone, not by the modules that
    execute its plan."""
    rules = (
        "prefer_cublas",
        "separate_norm",
        "tile_for",
        "qkv_tile",
        "measured",
        "reference_bucket",
        "no_pdl_bucket",
        "merges",
        "fold_merge",
    )
    for mod in (fused_decode, fused_mlp, kernel_plan):
        assert not [r for r in rules if hasattr(mod, r)], mod.__name__
    assert hasattr(step_plan, "prefer_cublas") and hasattr(step_plan, "separate_norm")
