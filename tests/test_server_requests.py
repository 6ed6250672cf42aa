"""The server's request contract, through HTTP: text that is not valid Unicode, OpenAI's
request fields (implemented, neutral, ignored, refused, unknown), content-part messages,
errors that name their field, quiet client disconnects, and a fuzz test: any body gets a
200 or an OpenAI-style 4xx JSON error, and nothing is lost for the other requests."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import socket
import struct
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_server_llm, uvicorn_thread
from specdec import SamplingParams
from specdec.server import create_app

NAME = "tiny"
PROMPT = "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"


@pytest.fixture(scope="module")
def llm():
    return make_server_llm()


@pytest.fixture(scope="module")
def server(llm):
    """The app on uvicorn in a thread, logging through the root logger (so ``caplog``
    sees uvicorn's and asyncio's records); yields (base url, app)."""
    app = create_app(llm, NAME)
    with uvicorn_thread(app, log_config=None) as (url, _):
        yield url, app


def post(url: str, route: str, body, **kwargs) -> httpx.Response:
    """POST ``body`` serialised by :mod:`json` (which, unlike httpx, writes lone surrogates
    as ``\\u`` escapes and NaN as ``NaN``, as a sloppy client might)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return _http().post(f"{url}/v1/{route}", content=data, headers=headers, **kwargs)


@functools.cache
def _http() -> httpx.Client:
    return httpx.Client(timeout=60)  # one client: a new one per request costs ~50 ms


def wait_until(condition, what: str, timeout: float = 20) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, what
        time.sleep(0.01)


def aborts(url: str, reason: str = "abort") -> float:
    """``specdec:request_success_total{finished_reason=reason}`` from ``/metrics``."""
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name.endswith("_total") and labels.get("finished_reason") == reason:
                return sample.value
    return 0.0


# ---------------------------------------------------------------- disconnects


@contextlib.contextmanager
def held_engine(engine):
    """Each engine step first waits for a message in the engine's inbox (a new request or
    an abort), so a request cannot finish before its client's disconnect is seen."""
    real_step = engine.engine.step

    def held_step():
        deadline = time.time() + 20
        while engine._inbox.empty() and time.time() < deadline:
            time.sleep(0.002)
        return real_step()

    engine.engine.step = held_step
    try:
        yield
    finally:
        engine.engine.step = real_step


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnect_is_a_quiet_abort_counted_once_per_choice(server, caplog, stream):
    url, app = server
    engine = app.state.engine
    before = aborts(url)
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 60, "n": 16, "ignore_eos": True,
            "temperature": 0, "stream": stream}  # fmt: skip
    payload = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    caplog.set_level(logging.WARNING)
    with held_engine(engine):
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as client:
            client.sendall(head.encode() + payload)
            wait_until(lambda: engine.num_live == 16, "the request was not submitted")
        wait_until(lambda: engine.num_live == 0, "the disconnected request was not aborted")
    wait_until(lambda: not engine.engine.has_unfinished(), "the engine still holds it")
    assert engine.engine.num_kv_tokens_used == 0
    gc.collect()  # an unretrieved future logs when it is collected
    time.sleep(0.1)
    assert aborts(url) == before + 16
    assert "never retrieved" not in caplog.text and "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.parametrize("chat", [False, True])
def test_a_client_gone_mid_stream_of_many_choices_logs_nothing(server, caplog, chat):
    """A client that resets its connection in the middle of a streamed n=16 request: the
    server aborts the choices without a warning. (It used to write each choice's chunk
    separately, and asyncio logged "socket.send() raised exception." for the burst of
    writes that followed the reset.)"""
    url, app = server
    engine = app.state.engine
    port = int(url.rsplit(":", 1)[1])
    route = "chat/completions" if chat else "completions"
    body = {"model": NAME, "max_tokens": 100, "n": 16, "ignore_eos": True,
            "temperature": 0.8, "stream": True}  # fmt: skip
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/{route} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    caplog.set_level(logging.WARNING)
    for _ in range(8):  # the timing of a reset varies: the old code logged in about 1 in 3
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.sendall(head.encode() + payload)
            received = b""
            while received.count(b"data:") < 40:  # the stream is under way
                received += client.recv(65536)
        wait_until(lambda: engine.num_live == 0, "the disconnected request was not aborted")
    time.sleep(0.2)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


# ---------------------------------------------------------------- text that is not Unicode


