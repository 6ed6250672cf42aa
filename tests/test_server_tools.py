"""Tool calling through the live server with the ``openai`` client: a named function and
``"required"`` constrain the output (equal to the library's constrained decoding, with
speculation on and off, streamed and not), ``"auto"`` reads calls with the server's
parser, the tools and earlier calls reach the chat template, and bad tool requests are
400s naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_server_structured import NAME, make_byte_llm

from conftest import uvicorn_thread
from specdec import SamplingParams, SpeculativeConfig
from specdec.server import create_app
from specdec.tools import ToolChoice, check_tools, scan_required, tool_constraint

#: shows the tools and an assistant's calls (their arguments as objects), as real
#: templates (Qwen2.5's, Hermes') do
TEMPLATE = (
    "{% if tools %}TOOLS {% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
    "{% for m in messages %}{{ m['content'] }} "
    "{% for c in m.get('tool_calls', []) %}CALL {{ c.function.name }} "
    "{{ c.function.arguments.city }} {% endfor %}{% endfor %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                    "additionalProperties": False}},
}  # fmt: skip
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "the cat sat on the mat"}]


@pytest.fixture(scope="module")
def llm():
    return make_byte_llm(TEMPLATE)


@pytest.fixture(scope="module")
def url(llm):
    with uvicorn_thread(create_app(llm, NAME, tool_call_parser="hermes"), log_level="error") as (
        base,
        _,
    ):
        yield base


@pytest.fixture(scope="module")
def url_no_parser(llm):
    with uvicorn_thread(create_app(llm, NAME), log_level="error") as (base, _):
        yield base


@pytest.fixture()
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _library(llm, choice: ToolChoice, parallel=True, max_tokens=120):
    """The library's constrained greedy decoding of the chat with the tools."""
    spec = tool_constraint(check_tools(TOOLS), choice, parallel)
    ids = llm.encode(MESSAGES, tools=TOOLS)
    params = SamplingParams(max_new_tokens=max_tokens, structured_outputs=spec)
    return llm.generate(ids, params, speculative=SpeculativeConfig("none"))


def _ask(client, stream: bool, speculative: bool = True, extra=None, max_tokens=120, **fields):
    """One chat request with the tools -> (content, [(id, name, arguments)], finish)."""
    extra = dict(extra or {}) | ({} if speculative else {"speculative": {"enabled": False}})
    out = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=max_tokens, temperature=0, stream=stream,
        tools=TOOLS, extra_body=extra, **fields,
    )  # fmt: skip
    if not stream:
        choice = out.choices[0]
        calls = [
            (c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
        ]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in out:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, [None, None, ""])
                entry[0] = call.id or entry[0]
                entry[1] = (call.function.name if call.function else None) or entry[1]
                entry[2] += (call.function.arguments if call.function else None) or ""
            finish = choice.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("speculative", [True, False])
def test_a_named_function_is_called_with_arguments_from_its_schema(
    client, llm, stream, speculative
):
    want = _library(llm, ToolChoice("named", "get_weather"))
    assert want.finish_reason == "stop" and set(json.loads(want.text)) == {"city"}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish = _ask(client, stream, speculative, tool_choice=choice)
    assert content is None and finish == "stop"  # OpenAI: a forced call ends with "stop"
    ((call_id, name, arguments),) = calls
    assert (name, arguments) == ("get_weather", want.text) and call_id.startswith("call_")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("speculative", [True, False])
def test_required_makes_calls_equal_to_the_librarys(client, llm, stream, speculative):
    want = _library(llm, ToolChoice("required"))
    assert want.finish_reason == "stop"
    expected = [(name, args) for name, args, done in scan_required(want.text) if done]
    assert [name for name, _ in expected] == [c["name"] for c in json.loads(want.text)]
    content, calls, finish = _ask(client, stream, speculative, tool_choice="required")
    assert content is None and finish == "tool_calls"
    assert [(name, args) for _, name, args in calls] == expected
    assert len({call_id for call_id, _, _ in calls}) == len(calls)


