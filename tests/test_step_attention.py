"""The fused step's attention choice (``model/decode/step_attention``): the folded launch with its
merge at the table's classes per attention shape, one split folded everywhere, split + combine
elsewhere; the switch's override; PDL passed through. Pure logic: a stand-in backend, and
``flash_decode`` recorded (the kernels' numbers are tests/test_split_kv_fold.py's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stepgraph.model.decode import step_attention
from stepgraph.tuning import DecodeTuning, PdlPlacement


class Backend:
    def __init__(self, shape=(32, 8, 64), splits=None, use_kernel=True):
        self.num_heads, self.num_kv_heads, self.head_dim = shape
        self.use_kernel, self.splits = use_kernel, splits or {}
        self.meta = SimpleNamespace(block_table="bt", seq_lens="lens", num_splits=3, workspace="ws")
        self.kv_cache = SimpleNamespace(k_caches=["k0", "k1"], v_caches=["v0", "v1"])
        self.sm_scale, self.num_sms, self.calls = 0.125, 132, []

    def bucket_splits(self, bucket):
        return self.splits[bucket]

    def decode_attention(self, layer_id, q, use_pdl):
        self.calls.append(("two kernels", layer_id, use_pdl))
        return "two"


@pytest.fixture
def fold(monkeypatch):
    seen = []

    def fake(q, k, v, bt, lens, **kw):
        seen.append((k, v, kw))
        return "fold"

    monkeypatch.setattr(step_attention, "flash_decode", fake)
    return seen


def pdl(spec: str) -> DecodeTuning:
    """A tuning whose ``pdl.attention`` is ``spec``."""
    return DecodeTuning(pdl=PdlPlacement(attention=spec))


def test_the_table_picks_the_merge_at_its_classes_only(fold):
    splits = {8: 8, 15: 4, 16: 4, 32: 2, 33: 2, 64: 1}
    b = Backend(splits=splits)
    assert step_attention.FOLD_MERGE_TABLE[(32, 8, 64)] == range(16, 33)  # Llama-3.2-1B
    got = {bucket: step_attention.attention(b, 1, "q", bucket) for bucket in splits}
    assert got == {8: "two", 15: "two", 16: "fold", 32: "fold", 33: "two", 64: "fold"}
    assert [kw["merge_splits"] for *_, kw in fold] == [4, 2, 1]  # the class's largest count
    assert all(kw["fold_combine"] and kw["num_splits"] == 3 for *_, kw in fold)
    assert all(k == "k1" and v == "v1" for k, v, _ in fold)  # the layer's pages
    assert [c[0] for c in b.calls] == ["two kernels"] * 3


def test_other_shapes_fold_only_one_split(fold):
    b = Backend(shape=(32, 8, 128), splits={16: 4, 64: 1})  # Llama-3.1-8B: the fold lost
    assert step_attention.attention(b, 0, "q", 16) == "two"
    assert step_attention.attention(b, 0, "q", 64) == "fold"


def test_the_field_overrides_every_shape(fold):
    b = Backend(shape=(32, 8, 128), splits={8: 8, 16: 4, 32: 2})
    t = DecodeTuning(fold_merge=range(8, 9))
    assert [step_attention.attention(b, 0, "q", k, tuning=t) for k in (8, 16, 32)] == [
        "fold",
        "two",
        "two",
    ]
    t = DecodeTuning(fold_merge=range(0))  # none: split + combine
    b = Backend(splits={16: 4, 64: 1})
    assert [step_attention.attention(b, 0, "q", k, tuning=t) for k in (16, 64)] == ["two", "fold"]
    with pytest.raises(ValueError, match="fold_merge="):
        DecodeTuning(fold_merge=(8, 9))


def test_reference_attention_never_folds(fold):
    b = Backend(splits={}, use_kernel=False)  # bucket_splits is not even asked
    assert step_attention.attention(b, 0, "q", 16) == "two" and not fold


def test_pdl_pair(fold, monkeypatch):
    # the defaults: at one row the split detached and the combine's trigger before its wait;
    # from two rows the combine alone, its trigger at its exit, whatever mode the
    # projections run; none where they run without PDL
    assert step_attention.attention_pdl(None, 1) == (5, 4)
    assert step_attention.default_pdl(1) == (5, 4) and step_attention.default_pdl(2) == (False, 3)
    assert step_attention.attention_pdl(2, 2) == (False, 3)
    assert step_attention.attention_pdl(2, 8) == (False, 3)
    assert step_attention.attention_pdl(False, 1) is False
    assert step_attention.attention_pdl(False, 8) is False
    assert step_attention.attention_pdl(0, 8) is False  # 0 is False too (bool is an int)
    assert step_attention.attention_pdl(3, 8) == (False, 3)  # any trigger mode: PDL on
    assert step_attention.attention_pdl(None, 1, pdl("0")) == (False, False)  # none
    assert step_attention.attention_pdl(2, 8, pdl("split")) == (2, False)
    assert step_attention.attention_pdl(None, 1, pdl("split")) == (None, False)  # the default
    assert step_attention.attention_pdl(2, 8, pdl("combine:exit")) == (False, 3)
    b = Backend(splits={16: 4})
    step_attention.attention(b, 0, "q", 16, use_pdl=2, tuning=pdl("combine:exit"))
    assert fold[-1][2]["use_pdl"] == (False, 3)
    assert step_attention.attention_pdl(2, 8, pdl("detached,exit")) == (5, 3)
    assert step_attention.attention_pdl(None, 1, pdl("detached,exit")) == (5, 3)
    assert step_attention.attention_pdl(2, 8, pdl("both:wait")) == (1, 1)  # True: the mode


def test_attention_text_names_the_launches_with_pdl(monkeypatch):
    """``stepgraph info``'s line says which attention launch takes PDL, and its trigger: the
    defaults, none where the projections run without it, and the switch's choice."""
    shape = (32, 8, 64)  # Llama-3.2-1B: split + combine to 8, the merge at 16-32, one split at 64
    text = step_attention.attention_text
    assert text(shape, 1).endswith(
        "splits; the split launched plainly, trigger at its start; "
        "the combine with PDL, trigger before its wait)"
    )
    assert text(shape, 8, use_pdl=2).endswith("splits; the combine with PDL, trigger at its exit)")
    assert text(shape, 8, use_pdl=False) == "split_kv + combine (up to 8 splits)"
    assert "PDL" not in text(shape, 16, use_pdl=2) + text(shape, 64, use_pdl=2)
    t = pdl("split:exit")
    assert text(shape, 8, use_pdl=2, tuning=t).endswith(
        "splits; the split with PDL, trigger at its exit)"
    )
    assert text(shape, 64, use_pdl=2, tuning=t) == (
        "split_kv_fold, one launch (one split at every context; with PDL, trigger at its exit)"
    )
