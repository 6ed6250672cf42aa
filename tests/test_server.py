"""The OpenAI-compatible server, live on loopback, driven by the ``openai`` client: outputs
equal the in-process API, streaming and not, stops, seeds, ``n``, concurrency 32,
cancellation frees the KV cache, OpenAI-style 400 errors, overload, Prometheus metrics,
graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import specdec
from conftest import (
    free_port,
    make_model,
    make_server_llm,
    make_tokenizer,
    sse_events,
    uvicorn_thread,
)
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.server import create_app

NAME = "tiny"


@contextlib.contextmanager
def serving(llm: LLM, **kwargs):
    """The app on a uvicorn server in a thread; yields (base url, app, server)."""
    app = create_app(llm, NAME, **kwargs)
    with uvicorn_thread(app, log_level="error") as (url, server):
        yield url, app, server


@pytest.fixture(scope="module")
def llm():
    return make_server_llm()


@pytest.fixture(scope="module")
def server(llm):
    with serving(llm) as running:
        yield running


@pytest.fixture()
def client(server):
    url, _, _ = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


PROMPT = "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"


def _plain(llm, prompt, **kwargs):
    params = SamplingParams(**kwargs)
    return llm.generate(prompt, params, chat=False)


def test_models_health_and_completion_equal_the_api(server, client, llm):
    url, _, _ = server
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    expected = _plain(llm, PROMPT, max_new_tokens=12)
    choice = out.choices[0]
    assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.token_ids)
    # token-id prompts, several prompts, plain decoding via the speculative extension
    ids = llm.encode(PROMPT, chat=False)
    plain = client.completions.create(
        model=NAME, prompt=[ids, ids], max_tokens=12, temperature=0,
        extra_body={"speculative": {"enabled": False}},
    )  # fmt: skip
    assert [c.text for c in plain.choices] == [expected.text] * 2


def test_streaming_completion_and_chat(client, llm):
    chunks = list(
        client.completions.create(
            model=NAME, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    expected = _plain(llm, PROMPT, max_new_tokens=16)
    assert text == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    messages = [{"role": "user", "content": "w5 w6 w7 w5 w6 w7"}]
    full = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                          temperature=0)  # fmt: skip
    expected = llm.generate(messages, SamplingParams(max_new_tokens=10))
    assert full.choices[0].message.content == expected.text
    assert full.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(pieces) == expected.text
    # vLLM's continuous_usage_stats: the counts so far in every chunk, growing
    options = {"include_usage": True, "continuous_usage_stats": True}
    counted = list(
        client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True,
            stream_options=options,
        )
    )  # fmt: skip
    so_far = [c.usage.completion_tokens for c in counted]
    assert so_far == sorted(so_far) and so_far[0] == 0 and so_far[-1] == len(expected.token_ids)
    assert all(c.usage.prompt_tokens == counted[-1].usage.prompt_tokens for c in counted)


def test_stops_seeds_and_n(client, llm):
    expected = _plain(llm, PROMPT, max_new_tokens=20)
    words = expected.text.split()
    assert len(words) > 3
    stop = words[2]
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0,
                                     stop=[stop])  # fmt: skip
    assert stop not in out.choices[0].text and out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == _plain(llm, PROMPT, max_new_tokens=20, stop=(stop,)).text
    sampled = dict(model=NAME, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=7)
    a = client.completions.create(**sampled, n=2)
    b = client.completions.create(**sampled, n=2)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text == _plain(llm, PROMPT, max_new_tokens=20, temperature=1.0, seed=7).text
    assert a.choices[1].text == _plain(llm, PROMPT, max_new_tokens=20, temperature=1.0, seed=8).text


def test_concurrency_32_loses_nothing(server, llm):
    url, app, _ = server
    prompts = [" ".join(f"w{(i * 3 + j) % 29}" for j in range(4 + i % 7)) for i in range(32)]
    expected = [_plain(llm, p, max_new_tokens=12).text for p in prompts]

    async def run():
        # closed here, in its own loop: left to the garbage collector, the client's
        # finalizer schedules its close on whatever loop then runs (another test's), which
        # logs "Task exception was never retrieved" there
        async with openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0
        ) as client:
            calls = [
                client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0)
                for p in prompts
            ]
            return await asyncio.gather(*calls)

    outs = asyncio.run(run())
    assert [o.choices[0].text for o in outs] == expected
    engine = app.state.engine
    assert engine.engine.num_kv_tokens_used == 0 and engine.num_live == 0


def test_cancelled_stream_frees_the_kv_cache(server, llm):
    url, app, _ = server
    engine = app.state.engine
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 100, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in first)
        assert engine.num_live == 1
    deadline = time.time() + 10
    while engine.num_live or engine.engine.has_unfinished():
        assert time.time() < deadline, "the aborted request still holds the engine"
        time.sleep(0.02)
    assert engine.engine.num_kv_tokens_used == 0


@pytest.mark.parametrize(
    "body, match",
    [
        ({"model": NAME, "prompt": "w1", "max_tokens": -1}, "max_tokens"),
        ({"model": NAME, "prompt": "w1", "max_tokens": 10**9}, "maximum context length"),
        ({"model": NAME, "prompt": ""}, "empty"),
        ({"model": NAME, "prompt": [10**6]}, "outside the vocabulary"),
        ({"model": NAME, "prompt": ["w1", [5, 6]]}, "not a mix"),
        ({"model": NAME, "prompt": "w1", "temperature": -1}, "temperature"),
        ({"model": NAME, "prompt": "w1", "top_p": 0}, "top_p"),
        ({"model": NAME, "prompt": "w1", "n": True}, "boolean"),
        ({"model": NAME, "prompt": "w1", "speculative": {"method": "magic"}}, "speculative"),
        (
            {"model": NAME, "prompt": "w1", "speculative": {"num_speculative_tokens": 0}},
            "speculative",
        ),
        ({"model": NAME, "prompt": "w1", "speculative": {"bogus": 1}}, "bogus"),
        (
            {"model": NAME, "prompt": "w1", "speculative": {"method": "draft-model"}},
            "start it with --draft-model",
        ),
        ({"model": NAME, "prompt": "w1", "speculative": {"tree": "static:nope"}}, "speculative"),
        ({"model": NAME, "prompt": "w1", "speculative": {"tree": True}}, "dynamic:top_k=4"),
        ({"model": NAME}, "prompt"),
        ({"model": NAME, "prompt": "w1", "logprobs": 21}, "logprobs"),
        ({"model": NAME, "prompt": "w1", "logprobs": True}, "count of top tokens"),
        ({"model": NAME, "prompt": "w1", "top_logprobs": 2}, "not supported by this server"),
        (
            {"model": NAME, "messages": [{"role": "user", "content": "w1"}], "top_logprobs": 2},
            "top_logprobs needs logprobs",
        ),
        (
            {
                "model": NAME,
                "messages": [{"role": "user", "content": "w1"}],
                "logprobs": True,
                "top_logprobs": 21,
            },
            "top_logprobs",
        ),  # fmt: skip
        ({"model": NAME, "prompt": "w1", "suffix": "x", "verbosity": "low"}, "suffix, verbosity"),
        (
            {
                "model": NAME,
                "messages": [{"role": "user", "content": "w1"}],
                "tools": [{"type": "function"}],
            },
            "tools",
        ),
        ({"model": NAME, "messages": []}, "messages"),
    ],
)
def test_bad_requests_are_openai_style_400s(server, body, match):
    url, app, _ = server
    route = "chat/completions" if "messages" in body else "completions"
    response = httpx.post(f"{url}/v1/{route}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert match in error["message"] and error["type"] == "invalid_request_error"
    assert app.state.engine.num_live == 0


def test_malformed_json_and_the_openai_client_error(server, client):
    url, _, _ = server
    response = httpx.post(
        f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert "not valid JSON (error at character" in response.json()["error"]["message"]
    form = httpx.post(  # valid JSON sent as curl -d sends it: form-encoded
        f"{url}/v1/completions", content=b'{"model": "x", "prompt": "w1"}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )  # fmt: skip
    assert form.status_code == 400
    assert "Content-Type: application/json" in form.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="w1")
    assert httpx.get(f"{url}/v1/nothing").status_code == 404


def test_metrics_parse_as_prometheus_text(server, client):
    url, _, _ = server
    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    text = httpx.get(f"{url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "specdec:spec_decode_num_drafts",
        "specdec:spec_decode_num_draft_tokens",
        "specdec:spec_decode_num_accepted_tokens",
        "specdec:spec_decode_num_accepted_tokens_per_pos",
        "specdec:num_requests_running",
        "specdec:num_requests_waiting",
        "specdec:kv_cache_usage_perc",
        "specdec:generation_tokens",
        "specdec:request_success",
    ):
        assert name in families, name
    drafts = families["specdec:spec_decode_num_draft_tokens"].samples[0].value
    accepted = families["specdec:spec_decode_num_accepted_tokens"].samples[0].value
    assert drafts > 0 and 0 <= accepted <= drafts
    per_pos = families["specdec:spec_decode_num_accepted_tokens_per_pos"].samples
    assert sum(s.value for s in per_pos if s.name.endswith("_total")) == accepted
    # vLLM's names and labels, which llm-d's endpoint picker and AIPerf scrape.
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):  # fmt: skip
        (sample,) = families[name].samples
        assert sample.labels == {"model_name": NAME, "engine": "0"}
        specdec_name = name.replace("vllm:", "specdec:")
        assert sample.value == families[specdec_name].samples[0].value
        assert families[name].type == "gauge"
    assert 0 <= families["vllm:kv_cache_usage_perc"].samples[0].value <= 1


def test_overload_is_429_and_shutdown_drains(llm):
    with serving(llm, max_waiting=1) as (url, app, server):
        engine = app.state.engine
        engine._draining = False
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 60, "temperature": 0,
                "ignore_eos": True}  # fmt: skip

        async def burst():
            async with httpx.AsyncClient(timeout=60) as http:
                calls = [http.post(f"{url}/v1/completions", json=body) for _ in range(24)]
                return await asyncio.gather(*calls)

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert 200 in codes and set(codes) <= {200, 429} and 429 in codes
        assert all(r.headers["retry-after"] == "1" for r in responses if r.status_code == 429)
        # a request that alone needs more sequences than may wait could never be queued:
        # a 400 naming the limit (a 429 would have clients retry it for nothing)
        for extra, param in (({"n": 2}, "n"), ({"prompt": [PROMPT, PROMPT]}, "prompt"),
                             ({"best_of": 2, "temperature": 1}, "best_of")):  # fmt: skip
            response = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=30)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param and "--max-waiting 1" in error["message"]
        # shutdown: an in-flight stream finishes; new requests get 503 meanwhile
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as response:  # fmt: skip
            lines = response.iter_lines()
            next(lines)
            engine._draining = True  # what the lifespan does first on SIGTERM
            refused = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert refused.status_code == 503
            assert httpx.get(f"{url}/health").status_code == 503
            rest = list(lines)
        assert rest[-2 if rest[-1] == "" else -1] == "data: [DONE]"


def test_a_request_refused_for_room_queues_none_of_its_sequences(llm):
    """A request's choices are queued together or not at all: one that does not fit gets
    the 429 before any is queued, so it leaves no prompt tokens and no aborts in the
    metrics (it used to queue some, then abort them)."""
    from specdec.server.async_engine import AsyncEngine, Overloaded
    from specdec.server.metrics import ServerMetrics

    engine = AsyncEngine(llm, 3, ServerMetrics(NAME))  # its thread is not started
    ids = llm.encode(PROMPT, chat=False)
    params, spec = SamplingParams(max_tokens=4), llm.speculative

    async def fill():
        engine.submit("a", ids, params, spec)
        engine.submit("b", ids, params, spec)

    asyncio.run(fill())
    before = engine.metrics.render()
    message = "2 sequences are waiting and at most 3 may .this request's 2 would make 4"
    with pytest.raises(Overloaded, match=message):
        engine.check_room(2)
    engine.check_room(1)  # one more fits
    assert engine.metrics.render() == before
    assert engine._inbox.qsize() == 2


def test_stats_log_writes_a_line_per_interval_of_work_only():
    """vLLM-style periodic load lines: rates over the interval, nothing before it is up or
    while idle, the speculation part only when something was drafted."""
    from specdec.server.metrics import StatsLog

    now, lines = [0.0], []
    stats = StatsLog(10.0, lines.append, lambda: now[0])
    stats.add(prompt=500, generation=100)
    now[0] = 5.0
    assert stats.tick(2, 1, 0.25) is None and not lines  # not yet due
    now[0] = 10.0
    line = stats.tick(2, 1, 0.25)
    assert lines == [line] and line == (
        "specdec (last 10 s): prompt 50.0 tokens/s, generation 10.0 tokens/s, running 2, "
        "waiting 1, KV cache 25.0%"
    )
    stats.add(generation=40, drafts=10, drafted=40, accepted=15)
    now[0] = 20.0
    assert stats.tick(1, 0, 0.1).endswith(
        "; speculation: 10 drafts, mean acceptance length 2.50 per draft, acceptance rate 37.5%"
    )
    now[0] = 40.0
    assert stats.tick(0, 0, 0.0) is None and len(lines) == 2  # idle: quiet
    with pytest.raises(ValueError, match="interval must be > 0"):
        StatsLog(0)


def test_the_server_logs_its_load_while_it_works(llm, capsys):
    with serving(llm, stats_interval=0.05) as (url, _, _):
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 30, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        time.sleep(0.2)
    out = capsys.readouterr().out
    line = r"specdec \(last [\d.e-]+ s\): prompt [\d.]+ tokens/s, generation [\d.]+ tokens/s"
    assert re.search(line, out), out
    with serving(llm) as (url, _, _):  # off by default in the library
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        time.sleep(0.1)
    assert "tokens/s" not in capsys.readouterr().out


def test_specdec_serve_exits_cleanly_on_sigterm(tmp_path):
    """The real command: serves, and on SIGTERM lets an in-flight stream finish, then exits 0."""
    import os
    import signal
    import subprocess
    import sys

    hf = make_model(make_tokenizer(), seed=0)
    hf.model.save_pretrained(tmp_path)
    hf.tokenizer.hf.save_pretrained(tmp_path)
    port = free_port()
    env = {**os.environ, "SPECDEC_CACHE": str(tmp_path / "cache")}
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "--model", str(tmp_path), "--port",
         str(port), "--backend", "native", "--served-model-name", NAME],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert process.poll() is None, process.stderr.read().decode()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.2)
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                "stream": True, "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert process.wait(timeout=60) == 0
        # the start line says what serves: backend, kernels, dtype, mode, weights, threads
        started = process.stdout.read().decode().splitlines()[0]
        # with the name clients send as 'model' (--served-model-name)
        assert started.startswith(f"specdec: serving {tmp_path} as '{NAME}' (native backend")
        # on dense weights the native backend names their kernel, e.g. (dpbf16 products)
        weights = r"dense weights( \([a-z0-9_,]+ products\))?"
        assert re.search(rf"(float32|bfloat16), exact, {weights}, \d+ threads?\) on", started)
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.real_model
def test_unicode_through_the_server_on_the_real_model():
    """SmolLM2's byte-level tokens split CJK characters: streamed and whole answers are the
    same text, equal the in-process API's, and never end inside a character."""
    real = LLM(backend="native", dtype="bfloat16",
               speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=5))  # fmt: skip
    prompt = "把这句话重复两遍：我喜欢吃苹果和香蕉。我喜欢吃苹果和香蕉。"
    messages = [{"role": "user", "content": prompt}]
    expected = real.generate(messages, SamplingParams(max_new_tokens=40))
    assert "\ufffd" not in expected.text and any(ord(c) > 0x3000 for c in expected.text)
    with serving(real) as (url, _, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        whole = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=40, temperature=0
        )
        stream = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=40, temperature=0, stream=True
        )
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert whole.choices[0].message.content == expected.text == "".join(pieces)
    assert all("\ufffd" not in p for p in pieces)