def test_parallel_tool_calls_false_allows_one_call(client, llm):
    want = _library(llm, ToolChoice("required"), parallel=False)
    assert len(json.loads(want.text)) == 1
    _, calls, _ = _ask(client, False, True, tool_choice="required", parallel_tool_calls=False)
    assert len(calls) == 1


HERMES_TEXT = (
    'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_models_calls_with_the_servers_parser(client, stream):
    """The model is made to write a hermes call (a one-string choice constraint), as a
    tool-trained model would: the parser turns it into a call."""
    extra = {"structured_outputs": {"choice": [HERMES_TEXT]}}
    content, calls, finish = _ask(client, stream, extra=extra)
    assert content == "Checking." and finish == "tool_calls"
    ((_, name, arguments),) = calls
    assert (name, json.loads(arguments)) == ("get_weather", {"city": "Paris"})


def test_auto_keeps_the_first_call_without_parallel_calls(client):
    two = HERMES_TEXT + '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    for stream in (False, True):
        extra = {"structured_outputs": {"choice": [two]}}
        _, calls, _ = _ask(client, stream, extra=extra, max_tokens=200)
        assert [name for _, name, _ in calls] == ["get_weather", "get_time"]
        _, calls, finish = _ask(
            client, stream, extra=extra, max_tokens=200, parallel_tool_calls=False
        )
        assert [name for _, name, _ in calls] == ["get_weather"] and finish == "tool_calls"


def test_auto_without_calls_answers_in_text(client, llm):
    want = llm.generate(llm.encode(MESSAGES, tools=TOOLS), SamplingParams(max_new_tokens=120),
                        speculative=SpeculativeConfig("none"))  # fmt: skip
    content, calls, finish = _ask(client, False)
    assert (content, calls, finish) == (want.text, [], want.finish_reason)


def test_auto_needs_a_parser_as_in_vllm(url_no_parser):
    r = httpx.post(f"{url_no_parser}/v1/chat/completions",
                   json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in r.json()["error"]["message"]
    forced = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 120,
              "temperature": 0}  # fmt: skip
    r = httpx.post(f"{url_no_parser}/v1/chat/completions", json=forced)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"]
    plain = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4}
    r = httpx.post(f"{url_no_parser}/v1/chat/completions", json=plain)
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]


def test_the_tools_and_earlier_calls_reach_the_chat_template(url, llm):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    r = httpx.post(f"{url}/tokenize", json={"messages": history, "tools": TOOLS,
                                             "tool_choice": "required"})  # fmt: skip
    assert r.status_code == 200, r.text  # a chat body's tool fields are accepted
    text = llm.tokenizer.decode(r.json()["tokens"])
    assert text.startswith("TOOLS get_weather get_time ") and "CALL get_weather Oslo" in text
    body = {"messages": history, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4}
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(llm.encode(history, tools=TOOLS))


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools[0].function.name"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "no"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "string"}}}]}, "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages[0].tool_calls"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
         "messages[0].tool_calls"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field(url, extra, param):
    body = {"messages": MESSAGES, "max_tokens": 4, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_tokenize_checks_tools_as_chat_does(url):
    bad = [{"type": "function", "function": {"name": "bad name"}}]
    r = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES, "tools": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.name"
    r = httpx.post(f"{url}/tokenize", json={"prompt": "hi", "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_completions_still_refuse_tools(url):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_the_library_passes_tools_to_the_template(llm):
    ids = llm.encode(MESSAGES, tools=TOOLS)
    assert llm.tokenizer.decode(ids).startswith("TOOLS get_weather get_time ")
    out = llm.chat(MESSAGES, SamplingParams(max_new_tokens=4), tools=TOOLS)
    assert out.prompt_token_ids == ids
    with pytest.raises(ValueError, match=r"tools\[0\]: only function tools"):
        llm.chat(MESSAGES, SamplingParams(max_new_tokens=4), tools=[{"type": "x"}])
