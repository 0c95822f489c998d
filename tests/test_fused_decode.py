"""The fused decode step (``model/decode/fused_decode.py``) on the CPU: its kernels under the Triton
interpreter against ``ModelRunner.forward``'s reference ops on the tiny preset (logits, greedy
tokens, the K/V written), and the kernel switch of ``ModelRunner``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stepgraph.bench.workload import Point, build_model_runner, decode_batch, fill_kv_random
from stepgraph.errors import ConfigError
from stepgraph.kernels.pdl import TRIGGER_MODES
from stepgraph.model.decode import fused_decode, fused_mlp, step_plan
from stepgraph.model.decode.fused_decode import fused_decode_step, reference_rows, unfusable_reason
from stepgraph.tuning import DecodeTuning, NormHandoff, PdlPlacement


@pytest.fixture(scope="module")
def mr():
    runner = build_model_runner("tiny", "cpu", torch.float32, max_bs=17, max_context=64)
    fill_kv_random(runner)
    return runner


def tensor_cores(monkeypatch) -> None:
    """The tensor-core kernels at every bs above one (as shipped, shapes without a measured
    tile, the tiny preset's among them, run the reference kernels inside the step)."""
    monkeypatch.setattr(step_plan, "measured_all", lambda shapes, rows, tables=None: True)


@pytest.mark.parametrize("path", ["tensor-core", "no handoff", "separate norm", "as shipped"])
@pytest.mark.parametrize("bs, context", [(1, 17), (3, 1), (17, 40)])
def test_fused_step_matches_reference(mr, bs, context, path, monkeypatch, tuning=None):
    tuning = tuning or DecodeTuning()
    if path != "as shipped":
        tensor_cores(monkeypatch)
    if path != "tensor-core":  # the norms in the prologue, or as their own kernels
        tuning = dataclasses.replace(tuning, handoff=NormHandoff(enabled=False))
    else:  # the norm handoff at every bucket above one
        tuning = dataclasses.replace(tuning, handoff=NormHandoff(min_bucket=2))
    if path == "separate norm":  # norm kernel, then the fused kernel's _normed variant
        from stepgraph.kernels.proj import proj_tiles

        tables = dataclasses.replace(
            tuning.tables,
            separate_norm_everywhere={
                (k, bm) for k in ("qkv_rope", "gate_up_silu") for bm in (16, 32, 64)
            },
        )
        tuning = dataclasses.replace(tuning, tables=tables)

        def separate(kernel, m, n, k, e=2, tables=None):  # the bf16 check lifted (float32)
            bm = proj_tiles.block_m(m)
            return bm > 1 and (kernel, bm) in tables.separate_norm_everywhere

        monkeypatch.setattr(step_plan, "separate_norm", separate)
    assert reference_rows(bs, mr.attn_backend, mr.model, tuning) == (
        path == "as shipped" and bs > 1
    )
    batch, pages = decode_batch(mr, Point(bs, context), seed=bs)
    try:
        kv0 = [c.clone() for c in (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches)]
        ref = mr.forward(batch)  # [bs, vocab] float32, the reference ops
        kv_ref = [c.clone() for c in (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches)]
        for c, c0 in zip((*mr.kv_cache.k_caches, *mr.kv_cache.v_caches), kv0):
            c.copy_(c0)
        tokens = torch.full((bs,), -1, dtype=torch.int64)
        logits = fused_decode_step(
            mr.model,
            mr.attn_backend,
            batch.input_ids,
            batch.positions,
            tokens_out=tokens,
            tuning=tuning,
        )
        assert ((logits - ref).norm() / ref.norm()).item() < 1e-5
        assert torch.equal(tokens, ref.argmax(-1))
        kv = (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches)
        assert max((a - b).abs().max().item() for a, b in zip(kv, kv_ref)) < 1e-5
    finally:
        for p in pages:
            mr.kv_cache.release(p)


def test_cublas_pieces_where_measured_faster(mr, monkeypatch):
    """Shapes in ``proj_tiles.CUBLAS`` run norm + GEMM + RoPE/KV (or SiLU·mul, or argmax_rows)
    unfused inside the fused step: same logits, tokens and K/V as the reference ops (tiny
    shapes listed here; the table is bf16-only, so the element-size check is lifted for this
    float32 model, and a spy counts the unfused choices the step made)."""
    from stepgraph.kernels.proj import proj_tiles

    cfg = mr.config
    qkv_n = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    tables = dataclasses.replace(
        DecodeTuning().tables,
        cublas={
            ("qkv_rope", qkv_n, cfg.hidden_size, 32),
            ("gate_up_silu", 2 * cfg.intermediate_size, cfg.hidden_size, 32),
            ("lm_head", cfg.vocab_size, cfg.hidden_size, 32),
        },
    )
    unfused = []

    def prefer(kernel, m, n, k, elem_bytes=2, tables=None):
        choice = proj_tiles.prefer_cublas(kernel, m, n, k, 2, tables)
        unfused.append(choice)
        return choice

    monkeypatch.setattr(step_plan, "prefer_cublas", prefer)  # every choice goes through it
    test_fused_step_matches_reference(
        mr, 17, 40, "tensor-core", monkeypatch, DecodeTuning(tables=tables)
    )
    # every choice of the step (qkv and gate-up a layer, the head; and the norm handoff's
    # look-ahead at each) went to cuBLAS
    assert len(unfused) >= 2 * cfg.num_layers + 1 and all(unfused)


def test_unmeasured_shapes_and_float32_take_the_reference_rows(mr, monkeypatch):
    """The 1B preset's bf16 shapes have tiles at every tile class; the tiny preset's do not,
    and float32 never does: the step runs the reference kernels there (``proj_tiles.measured``),
    as the rule's tiles ran the 8B preset at half cuBLAS's speed."""
    from stepgraph.kernels.proj import proj_tiles
    from stepgraph.model import ModelRunner

    big = ModelRunner.from_preset(
        "llama-3.2-1b", "cpu", torch.bfloat16, num_layers=1, max_bs=64, max_context_len=64
    )
    assert all(
        step_plan.measured_all(step_plan.step_shapes(big.model), rows)
        for rows in (2, 16, 32, 48, 64)
    )
    assert not any(reference_rows(bs, big.attn_backend, big.model) for bs in (1, 2, 3, 32, 64))
    eight = (6144, 4096)  # the 8B's qkv: its buckets 2 and 4 on its tiles too
    assert not any(proj_tiles.reference_bucket(*eight, b) for b in (1, 2, 3, 4, 8))
    assert not step_plan.measured_all(step_plan.step_shapes(mr.model), 64)
    assert reference_rows(40, mr.attn_backend, mr.model) and not reference_rows(1, None, mr.model)
    # a bucket in tables.reference_buckets for the model's qkv shape runs the reference kernels
    t = DecodeTuning(
        tables=dataclasses.replace(DecodeTuning().tables, reference_buckets={(3072, 2048, 32)})
    )
    assert proj_tiles.reference_bucket(3072, 2048, 32, tables=t.tables)
    assert not proj_tiles.reference_bucket(3072, 2048, 32, elem_bytes=4, tables=t.tables)
    assert [reference_rows(bs, big.attn_backend, big.model, t) for bs in (16, 17, 32, 33)] == [
        False,
        True,
        True,
        False,
    ]
    # and the buckets of reference_rows, for every model
    t = DecodeTuning(reference_rows=range(2, 5))
    assert [reference_rows(bs, big.attn_backend, big.model, t) for bs in (1, 2, 3, 4, 5)] == [
        False,
        True,
        True,
        True,
        False,
    ]


def test_kernel_switch_on_cpu(mr):
    assert mr.kernels == "reference"  # the default off CUDA
    assert unfusable_reason(mr.model) == "the fused kernels run on CUDA only"
    mr.set_kernels("fused")
    try:
        assert not mr.uses_fused(1) and mr.fused_tokens(1) is None  # CPU: reference ops
    finally:
        mr.set_kernels("reference")
    with pytest.raises(ConfigError, match="kernels must be one of fused, reference"):
        mr.set_kernels("triton")


@pytest.mark.parametrize("switch", [None, "none", "2-4"])
def test_pdl_off_where_the_table_says(mr, monkeypatch, switch):
    """The projections' ``use_pdl`` per bucket: off where ``tile_table.NO_PDL_BUCKETS`` holds
    the model's qkv shape and bucket (here the tiny model's at 8 and 16), else the default
    (None: wherever the GPU has it); ``pdl.no_pdl_buckets`` replaces the table for every
    model; an explicit value is always honoured."""
    from stepgraph.tuning_text import parse_buckets

    tensor_cores(monkeypatch)
    w = mr.model.layers[0].self_attn.qkv_proj.weight
    table = {(*w.shape, 8), (*w.shape, 16)}  # the table's check, this float32 model's entries
    monkeypatch.setattr(
        step_plan, "no_pdl_bucket", lambda n, k, b, e=2, tables=None: (n, k, b) in table
    )
    buckets = None if switch is None else parse_buckets("pdl.no_pdl_buckets", switch)
    tuning = DecodeTuning(pdl=PdlPlacement(no_pdl_buckets=buckets))
    seen: list = []
    real = fused_mlp.gemv_residual

    def spy(*a, **k):
        seen.append(k.get("use_pdl"))
        return real(*a, **k)

    monkeypatch.setattr(fused_mlp, "gemv_residual", spy)
    got = {}
    for bs, use_pdl in ((3, None), (5, None), (9, None), (17, None), (5, True)):
        seen.clear()
        batch, pages = decode_batch(mr, Point(bs, 9), seed=bs)
        try:
            mr.attn_backend.init_forward_metadata(batch)
            fused_decode_step(
                mr.model,
                mr.attn_backend,
                batch.input_ids,
                batch.positions,
                use_pdl=use_pdl,
                tuning=tuning,
            )
        finally:
            for p in pages:
                mr.kv_cache.release(p)
        assert len(set(seen)) == 1 and len(seen) == 2 * len(mr.model.layers)
        got[(bs, use_pdl)] = seen[0]
    off = {None: (5, 9), "none": (), "2-4": (3,)}[switch]  # buckets 4, 8, 16, 32
    late = TRIGGER_MODES["late"]  # from two rows the trigger after the main loop
    want = {(bs, None): False if bs in off else late for bs in (3, 5, 9, 17)}
    assert got == {**want, (5, True): True}


@pytest.mark.parametrize("attention_pdl", [False, True])
def test_the_attention_takes_pdl_on_its_combine_alone(mr, monkeypatch, attention_pdl):
    """By default at one row the split kernel is detached (launched plainly, its trigger at its
    start) and the combine's trigger comes before its wait; from two rows the combine alone
    launches with PDL, its trigger at its exit (docs/experiments.md#pdl-placement);
    ``pdl.attention`` overrides both, in the projections' mode: the late trigger from two rows,
    the device's default at one."""
    tensor_cores(monkeypatch)
    tuning = DecodeTuning(pdl=PdlPlacement(attention="1" if attention_pdl else None))
    backend, seen = mr.attn_backend, []
    real = backend.decode_attention

    def spy(layer_id, q, use_pdl=None):
        seen.append(use_pdl)
        return real(layer_id, q, use_pdl)

    monkeypatch.setattr(backend, "decode_attention", spy)
    for bs in (1, 5):
        seen.clear()
        batch, pages = decode_batch(mr, Point(bs, 9), seed=bs)
        try:
            backend.init_forward_metadata(batch)
            fused_decode_step(mr.model, backend, batch.input_ids, batch.positions, tuning=tuning)
        finally:
            for p in pages:
                mr.kv_cache.release(p)
        mode = TRIGGER_MODES["late"] if bs > 1 else None
        default = (False, TRIGGER_MODES["exit"]) if bs > 1 else (5, TRIGGER_MODES["early"])
        want = (mode, mode) if attention_pdl else default
        assert seen == [want] * len(mr.model.layers)


def test_no_pdl_table_keys():
    from stepgraph.kernels.proj.proj_tiles import no_pdl_bucket

    # Llama-3.2-1B: PDL at every bucket with the late trigger
    assert not any(no_pdl_bucket(3072, 2048, b) for b in (4, 8, 16, 32, 64))
    assert not no_pdl_bucket(6144, 4096, 8)  # Llama-3.1-8B: faster with PDL


def test_attention_pdl_parts_and_modes():
    from stepgraph.tuning import attention_pdl_modes

    name = "pdl.attention"
    assert PdlPlacement().attention_modes is None  # step_attention's defaults
    want = {
        "0": (False, False, None),
        "1": (True, True, None),
        "both": (True, True, None),
        "split": (True, False, None),
        "combine": (False, True, None),
        "split:exit": (True, False, 3),
        "both:wait": (True, True, 1),
        "combine:late": (False, True, 2),
        "detached,early": (5, 4, None),
        "0,exit": (False, 3, None),
        "wait,0": (1, False, None),
    }
    for text, spec in want.items():
        assert attention_pdl_modes(text) == spec, text
        assert PdlPlacement(attention=text).attention_modes == spec, text
    for bad in (
        "2",
        "true",
        "split:",
        "split:soon",
        ":late",
        "Split",
        "both:late:x",
        "detached",
        "detached,",
        ",early",
        "1,early",
        "early,early,early",
    ):
        with pytest.raises(ValueError, match=name):
            attention_pdl_modes(bad)
        with pytest.raises(ValueError, match=name):
            PdlPlacement(attention=bad)


def test_step_pdl_by_rows_and_bucket(monkeypatch):
    """The projections' ``use_pdl``: one row keeps the device's default (its GEMVs trigger at the
    wait) even in a bucket of more rows; from two rows the late trigger, or none at a
    ``pdl.no_pdl_buckets`` bucket; ``pdl.rows_trigger`` names the mode from two rows."""
    t = DecodeTuning(pdl=PdlPlacement(no_pdl_buckets=range(8, 9)))
    late = TRIGGER_MODES["late"]
    assert fused_decode.step_pdl(3072, 2048, 1, 1, 2, t) is None
    assert fused_decode.step_pdl(3072, 2048, 1, 2, 2, t) is None  # custom buckets without 1
    assert fused_decode.step_pdl(3072, 2048, 2, 2, 2, t) == late
    assert fused_decode.step_pdl(3072, 2048, 5, 8, 2, t) is False
    assert fused_decode.step_pdl(3072, 2048, 9, 16, 2, t) == late
    assert fused_decode.step_pdl(3072, 2048, 5, 8, 2) == late  # the defaults: PDL at 8
    wait = DecodeTuning(pdl=PdlPlacement(rows_trigger="wait"))
    assert fused_decode.step_pdl(3072, 2048, 9, 16, 2, wait) == TRIGGER_MODES["wait"]