def assert_error(response: httpx.Response, status: int = 400, param=...) -> dict:
    """An OpenAI-style JSON error; its ``error`` object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = json.loads(response.content.decode("utf-8"))["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Value error" not in error["message"] and "Assertion failed" not in error["message"]
    if param is not ...:
        assert error["param"] == param, error
    return error


BAD = "caf\udcff hi"  # what the JSON escape "\udcff" decodes to: a lone surrogate
CHAT = [{"role": "user", "content": "w5 w6 w7 w5 w6 w7"}]


@pytest.mark.parametrize(
    "route, change, param",
    [
        ("completions", {"prompt": BAD}, "prompt"),
        ("completions", {"prompt": ["w1", "w2 \ud800"]}, "prompt[1]"),
        ("completions", {"stop": BAD}, "stop"),
        ("completions", {"stop": ["w3", BAD]}, "stop[1]"),
        ("completions", {"model": BAD}, "model"),
        ("completions", {"speculative": {"method": BAD}}, "speculative.method"),
        ("completions", {"user": BAD}, "user"),
        ("completions", {"metadata": {"k": [BAD]}}, "metadata.k[0]"),
        ("completions", {BAD: 1}, "caf\\udcff hi"),
        ("chat/completions", {"messages": [{"role": "user", "content": BAD}]},
         "messages[0].content"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": BAD}]}]},
            "messages[0].content[0].text",
        ),
        ("chat/completions", {"messages": [*CHAT, {"role": "user", "content": "x\udfff"}]},
         "messages[1].content"),
        ("chat/completions", {"messages": CHAT, "stop": [BAD]}, "stop[0]"),
        ("chat/completions", {"messages": [{"role": "user", "content": "w1", "name": BAD}]},
         "messages[0].name"),
    ],
)  # fmt: skip
def test_text_that_is_not_unicode_is_a_400_naming_the_field(server, route, change, param):
    url, app = server
    body = {"model": NAME, "max_tokens": 4}
    body.update({"prompt": "w1 w2"} if route == "completions" else {"messages": CHAT})
    body.update(change)
    error = assert_error(post(url, route, body), 400, param)
    assert "is not valid Unicode: lone surrogate U+D" in error["message"]
    assert error["type"] == "invalid_request_error"
    assert app.state.engine.num_live == 0


def test_a_surrogate_pair_is_text_and_a_body_that_is_not_utf8_is_a_400(server):
    url, _ = server
    pair = b'{"model": "tiny", "prompt": "w1 \\ud83d\\ude00 w2", "max_tokens": 2}'
    assert post(url, "completions", pair).status_code == 200  # one character: U+1F600
    latin1 = '{"model": "tiny", "prompt": "café"}'.encode("latin-1")
    error = assert_error(post(url, "completions", latin1), 400)
    assert "not valid UTF-8: byte 0xe9 at offset" in error["message"]


def test_error_bodies_always_encode():
    from specdec.server.protocol import error_body

    body = error_body("the model 'x\udcff' does not exist", param="a\ud800")
    text = json.dumps(body, ensure_ascii=False).encode("utf-8").decode("utf-8")
    assert "x\\\\udcff" in text and "a\\\\ud800" in text


def test_an_unexpected_error_is_a_json_500_logged_once(server, llm, caplog, monkeypatch):
    url, _ = server

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(llm, "encode", broken)
    caplog.set_level(logging.ERROR)
    error = assert_error(post(url, "completions", {"model": NAME, "prompt": "w1"}), 500)
    assert error["type"] == "internal_error" and "RuntimeError" in error["message"]

    def logged():  # by the server, once the answer is sent
        return [r for r in caplog.records if r.exc_info and r.exc_info[0] is RuntimeError]

    wait_until(logged, "the error was not logged")
    time.sleep(0.1)
    assert len(logged()) == 1, caplog.text


def test_a_request_cannot_name_a_tree_file_on_the_servers_disk(server, tmp_path):
    """A new user's trial: ``static:/path`` in a request opened that file on the server
    and quoted its content (or said whether it exists) in the error."""
    url, _ = server
    secret = tmp_path / "secret.json"
    secret.write_text('["sk-SECRET", [0]]')
    for tree in (f"static:{secret}", "static:/no/such/file", f"static:{tmp_path}"):
        body = {"model": NAME, "prompt": "w1", "max_tokens": 2, "speculative": {"tree": tree}}
        error = assert_error(post(url, "completions", body), 400, "speculative.tree")
        assert "trees from a paths file come only from the server's own --tree" in error["message"]
        assert "SECRET" not in error["message"] and "neither" not in error["message"]
    for tree in ("static:tree-8", "static:chain-3", "dynamic:top_k=2,depth=2,budget=3"):
        body = {"model": NAME, "prompt": "w1", "max_tokens": 2, "speculative": {"tree": tree}}
        assert post(url, "completions", body).status_code == 200, tree


def test_a_failed_engine_step_is_a_500_counted_as_an_error_not_an_abort(server, monkeypatch):
    """A new user's trial: the server's own failure was counted as a client's abort."""
    url, app = server
    engine = app.state.engine.engine
    step = engine.step

    def broken():
        monkeypatch.setattr(engine, "step", step)  # once
        raise RuntimeError("a bug in a step")

    monkeypatch.setattr(engine, "step", broken)
    before_abort, before_error = aborts(url), aborts(url, "error")
    error = assert_error(post(url, "completions", {"model": NAME, "prompt": "w1"}), 500)
    assert "internal error: a bug in a step" in error["message"]
    assert aborts(url) == before_abort and aborts(url, "error") == before_error + 1
    assert post(url, "completions", {"model": NAME, "prompt": "w1"}).status_code == 200


