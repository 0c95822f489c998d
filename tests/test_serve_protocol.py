"""The pure parts of `stepgraph serve`: request checks field by field (each refusal names its
field), the response shapes, the incremental detokenizer with stop strings, the token rate."""

from __future__ import annotations

import json
import random

import pytest

from stepgraph.errors import ConfigError, StepGraphError
from stepgraph.serve.chat import parse_chat
from stepgraph.serve.errors import (
    EngineFault,
    ModelNotFound,
    RequestError,
    ServerBusy,
    error_body,
)
from stepgraph.serve.metrics import TokenRate
from stepgraph.serve.protocol import DEFAULT_MAX_TOKENS, Limits, parse_completion
from stepgraph.serve.responses import SSE_DONE, Shapes, TextStream, sse

LIM = Limits("tiny", vocab_size=512, max_context=64)
TEXT = Limits("tiny", vocab_size=512, max_context=64, can_tokenize=True, chat_template=True)


def _ok(**kw) -> dict:
    return {"model": "tiny", "prompt": [1, 2, 3], **kw}


def test_defaults_and_the_fields_that_reach_the_engine():
    p = parse_completion(_ok(), LIM)
    assert (p.prompt_ids, p.max_tokens, p.temperature, p.top_k, p.seed) == (
        [1, 2, 3],
        DEFAULT_MAX_TOKENS,
        1.0,
        None,
        None,
    )
    assert not (p.stream or p.ignore_eos or p.return_token_ids or p.include_usage or p.chat)
    p = parse_completion(
        _ok(
            max_tokens=62,
            temperature=0,
            top_k=5,
            seed=2**64 - 1,
            stop=[7, 9],
            stop_token_ids=[9, 4],
            ignore_eos=True,
            min_tokens=3,
            return_token_ids=True,
            stream=True,
            stream_options={"include_usage": True},
            n=1,
            top_p=1.0,
            logprobs=None,
            user="u",
            unknown_field={"x": 1},
        ),
        LIM,
    )
    assert p.max_tokens == 62 and p.temperature == 0.0 and p.top_k == 5 and p.seed == 2**64 - 1
    assert p.stop_ids == (7, 9, 4) and p.ignore_eos and p.min_tokens == 3 and p.include_usage
    for off in (-1, 0):  # vLLM's "no top-k"
        assert parse_completion(_ok(top_k=off), LIM).top_k is None
    assert parse_completion(_ok(prompt=[[5, 6]]), LIM).prompt_ids == [5, 6]  # a batch of one
    assert parse_completion(_ok(max_tokens=8.0), LIM).max_tokens == 8


BAD = [
    ([1, 2], "body"),
    ("text", "body"),
    ({"prompt": [1]}, "model"),
    ({"model": 3, "prompt": [1]}, "model"),
    ({"model": "tiny"}, "prompt"),
    (_ok(prompt=[]), "prompt"),
    (_ok(prompt=[1, 512]), "prompt"),
    (_ok(prompt=[-1, 2]), "prompt"),
    (_ok(prompt=[1.5, 2]), "prompt"),
    (_ok(prompt=[True, 2]), "prompt"),
    (_ok(prompt="hello"), "prompt"),  # no tokenizer
    (_ok(prompt=[[1], [2]]), "prompt"),
    (_ok(prompt=list(range(1, 66))), "prompt"),  # longer than the context
    (_ok(prompt={"ids": [1]}), "prompt"),
    (_ok(max_tokens=-1), "max_tokens"),
    (_ok(max_tokens=0), "max_tokens"),
    (_ok(max_tokens="8"), "max_tokens"),
    (_ok(max_tokens=63), "max_tokens"),  # 3 + 63 - 1 > 64
    (_ok(temperature=-0.1), "temperature"),
    (_ok(temperature="hot"), "temperature"),
    (_ok(temperature=float("nan")), "temperature"),
    (_ok(top_k=1.5), "top_k"),
    (_ok(top_k=-2), "top_k"),
    (_ok(seed=-3), "seed"),
    (_ok(seed=2**64), "seed"),
    (_ok(seed="7"), "seed"),
    (_ok(stream="yes"), "stream"),
    (_ok(stream_options={"include_usage": True}), "stream_options"),  # without stream
    (_ok(stream=True, stream_options={"include_usage": "y"}), "stream_options"),
    (_ok(stop=[512]), "stop"),
    (_ok(stop="###"), "stop"),  # text without a tokenizer
    (_ok(stop=[""]), "stop"),
    (_ok(stop=[1, "x"]), "stop"),
    (_ok(stop_token_ids=["a"]), "stop_token_ids"),
    (_ok(ignore_eos=1), "ignore_eos"),
    (_ok(min_tokens=-1), "min_tokens"),
    (_ok(min_tokens=17), "min_tokens"),  # > max_tokens (16)
    (_ok(return_token_ids="true"), "return_token_ids"),
    (_ok(n=2), "n"),
    (_ok(best_of=3), "best_of"),
    (_ok(echo=True), "echo"),
    (_ok(logprobs=3), "logprobs"),
    (_ok(top_p=0.9), "top_p"),
    (_ok(presence_penalty=0.5), "presence_penalty"),
    (_ok(logit_bias={"5": 1}), "logit_bias"),
]


