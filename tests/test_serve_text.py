"""`stepgraph serve` of a local checkpoint directory with a tokenizer (a tiny random Llama and
a word-level tokenizer with a chat template, written here; nothing downloads), through the real
``openai`` client: text prompts equal `stepgraph generate --prompt`, streamed text equals the
whole text, stop strings cut it (and end the request), chat completions go through the
template; with the engine on a thread and in its own process."""

from __future__ import annotations

import json
import random
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from stepgraph.cli import main as cli_main  # noqa: E402
from stepgraph.engine import Engine  # noqa: E402
from stepgraph.model import ModelRunner  # noqa: E402
from stepgraph.serve.app import build_app  # noqa: E402
from stepgraph.serve.engine_proc import EngineSpec  # noqa: E402
from stepgraph.serve.metrics import ServeMetrics  # noqa: E402
from stepgraph.serve.proc_worker import ProcessWorker  # noqa: E402
from stepgraph.serve.server import ServerThread  # noqa: E402
from stepgraph.serve.tokenizer import load_tokenizer  # noqa: E402
from stepgraph.serve.worker import EngineWorker  # noqa: E402
from tests.text_checkpoints import write_text_checkpoint  # noqa: E402

VOCAB = 256
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "system", "user", "assistant"]
WORDS = SPECIAL + [f"{c}{i}" for i, c in zip(range(VOCAB - len(SPECIAL)), "abcdefgh" * 40)]
TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)
NAME = "tiny-dir"


def _write_checkpoint(path) -> None:
    write_text_checkpoint(path, WORDS, num_layers=2, max_positions=512, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ckpt"))
    _write_checkpoint(path)
    return path


@pytest.fixture(scope="module", params=["thread", "process"])
def served(request, ckpt):
    """The server, its engine on a thread or in its own process (the tokenizer stays in the
    HTTP process either way)."""
    path = ckpt
    tok = load_tokenizer(path)
    assert tok is not None and tok.has_chat_template

    def build():
        mr = ModelRunner.from_hf_dir(path, "cpu", torch.float32, max_bs=8, max_context_len=256)
        return Engine(mr, "graph", max_running=8)

    if request.param == "thread":
        worker = EngineWorker(build, ServeMetrics())
    else:
        spec = EngineSpec(path, "cpu", "float32", "graph", 8, 256, warmup=False)
        worker = ProcessWorker(spec, ServeMetrics())
    try:
        worker.start(timeout=120)
        limits = worker.limits(NAME, True, True)
        with ServerThread(build_app(worker, limits, tok)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
            yield SimpleNamespace(path=path, tok=tok, client=client, worker=worker)
    finally:
        worker.stop(30)


def _text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS[len(SPECIAL) :]) for _ in range(n))


def _generate(capsys, path: str, n: int, **src) -> list[int]:
    flag, value = next(iter(src.items()))
    argv = [
        "generate",
        "--model",
        path,
        "--device",
        "cpu",
        "--max-new-tokens",
        str(n),
        "--json",
        f"--{flag.replace('_', '-')}",
        value,
    ]
    assert cli_main(argv) == 0
    return json.loads(capsys.readouterr().out)["outputs"][0]


def test_text_prompt_equals_stepgraph_generate_and_streams_the_same_text(served, capsys):
    prompt = _text(1, 9)
    want = _generate(capsys, served.path, 20, prompt=prompt)
    r = served.client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=20,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    (ch,) = r.choices
    assert ch.model_extra["token_ids"] == want and ch.text == served.tok.decode(want)
    assert len(set(want)) > 3 and len(ch.text.split()) == 20  # a varied text, one word a token
    assert r.usage.prompt_tokens == len(served.tok.encode(prompt))
    ids = served.tok.encode(prompt)
    by_ids = served.client.completions.create(model=NAME, prompt=ids, max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == ch.text
    pieces = [
        c.choices[0].text
        for c in served.client.completions.create(
            model=NAME, prompt=prompt, max_tokens=20, temperature=0, stream=True
        )
    ]
    assert "".join(pieces) == ch.text and 1 <= len(pieces) <= 20  # chunks may merge tokens


def test_a_stop_string_cuts_the_text_and_ends_the_request(served):
    prompt = _text(2, 7)
    full = (
        served.client.completions.create(model=NAME, prompt=prompt, max_tokens=30, temperature=0)
        .choices[0]
        .text
    )
    words = full.split()
    stop = f"{words[5]} {words[6]}"  # two words: a stop that spans two tokens
    cut = full[: full.index(stop)]
    for stream in (False, True):
        r = served.client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=30,
            temperature=0,
            stop=[stop, "zz-never"],
            stream=stream,
        )
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (text, reason) == (cut, "stop"), stream
    w = served.worker
    stops = lambda: w.metrics.finished.labels("stop")._value.get()  # counted by the engine thread
    deadline = time.monotonic() + 10
    while (stops() < 2 or w.running or w.waiting or w.kv_pages_free < w.kv_pages_total) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.01)
    assert stops() >= 2  # both ended by the stop string
    assert (w.running, w.kv_pages_free) == (0, w.kv_pages_total)  # dropped, its pages back


def test_chat_completions_go_through_the_chat_template(served, capsys):
    msgs = [{"role": "system", "content": _text(3, 3)}, {"role": "user", "content": _text(4, 5)}]
    ids = served.tok.apply_template(msgs)
    assert ids[:2] == [WORDS.index("<s>"), WORDS.index("system")]
    want = _generate(capsys, served.path, 12, prompt_ids=",".join(map(str, ids)))
    r = served.client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=12, temperature=0
    )
    (ch,) = r.choices
    assert ch.message.role == "assistant" and ch.message.content == served.tok.decode(want)
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(ids)
    chunks = list(
        served.client.chat.completions.create(
            model=NAME, messages=msgs, max_tokens=12, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chunks) == ch.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_streams_send_one_event_per_token_for_completions_and_chat(served):
    """One request alone: each engine step's token is an event of its own, as it lands."""
    n, prompt = 8, _text(5, 6)
    msgs = [{"role": "user", "content": _text(6, 4)}]
    chunks = list(
        served.client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
    )
    assert [len(c.choices[0].model_extra["token_ids"]) for c in chunks] == [1] * n
    assert sum(c.choices[0].text != "" for c in chunks) > 1  # text as it comes, too
    chunks = list(
        served.client.chat.completions.create(
            model=NAME, messages=msgs, max_tokens=n, temperature=0, stream=True
        )
    )
    assert len(chunks) == n and chunks[-1].choices[0].finish_reason == "length"
    assert sum(bool(c.choices[0].delta.content) for c in chunks) > 1