# ---------------------------------------------------------------- OpenAI's request fields


def completion(url: str, **fields) -> httpx.Response:
    return post(url, "completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 8,
                                     "temperature": 0, **fields})  # fmt: skip


def chat(url: str, **fields) -> httpx.Response:
    body = {"model": NAME, "messages": CHAT, "max_tokens": 8, "temperature": 0, **fields}
    return post(url, "chat/completions", body)


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


#: For every unsupported field, a value that asks for something.
ASKING = {
    "suffix": " w9",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "functions": [{"name": "f"}], "function_call": {"name": "f"}, "tool_choice": "required",
    "reasoning_effort": "high", "audio": {"voice": "alloy"}, "modalities": ["text", "audio"],
    "web_search_options": {}, "verbosity": "low",
    "length_penalty": 2, "use_beam_search": True,
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ",
    "allowed_token_ids": [4, 5],
    "truncate_prompt_tokens": 5, "include_stop_str_in_output": True,
    "skip_special_tokens": False, "priority": 1,
}  # fmt: skip

#: Neutral values of unsupported and sampling fields, and ignored fields: the output does
#: not change.
NEUTRAL = {
    "logprobs": False, "top_logprobs": 0, "echo": False, "best_of": 1, "suffix": None,
    "logit_bias": {}, "presence_penalty": 0.0, "frequency_penalty": 0, "tools": [],
    "functions": None, "tool_choice": "auto", "function_call": "none",
    "response_format": {"type": "text"}, "prediction": None, "reasoning_effort": None,
    "modalities": ["text"], "min_p": 0, "repetition_penalty": 1.0, "length_penalty": 1,
    "min_tokens": 0, "use_beam_search": False, "guided_json": None, "bad_words": [],
    "guided_decoding_backend": "guidance", "structured_outputs": None,
    "skip_special_tokens": True, "priority": 0,
    "user": "someone", "metadata": {"team": "x"}, "store": False, "service_tier": "auto",
    "prompt_cache_key": "k", "safety_identifier": "s", "parallel_tool_calls": True,
    "request_id": "r-1",
}  # fmt: skip


def test_every_unsupported_field_asking_for_something_is_refused_by_name(server):
    from specdec.server.protocol import UNSUPPORTED

    url, app = server
    assert set(ASKING) == set(UNSUPPORTED)
    for field, value in ASKING.items():
        chat_has = field in ("tools", "tool_choice")  # chat implements them (test_server_tools)
        responses = [completion(url, **{field: value})]
        responses += [] if chat_has else [chat(url, **{field: value})]
        for response in responses:
            error = assert_error(response, 400, field)
            assert error["message"].startswith(f"not supported by this server: {field} (")
    error = assert_error(completion(url, suffix="x", verbosity="low"), 400, "suffix")
    assert "suffix, verbosity" in error["message"]
    assert_error(chat(url, echo=True), 400, "echo")  # completions only
    assert_error(chat(url, best_of=2), 400, "best_of")
    assert app.state.engine.num_live == 0