#: Each sampling transform as an OpenAI client sends it (vLLM's fields in extra_body).
TRANSFORM_FIELDS = {
    "presence_penalty": ({"presence_penalty": 1.5}, {}, dict(presence_penalty=1.5)),
    "frequency_penalty": ({"frequency_penalty": 2.0}, {}, dict(frequency_penalty=2.0)),
    "logit_bias": ({"logit_bias": {"7": 5.0, "5": -100}}, {}, dict(logit_bias={7: 5.0, 5: -100})),
    "repetition_penalty": ({}, {"repetition_penalty": 1.8}, dict(repetition_penalty=1.8)),
    "min_p": ({"temperature": 1.0, "seed": 3}, {"min_p": 0.3}, dict(min_p=0.3)),
    "bad_words": ({}, {"bad_words": ["w16 w2"]}, dict(bad_words=("w16 w2",))),
    "min_tokens": (  # a bias makes EOS likely; min_tokens holds it back
        {"logit_bias": {"2": 8.0}},
        {"min_tokens": 10},
        dict(min_tokens=10, logit_bias={2: 8.0}),
    ),
}


@pytest.mark.parametrize("field", list(TRANSFORM_FIELDS))
@pytest.mark.parametrize("stream", [False, True])
def test_sampling_transforms_with_speculation_equal_plain_decoding(client, llm, field, stream):
    """Each field through the live server, speculation on (prompt lookup, k = 4) and off,
    equals the library with the same settings; greedy, on equals off (lossless); and the
    field changes the output (so it is not silently dropped)."""
    fields, extra, kwargs = (dict(d) for d in TRANSFORM_FIELDS[field])
    temperature, seed = fields.pop("temperature", 0), fields.pop("seed", None)
    texts = []
    for speculative in (True, False):
        body = dict(extra) | ({} if speculative else {"speculative": {"enabled": False}})
        out = client.completions.create(
            model=NAME, prompt=PROMPT, max_tokens=14, temperature=temperature, seed=seed,
            stream=stream, extra_body=body, **fields,
        )  # fmt: skip
        texts.append("".join(c.choices[0].text for c in out) if stream else out.choices[0].text)
    params = SamplingParams(max_new_tokens=14, temperature=temperature, seed=seed, **kwargs)
    on = llm.generate(PROMPT, params, chat=False).text
    off = llm.generate(PROMPT, params, chat=False, speculative=SpeculativeConfig("none")).text
    assert texts == [on, off]
    if temperature == 0:
        assert on == off
    neutral = SamplingParams()
    untouched = dataclasses.replace(params, **{field: getattr(neutral, field)})
    assert llm.generate(PROMPT, untouched, chat=False).text != on, f"{field} changed nothing"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20}, "min_tokens"),  # more than max_tokens (12)
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),  # outside the vocabulary
        ({"logit_bias": [5, 1]}, "logit_bias"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": "w1"}, "bad_words"),
    ],
)
def test_bad_transform_values_are_400s_naming_the_field(server, body, param):
    url, app, _ = server
    response = httpx.post(
        f"{url}/v1/completions",
        json={"model": NAME, "prompt": PROMPT, "max_tokens": 12, **body},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("stream", [False, True])
def test_usage_and_speculation_metrics_count_what_was_emitted(server, llm, stream):
    """max_tokens 1..16 cuts accepted blocks anywhere: usage and the per-response
    speculation counters describe the emitted tokens only, as the library's own stats."""
    url, _, _ = server
    for max_tokens in range(1, 17):
        options = {"include_usage": True} if stream else None
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                "stream": stream, "stream_options": options}  # fmt: skip
        response = httpx.post(f"{url}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        if stream:
            chunks = sse_events(response.text)
            usage = chunks[-1]["usage"]
            metrics = [c["metrics"] for c in chunks if "metrics" in c]
            assert len(metrics) == 1 and chunks[-2]["choices"][0]["finish_reason"] == "length"
            spec = metrics[0]["speculative_decoding"]
        else:
            usage = response.json()["usage"]
            spec = response.json()["metrics"]["speculative_decoding"]
        expected = _plain(llm, PROMPT, max_new_tokens=max_tokens)
        m = expected.metrics
        assert usage["completion_tokens"] == len(expected.token_ids) == max_tokens
        assert spec["num_accepted_draft_tokens"] + spec["num_steps"] == max_tokens
        assert spec["num_steps"] == m.num_steps
        assert spec["num_accepted_draft_tokens"] == m.num_accepted_tokens
        assert spec["mean_acceptance_length"] == pytest.approx(max_tokens / m.num_steps)
        assert sum(spec["acceptance_histogram"]) == spec["num_steps"]


def test_api_key_guards_the_v1_routes_only(llm):
    """vLLM's --api-key: /v1/* answers 401 (OpenAI's invalid_api_key, which the openai
    client raises as an AuthenticationError) without the bearer key, and works with it;
    /health and /metrics stay open."""
    with serving(llm, api_key="s3cret") as (url, _, _):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = httpx.get(f"{url}/v1/models", headers=headers)
            assert response.status_code == 401, response.text
            assert response.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        out = good.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
        assert out.choices[0].text == _plain(llm, PROMPT, max_new_tokens=4).text
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200


def test_continue_final_message_continues_the_assistants_message(server, client, llm):
    """vLLM's chat fields: the last (assistant's) message left open and continued, as the
    library encodes it; add_generation_prompt=false alone ends the prompt without a new
    turn; both true, or continuing a user's message, is a 400 naming the field."""
    url, _, _ = server
    messages = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"}]
    for opening, continuing in ((False, True), (False, False), (True, False)):
        out = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=8, temperature=0,
            extra_body={"add_generation_prompt": opening, "continue_final_message": continuing},
        )  # fmt: skip
        ids = llm.encode(messages, None, opening, continuing)
        expected = llm.generate(ids, SamplingParams(max_new_tokens=8))
        assert out.choices[0].message.content == expected.text
        assert out.usage.prompt_tokens == len(ids)
    for extra, message in (
        ({"continue_final_message": True}, "add_generation_prompt=false"),
        ({"continue_final_message": True, "add_generation_prompt": False,
          "messages": messages[:1]}, "must be the assistant's"),
    ):  # fmt: skip
        body = {"model": NAME, "messages": messages, "max_tokens": 4, **extra}
        response = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "continue_final_message" and message in error["message"]