@pytest.mark.parametrize("body,field", BAD)
def test_each_bad_request_is_a_400_naming_its_field(body, field):
    with pytest.raises(RequestError) as e:
        parse_completion(body, LIM)
    err = e.value
    assert err.param == field and err.status in (400, 404)
    assert isinstance(err, ConfigError) and isinstance(err, StepGraphError)
    out = error_body(err)["error"]
    assert set(out) == {"message", "type", "param", "code"} and out["param"] == field
    assert out["type"] == "invalid_request_error" and out["message"]


def test_wrong_model_is_a_404_and_the_other_errors_have_their_status():
    with pytest.raises(ModelNotFound) as e:
        parse_completion({"model": "gpt-4", "prompt": [1]}, LIM)
    assert e.value.status == 404 and error_body(e.value)["error"]["code"] == "model_not_found"
    assert ServerBusy("x").status == 503 and ServerBusy.retry_after_s >= 1
    fault = error_body(EngineFault("boom"))["error"]
    assert EngineFault("boom").status == 500 and fault["type"] == "server_error"


def test_text_prompts_stops_and_chat_go_through_the_tokenizer():
    def encode(s):
        return [len(w) for w in s.split()]

    p = parse_completion(_ok(prompt="ab cde f", stop=["x y", "z"]), TEXT, encode)
    assert p.prompt_ids == [2, 3, 1] and p.stop_texts == ("x y", "z") and p.stop_ids == ()
    with pytest.raises(RequestError) as e:
        parse_completion(_ok(prompt="a" * 600), TEXT, encode)  # an id >= vocab
    assert e.value.param == "prompt"
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    seen = []
    chat = parse_chat({"model": "tiny", "messages": msgs}, TEXT, lambda m: seen.append(m) or [4, 5])
    assert seen[0][1] == {"role": "user", "content": "hi"} and chat.chat
    assert chat.max_tokens == 64 - 2 + 1  # the context left
    assert (
        parse_chat(
            {"model": "tiny", "messages": msgs, "max_completion_tokens": 5}, TEXT, lambda m: [4]
        ).max_tokens
        == 5
    )
    for body, field in [
        ({"model": "tiny"}, "messages"),
        ({"model": "tiny", "messages": []}, "messages"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content",
        ),
        ({"model": "tiny", "messages": msgs, "max_completion_tokens": 64}, "max_completion_tokens"),
    ]:
        with pytest.raises(RequestError) as e:
            parse_chat(body, TEXT, lambda m: [4, 5])
        assert e.value.param == field
    with pytest.raises(RequestError) as e:  # no template: a clear 400 before anything else
        parse_chat({"model": "tiny", "messages": msgs}, LIM, None)
    assert e.value.param == "messages" and e.value.code == "chat_template_missing"
    assert "chat_template.jinja" in str(e.value) and "tokenizer_config.json" in str(e.value)


