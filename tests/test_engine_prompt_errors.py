"""What a caller hands ``Engine.generate`` / ``add_request`` instead of token ids gets a message
that says a prompt is a list of token ids (ints) and points at a tokenizer for text, and the
library's sampling errors name the Python parameter, not a CLI flag. Nothing is queued."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stepgraph.engine import Engine, Sampling
from stepgraph.errors import ConfigError
from stepgraph.model import ModelRunner

LIST_OF_IDS = "a prompt is a list of token ids (ints)"


@pytest.fixture(scope="module")
def engine() -> Engine:
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, seed=0, max_context_len=64)
    return Engine(mr, "eager")


@pytest.mark.parametrize(
    "prompts, says",
    [
        (["hello"], "prompt 0 is not a list of token ids: it is the text 'hello'"),
        ([[1.5, 2]], "prompt 0 is not a list of token ids: it holds float values, e.g. [1.5]"),
        ([[1, 2], [3, "x"]], "prompt 1 is not a list of token ids: it holds str values"),
        ([[True, 2]], "it holds bool values"),
        ([5], "prompt 0 is not a list of token ids: it is 5 (int)"),
    ],
)
def test_generate_names_a_prompt_that_is_not_token_ids(engine, prompts, says):
    with pytest.raises(ConfigError) as e:
        engine.generate(prompts, 2)
    msg = str(e.value)
    assert says in msg and LIST_OF_IDS.lower() in msg.lower() and "tokenizer" in msg
    assert "outside [0" not in msg
    assert not engine.has_unfinished  # nothing queued


def test_generate_of_one_text_says_prompts_is_a_list_of_prompts(engine):
    with pytest.raises(ConfigError, match=r"prompts must be a list of prompts.*'hello'.*tokenizer"):
        engine.generate("hello", 2)


def test_add_request_of_text_names_it(engine):
    with pytest.raises(ConfigError, match=r"the prompt is not a list of token ids: it is the text"):
        engine.add_request("hi", 2)
    assert not engine.has_unfinished


def test_ids_outside_the_vocabulary_keep_their_message(engine):
    with pytest.raises(
        ConfigError, match=r"prompt 0 \(2 tokens\) has token ids outside \[0, 512\)"
    ):
        engine.generate([[1, 600]], 2)
    assert len(engine.generate([[1, 511]], 2)[0]) == 2  # the last id of the vocabulary


@pytest.mark.parametrize(
    "kw, names", [(dict(temperature=-1), "Sampling(temperature=0)"), (dict(top_k=0), "top_k=None")]
)
def test_sampling_errors_name_the_python_parameter_not_a_flag(kw, names):
    with pytest.raises(ConfigError) as e:
        Sampling(**kw)
    assert names in str(e.value) and "--" not in str(e.value)


def test_no_library_error_names_a_cli_flag():
    """The engine, runner and model-runner modules raise no message naming ``--flag`` (the
    CLI translates to its flags itself); torchrun's own flags are not ours."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "stepgraph"
    files = [*root.glob("engine/*.py"), *root.glob("runner/*.py"), root / "model/model_runner.py"]
    flag = re.compile(r"""["'][^"'\n]*(?<![\w-])--[a-z][a-z-]+""")
    hits = [f"{p.name}: {m.group(0)}" for p in files for m in flag.finditer(p.read_text())]
    assert hits == []


def test_ids_at_both_ends_of_the_vocabulary_and_one_past(engine):
    """The checks run at C speed on plain ints (a set of the types, min and max); the limits
    are the same: 0 and 511 pass, -1 and 512 are refused, int subclasses pass, bools do not."""
    from enum import IntEnum

    class Tok(IntEnum):
        A = 7

    assert len(engine.generate([[0, 511], [Tok.A, 3]], 1)) == 2
    for bad, says in (([0, -1], r"outside \[0, 512\): \[-1\]"), ([512, 1], r"\): \[512\]")):
        with pytest.raises(ConfigError, match=says):
            engine.add_request(bad, 2)
    with pytest.raises(ConfigError, match="it holds bool values"):
        engine.add_request([1, False], 2)
    with pytest.raises(ConfigError, match="it holds int64 values"):
        import numpy as np

        engine.add_request([1, np.int64(2)], 2)
    assert not engine.has_unfinished


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("seed", [1.5, "7", True, -1, 2**64])
def test_a_seed_no_generator_takes_is_named_and_nothing_queued(engine, seed, greedy):
    sampling = None if greedy else Sampling(1.0, 5)
    with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\*\*64 - 1\]"):
        engine.add_request([1, 2], 2, sampling=sampling, seed=seed)
    with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\*\*64 - 1\]"):
        engine.generate([[1, 2]], 2, temperature=0.0 if greedy else 1.0, seed=seed)
    assert not engine.has_unfinished


@pytest.mark.parametrize("seed", [0, 2**64 - 1, np.int64(5), np.uint64(2**64 - 1)])
def test_seeds_at_both_ends_of_the_range_sample(engine, seed):
    rid = engine.add_request([1, 2], 2, sampling=Sampling(1.0, 5), seed=seed)
    while engine.has_unfinished:
        engine.step()
    engine.drain()
    assert len(engine.finished.pop(rid).output) == 2