def test_chat_template_kwargs_and_stream_options_follow_vllm(server, client, llm):
    """vLLM's ``chat_template_kwargs`` reach the library's encoding (a name specdec sets
    itself is a 400 naming the field); ``stream_options`` without ``stream`` is a 400, as
    in OpenAI's and vLLM's servers."""
    url, _, _ = server
    messages = [{"role": "user", "content": "w1 w2"}]
    out = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    ids = llm.encode(messages, None, chat_template_kwargs={"enable_thinking": False})
    assert out.choices[0].message.content == llm.generate(ids, SamplingParams(max_tokens=6)).text
    for body, param, message in (
        ({"messages": messages, "chat_template_kwargs": {"tokenize": True}},
         "chat_template_kwargs", "cannot set tokenize"),
        ({"messages": messages, "stream_options": {"include_usage": True}},
         "stream_options", "needs stream: true"),
    ):  # fmt: skip
        response = httpx.post(
            f"{url}/v1/chat/completions", json={"model": NAME, "max_tokens": 4, **body}
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and message in error["message"]
    body = {"model": NAME, "prompt": PROMPT, "stream_options": {"include_usage": True}}
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 400


def test_vllms_model_version_and_tokenizer_routes(server, llm):
    """``GET /v1/models/{id}``, ``/version``, ``POST /tokenize`` (what a completions or a
    chat request feeds the model) and ``/detokenize``, with their refusals."""
    url, _, _ = server
    card = httpx.get(f"{url}/v1/models/{NAME}").json()
    assert card["id"] == NAME and card["created"] > 1_700_000_000
    assert card == httpx.get(f"{url}/v1/models").json()["data"][0]
    missing = httpx.get(f"{url}/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{url}/version").json()["version"] == specdec.__version__
    out = httpx.post(f"{url}/tokenize", json={"model": NAME, "prompt": PROMPT}).json()
    assert out["tokens"] == llm.encode(PROMPT, chat=False) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == llm.target.max_context
    messages = [{"role": "user", "content": "w1 w2"}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == llm.encode(messages)
    bare = {"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True}
    plain = httpx.post(f"{url}/tokenize", json=bare).json()
    assert plain["tokens"] == llm.tokenizer.hf(PROMPT, add_special_tokens=False)["input_ids"]
    assert plain["token_strs"] == llm.tokenizer.hf.convert_ids_to_tokens(plain["tokens"])
    back = httpx.post(f"{url}/detokenize", json={"tokens": out["tokens"]}).json()
    assert back["prompt"] == llm.tokenizer.hf.decode(out["tokens"])
    empty = httpx.post(f"{url}/tokenize", json={"prompt": ""})  # a string, if nothing to generate
    assert empty.status_code == 200 and empty.json()["count"] == len(empty.json()["tokens"])
    for route, body, param in (
        ("tokenize", {"prompt": PROMPT, "messages": messages}, "prompt"),
        ("tokenize", {}, "prompt"),
        ("tokenize", {"prompt": " "}, "prompt"),  # whitespace, which this tokenizer drops
        ("tokenize", {"prompt": PROMPT, "model": "other"}, "model"),
        ("detokenize", {"tokens": [10**6]}, "tokens"),
        ("detokenize", {"tokens": [-1]}, "tokens[0]"),
    ):
        response = httpx.post(f"{url}/{route}", json=body)
        assert response.status_code in (400, 404), response.text
        assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_reason_names_the_stop_that_ended_a_choice(server, llm, stream):
    """vLLM's ``stop_reason``: the stop string or stop token id that ended the choice,
    ``None`` for the length limit."""
    url, _, _ = server
    ids = _plain(llm, PROMPT, max_new_tokens=8, ignore_eos=True).token_ids
    word = llm.tokenizer.decode(ids[3:4]).strip()
    cases = (
        ({"stop": ["w_none", word]}, "stop", word),
        ({"stop_token_ids": [ids[3]]}, "stop", ids[3]),
        ({}, "length", None),
    )
    for extra, finish, reason in cases:
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "stream": stream, **extra}  # fmt: skip
        response = httpx.post(f"{url}/v1/completions", json=body)
        if stream:
            chunks = [
                json.loads(line[6:]) for line in response.text.splitlines()
                if line.startswith("data: {")
            ]  # fmt: skip
            choice = chunks[-1]["choices"][0]
        else:
            choice = response.json()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == (finish, reason), extra


def test_speculation_metrics_carry_a_hybrids_draft_sources_only_when_it_has_them():
    from specdec.metrics import SpecStats
    from specdec.server.app import speculation_metrics

    stats = SpecStats(num_steps=5, num_drafts=4, draft_sources={"suffix": 1, "model": 4})
    assert speculation_metrics(stats)["draft_sources"] == {"suffix": 1, "model": 4}
    assert "draft_sources" not in speculation_metrics(SpecStats(num_steps=5))


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_equal_the_library_with_speculation_on_and_off(client, llm, stream):
    """Completions (logprobs = 3) and chat (top_logprobs = 2), streamed or not, speculation
    on and off: the values equal the library's plain decoding (bit-equal: exact mode)."""
    params = SamplingParams(max_new_tokens=12, logprobs=3)
    expected = llm.generate(PROMPT, params, chat=False, speculative=SpeculativeConfig("none"))
    want = [(t.logprob, [lp for _, lp in t.top]) for t in expected.logprobs]
    for speculative in (True, False):
        body = {} if speculative else {"speculative": {"enabled": False}}
        out = client.completions.create(
            model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3, stream=stream,
            extra_body=body,
        )  # fmt: skip
        choices = [c.choices[0] for c in out] if stream else [out.choices[0]]
        tokens, values, tops = [], [], []
        for choice in choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
                tops += choice.logprobs.top_logprobs
        assert len(tokens) == len(expected.token_ids)
        assert values == [v for v, _ in want]
        for top, (_, lps) in zip(tops, want, strict=True):
            assert sorted(top.values(), reverse=True)[:3] == lps
    messages = [{"role": "user", "content": PROMPT}]
    chat_expected = llm.generate(
        messages, SamplingParams(max_new_tokens=10, logprobs=2),
        speculative=SpeculativeConfig("none"),
    )  # fmt: skip
    out = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, logprobs=True,
        top_logprobs=2, stream=stream,
    )  # fmt: skip
    choices = [c.choices[0] for c in out if c.choices] if stream else [out.choices[0]]
    content = [e for c in choices if c.logprobs is not None for e in c.logprobs.content]
    assert [e.logprob for e in content] == [t.logprob for t in chat_expected.logprobs]
    assert [[x.logprob for x in e.top_logprobs] for e in content] == [
        [lp for _, lp in t.top] for t in chat_expected.logprobs
    ]
    assert all(bytes(e.bytes).decode() == e.token for e in content)


def test_no_logprobs_unless_asked(client):
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt(client, llm, stream):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 1): the text starts with
    the prompt, the logprobs with the prompt's tokens (the first ``null``), their values
    the library's prompt_logprobs; streaming puts the prompt in the first chunk."""
    params = SamplingParams(max_new_tokens=3, logprobs=2, prompt_logprobs=2)
    want = llm.generate(PROMPT, params, chat=False)
    out = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
        stream=stream,
    )  # fmt: skip
    choices = [c.choices[0] for c in out] if stream else [out.choices[0]]
    text = "".join(c.text for c in choices)
    assert text == PROMPT + want.text
    if stream:
        assert choices[0].text.startswith(PROMPT)
    values, tops, offsets = [], [], []
    for c in choices:
        if c.logprobs is not None:
            values += c.logprobs.token_logprobs
            tops += c.logprobs.top_logprobs
            offsets += c.logprobs.text_offset
    n_prompt = len(want.prompt_token_ids)
    assert len(values) == n_prompt + len(want.token_ids)
    assert values[0] is None and tops[0] is None
    assert values[1:n_prompt] == [t.logprob for t in want.prompt_logprobs[1:]]
    assert values[n_prompt:] == [t.logprob for t in want.logprobs]
    assert offsets == sorted(offsets) and offsets[0] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, client, llm, stream):
    """OpenAI's legacy scoring request (echo, logprobs, max_tokens 0): the prompt and its
    scores, nothing generated, finish_reason "length"; max_tokens 0 without echo is a 400
    (it would return nothing)."""
    want = llm.generate(PROMPT, SamplingParams(max_new_tokens=1, prompt_logprobs=1), chat=False)
    out = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=0, temperature=0, logprobs=1, echo=True,
        stream=stream, stream_options={"include_usage": True} if stream else None,
    )  # fmt: skip
    chunks = list(out) if stream else [out]
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == PROMPT
    assert [c.finish_reason for c in choices][-1] == "length"
    values = [v for c in choices if c.logprobs is not None for v in c.logprobs.token_logprobs]
    assert values == [None] + [t.logprob for t in want.prompt_logprobs[1:]]
    usage = chunks[-1].usage
    assert usage.completion_tokens == 0 and usage.prompt_tokens == len(want.prompt_token_ids)
    url, _, _ = server
    refused = httpx.post(
        f"{url}/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 0}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_prompt_logprobs_in_vllm_format(server, llm, route):
    url, _, _ = server
    body = {"model": NAME, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}
    if route == "completions":
        body["prompt"] = PROMPT
        want = llm.generate(PROMPT, SamplingParams(max_new_tokens=2, prompt_logprobs=3), chat=False)
    else:
        messages = [{"role": "user", "content": PROMPT}]
        body["messages"] = messages
        want = llm.generate(messages, SamplingParams(max_new_tokens=2, prompt_logprobs=3))
    response = httpx.post(f"{url}/v1/{route}", json=body)
    assert response.status_code == 200, response.text
    data = response.json()  # vLLM: per choice in completions, top level in chat
    scored = (
        data["choices"][0]["prompt_logprobs"] if route == "completions" else data["prompt_logprobs"]
    )
    assert len(scored) == len(want.prompt_token_ids) and scored[0] is None
    for entry, expected in zip(scored[1:], want.prompt_logprobs[1:], strict=True):
        own = entry[str(expected.token_id)]
        assert own["logprob"] == expected.logprob and own["rank"] == expected.rank
        tops = sorted((v["rank"], int(k)) for k, v in entry.items() if v["rank"] <= 3)
        assert [i for _, i in tops][:3] == [i for i, _ in expected.top]
    plain = httpx.post(f"{url}/v1/{route}", json={**body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain["choices"][0] and "prompt_logprobs" not in plain


def test_best_of_answers_the_n_most_probable_candidates(server, llm):
    """best_of sampled candidates (seeds seed .. seed + best_of - 1, each what the library
    gives alone); the answer holds the n with the highest mean log-probability per token,
    usage counts every candidate."""
    url, _, _ = server
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 5,
            "n": 2, "best_of": 4}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    candidates = []
    for i in range(4):
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5 + i, logprobs=0)
        out = llm.generate(PROMPT, params, chat=False)
        mean = sum(t.logprob for t in out.logprobs) / len(out.logprobs)
        candidates.append((-mean, i, out))
    best = [out for _, _, out in sorted(candidates, key=lambda c: (c[0], c[1]))[:2]]
    assert [c["text"] for c in data["choices"]] == [o.text for o in best]
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in data["choices"])
    assert data["usage"]["completion_tokens"] == sum(len(o.token_ids) for *_, o in candidates)
    one = httpx.post(f"{url}/v1/completions", json={**body, "n": 1, "best_of": 2}).json()
    assert len(one["choices"]) == 1 and "speculative_decoding" in one["metrics"]
    bads = ({"best_of": 1, "n": 2}, {"stream": True}, {"temperature": 0})
    for bad, param in ((b, "best_of") for b in bads):
        response = httpx.post(f"{url}/v1/completions", json={**body, **bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_serve_takes_its_api_key_from_the_flag_or_the_environment(monkeypatch):
    import argparse

    from specdec.server.options import add_serve_arguments, check_serve_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    args = parser.parse_args([])
    check_serve_args(args)
    assert args.api_key is None
    monkeypatch.setenv("SPECDEC_API_KEY", "from-env")
    args = parser.parse_args([])
    check_serve_args(args)
    assert args.api_key == "from-env"
    args = parser.parse_args(["--api-key", "flag"])
    check_serve_args(args)
    assert args.api_key == "flag"  # the flag wins, as vLLM's over VLLM_API_KEY
    with pytest.raises(ValueError, match="--api-key is empty"):
        check_serve_args(parser.parse_args(["--api-key", " "]))


def test_max_model_len_caps_what_a_request_may_reach():
    """vLLM's --max-model-len: /v1/models reports it, a prompt reaching it or a max_tokens
    past it is a 400, the default max_tokens fills up to it; above the model's own limit,
    or below 2, it is refused before serving."""
    import argparse

    from specdec.server.options import add_serve_arguments, apply_max_model_len, check_serve_args

    capped = make_server_llm()
    own = capped.target.max_context
    with pytest.raises(ValueError, match="own limit"):
        apply_max_model_len(capped, own + 1)
    apply_max_model_len(capped, 16)
    with serving(capped) as (url, _, _):
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == 16
        prompt = " ".join(["w1"] * 10)
        body = {"model": NAME, "prompt": prompt, "temperature": 0, "ignore_eos": True}
        chat = {"model": NAME, "messages": [{"role": "user", "content": prompt}],
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        out = httpx.post(f"{url}/v1/chat/completions", json=chat).json()  # chat's default:
        assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] == 16  # the rest
        too_long = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 7})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
        long_prompt = {**body, "prompt": " ".join(["w1"] * 20), "max_tokens": 1}
        response = httpx.post(f"{url}/v1/completions", json=long_prompt)
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    with pytest.raises(ValueError, match="--max-model-len must be >= 2"):
        check_serve_args(parser.parse_args(["--max-model-len", "1"]))