def test_neutral_values_and_ignored_fields_change_nothing(server):
    url, _ = server
    assert text_of(completion(url, **NEUTRAL)) == text_of(completion(url))
    assert text_of(chat(url, **NEUTRAL)) == text_of(chat(url))


def test_null_means_the_default(server, llm):
    url, _ = server
    nulls = dict.fromkeys(["top_p", "top_k", "n", "stop", "seed", "stream", "stream_options",
                           "ignore_eos", "speculative", "stop_token_ids"])  # fmt: skip
    expected = llm.generate(PROMPT, SamplingParams(max_new_tokens=16), chat=False).text
    assert text_of(completion(url, max_tokens=None, **nulls)) == expected  # OpenAI's 16
    assert text_of(chat(url, **nulls)) == text_of(chat(url))


@pytest.mark.parametrize(
    "route, change, param",
    [
        ("completions", {"foo_bar": 1}, "foo_bar"),
        ("completions", {"max_completion_tokens": 5}, "max_completion_tokens"),
        ("completions", {"messages": CHAT}, "messages"),
        ("chat/completions", {"prompt": "w1"}, "prompt"),
        ("completions", {"speculative": {"bogus": 1}}, "speculative.bogus"),
        ("completions", {"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
        ("chat/completions", {"messages": [{"role": "user", "content": "w1", "foo": 1}]},
         "messages[0].foo"),
        ("chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "text", "text": "w1", "x": 2}]}]},
         "messages[0].content[0].x"),
    ],
)  # fmt: skip
def test_unknown_fields_are_refused_by_name(server, route, change, param):
    url, _ = server
    response = (completion if route == "completions" else chat)(url, **change)
    error = assert_error(response, 400, param)
    assert f"unknown field '{param}'" in error["message"]


@pytest.mark.parametrize(
    "route, change, param, match",
    [
        ("completions", {"temperature": -1}, "temperature", "greater than or equal to 0"),
        ("completions", {"temperature": "hot"}, "temperature", "temperature: "),
        ("completions", {"top_p": 0}, "top_p", "greater than 0"),
        ("completions", {"n": True}, "n", "n: must be a number, not a boolean"),
        ("completions", {"max_tokens": True}, "max_tokens", "max_tokens: "),
        ("chat/completions", {"max_completion_tokens": "8"}, "max_completion_tokens",
         "max_completion_tokens: "),
        ("completions", {"stream": "yes"}, "stream", "stream: "),
        ("chat/completions", {"logprobs": 1}, "logprobs", "logprobs: "),
        ("completions", {"seed": 1.5}, "seed", "seed: "),
        ("completions", {"speculative": {"enabled": "yes"}}, "speculative.enabled",
         "speculative.enabled: "),
        ("completions", {"stream": True, "stream_options": {"include_usage": 1}},
         "stream_options.include_usage", "stream_options.include_usage: "),
        ("completions", {"max_tokens": -1}, "max_tokens", "max_tokens"),
        ("completions", {"max_tokens": 10**9}, "max_tokens", "maximum context length"),
        ("completions", {"prompt": "w1 " * 200}, "prompt", "nothing could be generated"),
        ("chat/completions", {"messages": [{"role": "user", "content": "w1 " * 200}]},
         "messages", "nothing could be generated"),
        ("completions", {"seed": -(2**63) - 1}, "seed", "seed"),
        ("completions", {"prompt": None}, "prompt", "prompt: Field required"),
        ("completions", {"prompt": {"a": 1}}, "prompt", "prompt must be a string"),
        ("completions", {"prompt": ["w1", 5]}, "prompt[1]", "string or a list of token ids"),
        ("completions", {"prompt": ["w1", ""]}, "prompt[1]", "empty"),
        ("completions", {"prompt": ["w1", " "]}, "prompt[1]", "encodes to no tokens"),
        ("completions", {"prompt": [10**6]}, "prompt", "outside the vocabulary"),
        ("completions", {"stop": 5}, "stop", "stop must be a string or a list"),
        ("completions", {"stop": ["w1", ""]}, "stop[1]", "1 to 1024 characters"),
        ("completions", {"stop_token_ids": [3, -1]}, "stop_token_ids[1]", "greater than"),
        ("completions", {"stop_token_ids": [10**6]}, "stop_token_ids", "outside the vocab"),
        ("completions", {"speculative": {"method": "magic"}}, "speculative.method",
         "unknown drafter 'magic'"),
        ("completions", {"speculative": {"method": "hybrid:model=ngram"}}, "speculative.method",
         "drafter options cannot be set per request"),
        ("completions", {"speculative": {"method": "magic:k=3"}}, "speculative.method",
         "unknown drafter 'magic:k=3'; choose one of"),
        ("completions", {"speculative": {"num_speculative_tokens": 0}},
         "speculative.num_speculative_tokens", "greater than or equal to 1"),
        ("completions", {"speculative": "fast"}, "speculative", "speculative: "),
        ("chat/completions", {"messages": []}, "messages", "at least 1 item"),
        ("chat/completions", {"messages": "hi"}, "messages", "valid list"),
        ("chat/completions", {"messages": [*CHAT, "hi"]}, "messages[1]", "messages[1]: "),
        ("chat/completions", {"messages": [{"role": "robot", "content": "w1"}]},
         "messages[0].role", "messages[0].role: Input should be"),
        ("chat/completions", {"messages": [{"content": "w1"}]}, "messages[0].role", "required"),
        ("chat/completions", {"messages": [{"role": "user", "content": 5}]},
         "messages[0].content", "a string or a list of content parts"),
        ("chat/completions", {"messages": [{"role": "user", "content": None}]},
         "messages[0].content", "only an assistant message may leave it null"),
        ("chat/completions", {"messages": [{"role": "user", "content": ["w1"]}]},
         "messages[0].content[0]", "must be a content part"),
        ("chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
         "messages[0].content[0].text", "must be a string"),
        ("chat/completions", {"messages": [{"role": "assistant", "content": None,
                                            "tool_calls": [{"id": "c"}]}]},
         "messages[0].tool_calls", 'messages[0].tool_calls[0] must be {"id", "type"'),
        ("chat/completions", {"messages": [{"role": "tool", "content": "4",
                                            "tool_call_id": 3}]},
         "messages[0].tool_call_id", "valid string"),
    ],
)  # fmt: skip
def test_every_error_names_its_field_without_a_framework_prefix(server, route, change, param,
                                                                 match):  # fmt: skip
    url, app = server
    response = (completion if route == "completions" else chat)(url, **change)
    error = assert_error(response, 400, param)
    assert match in error["message"] and error["type"] == "invalid_request_error"
    assert app.state.engine.num_live == 0


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_an_unknown_model_is_a_404_model_not_found(server, route):
    """As OpenAI and vLLM answer: HTTP 404, ``code: "model_not_found"``, naming the field."""
    url, app = server
    response = (completion if route == "completions" else chat)(url, model="other")
    error = assert_error(response, 404, "model")
    assert "the model 'other' does not exist" in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == "model_not_found"
    assert app.state.engine.num_live == 0


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_model_may_be_left_out_as_in_vllm(server, route):
    """A request without ``model`` is for the served model (vLLM's rule; OpenAI's API
    requires the field): the same answer as naming it, which the response names."""
    url, _ = server
    call = completion if route == "completions" else chat
    named = call(url)
    unnamed = post(url, route, {k: v for k, v in json.loads(named.request.content).items()
                                if k != "model"})  # fmt: skip
    assert unnamed.status_code == 200, unnamed.text
    assert text_of(unnamed) == text_of(named) and unnamed.json()["model"] == NAME
    empty = call(url, model="")  # vLLM reads an empty name as left out too
    assert empty.status_code == 200 and text_of(empty) == text_of(named)


def test_a_body_that_is_not_an_object_is_a_400(server):
    url, _ = server
    for body in (b"[1, 2]", b'"w1"', b"null", b"{not json"):
        assert_error(post(url, "completions", body), 400)
    response = httpx.post(f"{url}/v1/completions", content=b"w1", timeout=30,
                          headers={"content-type": "text/plain"})  # fmt: skip
    assert_error(response, 400)


def test_stop_token_ids_end_generation_like_eos(server, llm):
    url, _ = server
    ids = llm.generate(PROMPT, SamplingParams(max_new_tokens=12), chat=False).token_ids
    stop_id = ids[4]
    expected = llm.generate(
        PROMPT, SamplingParams(max_new_tokens=12, stop_token_ids=(stop_id,)), chat=False
    )
    assert expected.token_ids.index(stop_id) == len(expected.token_ids) - 1
    response = completion(url, max_tokens=12, stop_token_ids=[stop_id])
    assert text_of(response) == expected.text
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    assert response.json()["usage"]["completion_tokens"] == len(expected.token_ids)


# ---------------------------------------------------------------- content parts


def test_content_parts_from_the_openai_client_are_joined_with_newlines(server, llm):
    import openai

    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    parts = [{"type": "text", "text": "w5 w6 w7"}, {"type": "text", "text": "w5 w6 w7"}]
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "w1"}], "name": "rules"},
        {"role": "user", "content": parts, "name": "alice"},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": "w2"},
    ]
    as_text = [
        {"role": "system", "content": "w1"},
        {"role": "user", "content": "w5 w6 w7\nw5 w6 w7"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "w2"},
    ]
    expected = llm.generate(as_text, SamplingParams(max_new_tokens=10)).text
    whole = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, tool_choice="none"
    )
    assert whole.choices[0].message.content == expected
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_a_tool_messages_call_id_reaches_the_chat_template(server, llm):
    """OpenAI's SDK sends ``tool_call_id`` with every tool message: accepted, and given to
    the template (this test's template shows it)."""
    url, _ = server
    hf = llm.tokenizer.hf
    before = hf.chat_template
    hf.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% if m['tool_call_id'] is defined %} "
        "{{ m['tool_call_id'] }}{% endif %} {% endfor %}"
    )
    try:
        messages = [{"role": "user", "content": "w1"},
                    {"role": "tool", "content": "w2", "tool_call_id": "w3"}]  # fmt: skip
        response = httpx.post(f"{url}/tokenize", json={"messages": messages})
        assert response.status_code == 200, response.text
        assert response.json()["tokens"] == llm.encode("w1 w2 w3", chat=False)
        answer = chat(url, messages=messages, max_tokens=4)
        assert answer.status_code == 200, answer.text
    finally:
        hf.chat_template = before


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "f"}},
    ],
)
def test_parts_that_are_not_text_are_refused_by_position(server, part):
    import openai

    url, app = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    content = [{"type": "text", "text": "w1"}, part]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": content}], max_tokens=4
        )
    assert raised.value.param == "messages[0].content[1]"
    assert f"takes text only; content parts of type '{part['type']}'" in raised.value.message
    assert app.state.engine.num_live == 0