def test_response_shapes():
    s = Shapes("cmpl-1", 5, "tiny", chat=False, token_ids=True)
    final = s.final("ab", [3, 4], "length", 7)
    assert final["object"] == "text_completion" and final["choices"][0]["token_ids"] == [3, 4]
    assert final["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 2,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert s.final("ab", [3, 4], "length", 40, 32)["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 32
    }
    assert s.usage_chunk(40, 2, 16)["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    c = Shapes("chatcmpl-1", 5, "m", chat=True, token_ids=False)
    assert c.final("hi", [1], "stop", 2)["choices"][0]["message"] == {
        "role": "assistant",
        "content": "hi",
    }
    first, later = c.chunk("a", [1], None, first=True), c.chunk("b", [2], "stop")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert (
        later["choices"][0]["delta"] == {"content": "b"} and "token_ids" not in later["choices"][0]
    )
    assert later["choices"][0]["finish_reason"] == "stop"
    assert (
        s.usage_chunk(7, 2)["choices"] == [] and s.usage_chunk(7, 2)["usage"]["total_tokens"] == 9
    )
    assert sse({"a": 1}) == b'data: {"a":1}\n\n' and SSE_DONE == b"data: [DONE]\n\n"


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("token_ids", [False, True])
def test_the_fast_chunk_bytes_equal_the_chunk_object(chat, token_ids):
    s = Shapes('x-"1', 5, 'm\\"é', chat, token_ids)
    for args in [
        ('a"b\n\u2028é', [1, 2], None, True),
        ("", [3], "stop", False),
        ("x", [], "length", False),
    ]:
        raw = s.sse_chunk(*args)
        assert raw.startswith(b"data: {") and raw.endswith(b"}\n\n")
        assert json.loads(raw[6:]) == s.chunk(*args)


def test_queued_items_merge_into_one_chunk_up_to_the_last_only_when_told():
    import asyncio

    from stepgraph.serve.app import _merged

    q: asyncio.Queue = asyncio.Queue()
    for item in [([2], None, None), ([3, 4], "length", None), ([9], None, None)]:
        q.put_nowait(item)
    assert _merged(([1], None, None), q, False) == ([1], None, None)  # a client that keeps up
    assert q.qsize() == 3
    assert _merged(([1], None, None), q, True) == ([1, 2, 3, 4], "length", None)
    assert q.qsize() == 1  # nothing past the last item of the request
    assert q.get_nowait() == ([9], None, None)
    err = EngineFault("x")
    q.put_nowait(([], None, err))
    assert _merged(([5], None, None), q, True) == ([5], None, err)  # the error ends it


WORDS = ["the", " cat", " sat", "é", " on", " a", " mat", "!", " ###", " end"]


def _decode(ids):  # spaces live in the tokens; id 99 is half of a two-token character
    out = "".join(WORDS[i] if i < len(WORDS) else "" for i in ids if i != 99)
    return out + ("\ufffd" if ids and ids[-1] == 99 else "")


def test_text_stream_equals_one_decode_for_random_chunkings():
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.randrange(len(WORDS) - 2) for _ in range(rng.randint(1, 12))]
        ts, got, i = TextStream(_decode), "", 0
        while i < len(ids):
            k = rng.randint(1, 3)
            got += ts.add(ids[i : i + k])
            i += k
        assert got + ts.flush() == _decode(ids)


def test_a_split_character_waits_for_its_second_token():
    ts = TextStream(_decode)
    assert ts.add([0]) == "the" and ts.add([99]) == "" and ts.add([3]) == "é"


def test_stop_strings_cut_the_text_and_hold_back_what_may_start_one():
    ts = TextStream(_decode, stops=["sat on", "!"])
    out = ts.add([0]) + ts.add([1]) + ts.add([2])  # "the cat sat": " sat" may start "sat on"
    assert "sat" not in out and not ts.stopped
    out += ts.add([4])
    assert ts.stopped and out == "the cat " and ts.add([5]) == "" and ts.flush() == ""
    ts = TextStream(_decode, stops=["mat!"])
    text = "".join(ts.add([i]) for i in [0, 1, 6, 5]) + ts.flush()
    assert text == "the cat mat a" and not ts.stopped  # near misses all come out at the end
    assert TextStream(None).add([1, 2]) == ""  # no tokenizer: no text


def test_token_rate_over_a_window():
    r = TokenRate(window=10.0)
    r.add(50, 100.0)
    r.add(50, 105.0)
    assert r.rate(105.0) == 10.0
    assert r.rate(110.5) == 5.0  # the first 50 left the window
    assert r.rate(200.0) == 0.0
