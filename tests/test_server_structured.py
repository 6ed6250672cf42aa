"""Structured output through the live server with the ``openai`` client: OpenAI's
``response_format`` (json_object, json_schema), vLLM's ``structured_outputs`` (json,
regex, choice, grammar) and ``guided_*`` fields, streaming and not, speculation on and off
equal to the library's plain decoding; a grammar ending mid-block; bad constraints are
400s naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_structured import SCHEMA, _valid, make_byte_tokenizer

from conftest import make_model, uvicorn_thread
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.engine import EngineConfig
from specdec.models.native import NativeModel
from specdec.server import create_app
from specdec.structured import StructuredOutputsParams

NAME = "tiny-bytes"
PROMPT = "the cat sat on the mat"


def make_byte_llm(chat_template: str) -> LLM:
    """The tiny byte-level model (exact, native) with this chat template, n-gram drafts."""
    tokenizer = make_byte_tokenizer()
    tokenizer.chat_template = chat_template
    target = NativeModel(make_model(tokenizer, seed=0, max_positions=256, name=NAME), exact=True)
    return LLM(
        target,
        speculative=SpeculativeConfig("ngram", num_speculative_tokens=4),
        engine_config=EngineConfig(max_num_seqs=8, max_num_batched_tokens=256),
    )


@pytest.fixture(scope="module")
def llm():
    return make_byte_llm("{% for m in messages %}{{ m['content'] }} {% endfor %}")


@pytest.fixture(scope="module")
def url(llm):
    with uvicorn_thread(create_app(llm, NAME), log_level="error") as (base, _):
        yield base


@pytest.fixture()
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


REGEX = r"\(\d{3}\) \d{3}-\d{4}"
#: (what the client sends, the library's constraint, the kind for `_valid`)
FIELDS = {
    "response_format json_schema": (
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}},
        StructuredOutputsParams(json=SCHEMA), "json",
    ),
    "response_format json_object": (
        {"response_format": {"type": "json_object"}},
        StructuredOutputsParams(json_object=True), "json_object",
    ),
    "structured_outputs regex": (
        {"structured_outputs": {"regex": REGEX}}, StructuredOutputsParams(regex=REGEX), "regex"
    ),
    "structured_outputs choice": (
        {"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
        StructuredOutputsParams(choice=["yes", "no", "maybe so"]), "choice",
    ),
    "structured_outputs json compact": (
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), "json",
    ),
    "guided_grammar": (
        {"guided_grammar": 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/\n'},
        StructuredOutputsParams(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/\n'),
        "grammar",
    ),
    "guided_choice": (
        {"guided_choice": ["yes", "no", "maybe so"]},
        StructuredOutputsParams(choice=["yes", "no", "maybe so"]), "choice",
    ),
}  # fmt: skip


@pytest.mark.parametrize("field", list(FIELDS))
@pytest.mark.parametrize("stream", [False, True])
def test_each_constraint_equals_the_library_with_speculation_on_and_off(client, llm, field, stream):
    extra, spec, kind = FIELDS[field]
    params = SamplingParams(max_new_tokens=40, structured_outputs=spec)
    want = llm.generate(PROMPT, params, chat=False, speculative=SpeculativeConfig("none"))
    assert (
        want.token_ids
        != llm.generate(PROMPT, SamplingParams(max_new_tokens=40), chat=False).token_ids
    )
    if want.finish_reason == "stop":
        assert _valid(kind, want.text), want.text
    for speculative in (True, False):
        body = dict(extra) | ({} if speculative else {"speculative": {"enabled": False}})
        out = client.completions.create(
            model=NAME, prompt=PROMPT, max_tokens=40, temperature=0, stream=stream,
            stream_options={"include_usage": True} if stream else None, extra_body=body,
        )  # fmt: skip
        if stream:
            chunks = list(out)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            text, finish, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
        assert (text, finish) == (want.text, want.finish_reason)
        assert usage.completion_tokens == len(want.token_ids)


def test_chat_with_a_json_schema_response_format(client, llm):
    messages = [{"role": "user", "content": "a person as JSON"}]
    params = SamplingParams(
        max_new_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    want = llm.generate(messages, params, speculative=SpeculativeConfig("none"))
    out = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    )  # fmt: skip
    assert out.choices[0].message.content == want.text
    assert out.choices[0].finish_reason == want.finish_reason


def test_a_grammar_ending_mid_block_counts_what_was_emitted(url, llm):
    """A single-choice grammar the ngram drafter can copy from the prompt: the whole choice
    arrives in few blocks, the response ends there ("stop"), usage and the speculation
    metrics count the choice's tokens only."""
    text = "the cat sat on the mat"
    prompt = f"{text} and {text} and"
    body = {"model": NAME, "prompt": prompt, "max_tokens": 30, "temperature": 0,
            "ignore_eos": True, "structured_outputs": {"choice": [text]}}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    tokens = llm.tokenizer.hf.encode(text, add_special_tokens=False)
    assert data["choices"][0]["text"] == text and data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] == len(tokens)
    spec = data["metrics"]["speculative_decoding"]
    params = SamplingParams(
        max_new_tokens=30,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=[text]),
    )
    m = llm.generate(prompt, params, chat=False).metrics
    assert (spec["num_steps"], spec["num_accepted_draft_tokens"]) == (
        m.num_steps,
        m.num_accepted_tokens,
    )
    assert spec["num_accepted_draft_tokens"] > 0
    # the last block ended on an accepted draft token: its bonus (EOS) was not emitted
    assert spec["num_accepted_draft_tokens"] + spec["num_steps"] - 1 == len(tokens)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
        ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(url, extra, param):
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_an_ill_posed_request_is_a_400_and_others_still_finish(url, llm):
    """A grammar that needs a banned word: that request gets a 400 naming the dead end; a
    request running beside it gets its normal answer."""
    import threading

    normal = {"model": NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    results = {}
    thread = threading.Thread(
        target=lambda: results.setdefault(
            "normal", httpx.post(f"{url}/v1/completions", json=normal)
        )
    )
    thread.start()
    bad = {"model": NAME, "prompt": PROMPT, "max_tokens": 10, "guided_choice": ["the cat"],
           "bad_words": ["cat"]}  # fmt: skip
    for stream in (False, True):
        response = httpx.post(f"{url}/v1/completions", json={**bad, "stream": stream})
        if stream:
            assert "no token is allowed" in response.text
        else:
            assert response.status_code == 400 and "no token is allowed" in response.text
    thread.join()
    assert results["normal"].status_code == 200
    want = llm.generate(PROMPT, SamplingParams(max_new_tokens=40), chat=False).text
    assert results["normal"].json()["choices"][0]["text"] == want


def test_a_json_schema_format_without_a_schema_asks_for_any_json():
    """OpenAI's ``json_schema.schema`` is optional: without it, the empty schema."""
    from specdec.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate(
        {"model": NAME, "messages": [{"role": "user", "content": "w1"}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}
    )  # fmt: skip
    assert body.structured_spec() == (StructuredOutputsParams(json={}), "response_format")