# ---------------------------------------------------------------- fuzz


def mostly(valid, anything):
    """Nine times in ten a ``valid`` value, else ``anything``."""
    from hypothesis import strategies as st

    return st.integers(0, 9).flatmap(lambda i: anything if i == 0 else valid)


def fuzz_values():
    """(strings: mostly prompt words, else any characters, lone surrogates included;
    arbitrary JSON values made of those)."""
    from hypothesis import strategies as st

    chars = st.characters() | st.characters(categories=["Cs"])  # Cs: lone surrogates
    words = st.lists(st.sampled_from([f"w{i}" for i in range(29)]), min_size=1, max_size=6)
    # not st.text(chars): text() leaves surrogates out of a merged alphabet
    text = mostly(words.map(" ".join), st.lists(chars, max_size=8).map("".join))
    leaves = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | text
    json_values = st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
        max_leaves=6,
    )
    return text, json_values


def fuzz_strategies():
    """(route, body) for completions and chat requests whose every string may be anything
    (lone surrogates included) and which carry arbitrary JSON in arbitrary fields; most
    values are valid, so that many requests get far (into the engine)."""
    from hypothesis import strategies as st

    from specdec import registry
    from specdec.server.protocol import IGNORED, UNSUPPORTED, ChatCompletionRequest

    text, json_values = fuzz_values()
    known = set(ChatCompletionRequest.model_fields) | set(UNSUPPORTED) | IGNORED
    keys = mostly(st.sampled_from(sorted(known | {"prompt", "foo_bar"})), text)
    extra = st.dictionaries(keys, json_values, max_size=1)
    speculative = st.fixed_dictionaries(
        {},
        optional={"method": mostly(st.sampled_from(registry.drafter_names()), text),
                  "controller": mostly(st.sampled_from(registry.controller_names()), text),
                  "tree": text, "num_speculative_tokens": st.integers(-1, 70)},
    )  # fmt: skip
    common = st.fixed_dictionaries(
        {"model": mostly(st.just(NAME), text), "max_tokens": st.integers(1, 6)},
        optional={"stop": text | st.lists(text, max_size=3), "speculative": speculative,
                  "stream": st.booleans(), "n": st.integers(1, 3)},
    )  # fmt: skip
    prompts = text | st.lists(text, max_size=3) | st.lists(st.integers(-3, 40), max_size=6)
    part = st.fixed_dictionaries({"type": mostly(st.just("text"), text), "text": text})
    message = st.fixed_dictionaries(
        {"role": mostly(st.sampled_from(["user", "system", "assistant"]), text),
         "content": text | st.lists(part, max_size=3)},
        optional={"name": text},
    )  # fmt: skip
    completions = st.tuples(common, prompts, extra).map(
        lambda t: ("completions", {**t[0], "prompt": t[1], **t[2]})
    )
    chats = st.tuples(common, st.lists(message, min_size=1, max_size=3), extra).map(
        lambda t: ("chat/completions", {**t[0], "messages": t[1], **t[2]})
    )
    return completions | chats


def check_answer(response: httpx.Response, body: dict) -> None:
    """A 200 (JSON, or server-sent events ending in ``[DONE]``) or an OpenAI-style 4xx."""
    if response.status_code != 200:
        assert 400 <= response.status_code < 500, response.text
        assert_error(response, response.status_code)
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert all("error" not in json.loads(e) for e in events[:-1]), response.text
    else:
        assert response.json()["choices"], response.text


async def fuzz_pair(url: str, route: str, body: dict) -> tuple[httpx.Response, str]:
    """The fuzzed request, and an ordinary one alongside it in the engine; (the fuzzed
    request's answer, the ordinary one's text)."""
    import asyncio

    async with httpx.AsyncClient(base_url=f"{url}/v1", timeout=60) as http:
        headers = {"content-type": "application/json"}
        ordinary = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        fuzzed, plain = await asyncio.gather(
            http.post(route, content=json.dumps(body).encode(), headers=headers),
            http.post("completions", json=ordinary),
        )
    return fuzzed, text_of(plain)


def test_fuzzed_requests_get_200_or_a_json_4xx_and_lose_nothing(server, llm, caplog):
    """Arbitrary strings in every string field and arbitrary JSON in arbitrary fields:
    never a 500 or a plain-text answer, and requests in flight meanwhile (one streaming
    from before the fuzzing, one beside each fuzzed request) get exactly their tokens."""
    import asyncio

    from hypothesis import given, settings

    url, app = server
    caplog.set_level(logging.ERROR)
    expected_short = llm.generate(PROMPT, SamplingParams(max_new_tokens=8), chat=False).text
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    expected_long = llm.generate(PROMPT, params, chat=False).text
    long = {"model": NAME, "prompt": PROMPT, "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip

    @settings(max_examples=80, deadline=None, database=None)
    @given(fuzz_strategies())
    def check(request):
        route, body = request
        response, ordinary = asyncio.run(fuzz_pair(url, route, body))
        check_answer(response, body)
        assert ordinary == expected_short

    with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as streaming:
        lines = streaming.iter_lines()
        pieces = [next(lines)]
        check()
        pieces += list(lines)
    events = [json.loads(p[6:]) for p in pieces if p.startswith("data: ") and "[DONE]" not in p]
    assert "".join(e["choices"][0]["text"] for e in events) == expected_long
    engine = app.state.engine
    wait_until(lambda: engine.num_live == 0, "a fuzzed request is still live")
    wait_until(lambda: not engine.engine.has_unfinished(), "the engine still holds requests")
    assert engine.engine.num_kv_tokens_used == 0
    assert not caplog.records, caplog.text


def test_an_empty_body_says_so(server):
    url, _ = server
    response = _http().post(
        f"{url}/v1/chat/completions", content=b"", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "the request body is empty; send a JSON object"


@pytest.mark.parametrize(
    "body, kind", [(b"[1, 2]", "an array"), (b'"hi"', "a string"), (b"3", "a number")]
)
def test_a_body_that_is_not_an_object_says_what_it_is(server, body, kind):
    url, app = server
    for route in ("completions", "chat/completions"):
        response = _http().post(
            f"{url}/v1/{route}", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert message == f"the request body must be a JSON object, got {kind}"
    assert app.state.engine.num_live == 0


def test_unknown_drafter_hint_only_when_options_were_sent():
    """A new user's trial: the per-request options hint follows an unknown name only
    when the name carried options."""
    from pydantic import ValidationError

    from specdec.server.protocol import SpeculativeOptions

    for method, hinted in (("bogus", False), ("bogus:k=3", True)):
        with pytest.raises(ValidationError) as info:
            SpeculativeOptions(method=method)
        assert ("cannot be set per request" in str(info.value)) == hinted
    with pytest.raises(ValidationError) as info:
        SpeculativeOptions(controller="bogus")
    assert "per request" not in str(info.value)


def test_max_completion_tokens_wins_over_max_tokens_in_chat(server):
    """OpenAI's current name wins when a chat request sends both (vLLM's rule:
    ``max_completion_tokens or max_tokens``); an integer temperature is still a float."""
    url, _ = server
    both = chat(url, max_tokens=8, max_completion_tokens=2, temperature=0)
    assert both.status_code == 200, both.text
    assert both.json()["usage"]["completion_tokens"] <= 2
    only_old = chat(url, max_tokens=3, temperature=0)
    assert only_old.json()["usage"]["completion_tokens"] <= 3


@pytest.mark.parametrize("route", ["completions", "chat/completions", "tokenize"])
def test_prompts_are_tokenized_off_the_event_loop(server, llm, route):
    """While one request's prompt is being tokenized (held here until the test lets it
    go), the event loop still answers /health and /v1/models at once; the tokenizing runs
    on the server's tokenizer thread, and the held request then completes normally."""
    url, _ = server
    entered, release, threads = threading.Event(), threading.Event(), []
    encode = llm.tokenizer.encode

    def held(*args, **kwargs):
        threads.append(threading.current_thread().name)
        entered.set()
        assert release.wait(20), "the test never released the tokenizer"
        return encode(*args, **kwargs)

    if route == "chat/completions":
        body = {"model": NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}
    elif route == "completions":
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 3}
    else:
        body = {"model": NAME, "prompt": PROMPT}
    result = {}
    llm.tokenizer.encode = held
    try:
        if route == "tokenize":  # vLLM's route sits outside /v1

            def send():
                result["r"] = httpx.post(f"{url}/tokenize", json=body, timeout=30)
        else:

            def send():
                result["r"] = post(url, route, body)

        worker = threading.Thread(target=send)
        worker.start()
        assert entered.wait(20), "the request never reached the tokenizer"
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
        assert worker.is_alive()  # still held in the tokenizer
        release.set()
        worker.join(30)
    finally:
        release.set()
        llm.tokenizer.encode = encode
    assert result["r"].status_code == 200, result["r"].text
    assert threads and all(t.startswith("specdec-tokenizer") for t in threads), threads


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_text_far_past_the_context_is_refused_before_it_is_tokenized(server, llm, route):
    """A prompt of more than ``2 * max_token_chars * max_context`` characters cannot fit
    (each token covers at most ``max_token_chars`` of them): a 400 naming its characters
    and the context, without tokenizing it (16 MB of text took about 20 s to tokenize and
    held the server's event loop that long). A text under that bound that still does not
    fit is refused after tokenizing, as before."""
    url, _ = server
    limit = 2 * llm.tokenizer.max_token_chars * llm.target.max_context
    field = "prompt" if route == "completions" else "messages"

    def body(text):
        if route == "completions":
            return {"model": NAME, "prompt": text, "max_tokens": 4}
        return {"model": NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 4}

    encode, calls = llm.tokenizer.encode, []
    llm.tokenizer.encode = lambda *a, **k: calls.append(1) or encode(*a, **k)
    try:
        huge = "w1 " * (limit // 3 + 1)  # just over the bound
        response = post(url, route, body(huge))
        assert response.status_code == 400 and not calls
        error = response.json()["error"]
        assert error["param"] == field and f"has {len(huge)} characters" in error["message"]
        assert f"context is {llm.target.max_context} tokens" in error["message"]
        over = "w1 " * (llm.target.max_context + 5)  # under the bound, over the context
        response = post(url, route, body(over))
        assert response.status_code == 400 and calls  # tokenized, then refused
        assert "tokens; this model's context is" in response.json()["error"]["message"]
        assert post(url, route, body(PROMPT)).status_code == 200  # the server is fine
    finally:
        llm.tokenizer.encode = encode


@pytest.mark.parametrize("field", ["top_p", "min_p", "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_sampling_value_that_is_not_a_finite_number_is_refused_as_such(server, field, value):
    """NaN (which fails every range check) and infinities get a 400 saying the value must
    be a finite number, naming the field, not a range error."""
    url, _ = server
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 2, field: value}
    response = post(url, "completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "finite number" in error["message"], error
