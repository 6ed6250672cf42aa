"""specdec.tools: OpenAI's function tools and tool choice checked, the constraint of a
forced choice, the hermes and llama3_json parsers, and the streamed deltas of a choice."""

from __future__ import annotations

import json

import pytest

from specdec.tools import (
    TOOL_CALL_PARSERS,
    ToolCall,
    ToolCallStream,
    ToolChoice,
    check_tool_choice,
    check_tools,
    finish,
    read_forced,
    template_tool_calls,
    tool_call_parser,
    tool_constraint,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = check_tools([WEATHER, TIME])
HERMES = TOOL_CALL_PARSERS["hermes"]
LLAMA = TOOL_CALL_PARSERS["llama3_json"]


def test_tools_are_checked_and_given_an_object_schema_by_default():
    assert TOOLS[0] == {"type": "function", "function": WEATHER["function"]}
    # no parameters: OpenAI's function without arguments (its only call is "{}")
    assert TOOLS[1]["function"]["parameters"] == {
        "type": "object", "properties": {}, "additionalProperties": False,
    }  # fmt: skip
    untyped = check_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": {"type": "integer"}}}}}])  # fmt: skip
    assert untyped[0]["function"]["parameters"]["type"] == "object"


@pytest.mark.parametrize(
    "tools, where",
    [
        ({"type": "function"}, "tools must be a list"),
        ([{"type": "retrieval"}], "tools[0]: only function tools"),
        ([{"type": "function", "function": "f"}], "tools[0].function must be"),
        ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
        ([TIME, TIME], "tools[1].function.name: 'get_time' is defined twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "parameters"),
        ([{"type": "function", "function": {"name": "f", "params": {}}}], "unknown field 'params'"),
        ([{"type": "function", "function": {"name": "f", "description": 3}}], "description"),
        ([TIME] * 129, "at most 128"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
         'tools[0].function.parameters must be a JSON schema of "type": "object"'),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_the_entry(tools, where):
    with pytest.raises(ValueError) as error:
        check_tools(tools)
    assert where in str(error.value)


def test_tool_choice_defaults_and_checks():
    assert check_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert check_tool_choice(None, []) == ToolChoice("none")
    assert check_tool_choice("auto", []) == ToolChoice("none")  # no tool to pick
    assert check_tool_choice("none", TOOLS) == ToolChoice("none")
    assert check_tool_choice("required", TOOLS).forced
    named = {"type": "function", "function": {"name": "get_time"}}
    assert check_tool_choice(named, TOOLS) == ToolChoice("named", "get_time")
    with pytest.raises(ValueError, match="needs tools"):
        check_tool_choice("required", [])
    with pytest.raises(ValueError, match="'nope', which no tool defines"):
        check_tool_choice({"type": "function", "function": {"name": "nope"}}, TOOLS)
    with pytest.raises(ValueError, match="must be"):
        check_tool_choice("any", TOOLS)
    with pytest.raises(ValueError, match="names a function as"):
        check_tool_choice({"name": "get_time"}, TOOLS)
    with pytest.raises(ValueError, match="tool_choice of type 'allowed_tools' is not supported"):
        check_tool_choice({"type": "allowed_tools", "allowed_tools": {}}, TOOLS)


def test_a_named_choice_constrains_the_output_to_its_arguments():
    spec = tool_constraint(TOOLS, ToolChoice("named", "get_weather"))
    assert spec.kind == "json" and json.loads(spec.json) == WEATHER["function"]["parameters"]
    assert tool_constraint(TOOLS, ToolChoice("auto")) is None
    assert tool_constraint(TOOLS, ToolChoice("none")) is None


def test_required_is_an_array_of_calls_one_without_parallel_calls():
    schema = json.loads(tool_constraint(TOOLS, ToolChoice("required")).json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    one = json.loads(tool_constraint(TOOLS, ToolChoice("required"), parallel=False).json)
    assert one["maxItems"] == 1


def test_required_moves_each_tools_defs_to_the_top():
    def tool(name, defs):
        params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": defs}
        return {"type": "function", "function": {"name": name, "parameters": params}}

    tools = check_tools([tool("a", {"P": {"type": "integer"}}), tool("b", {"Q": {}})])
    schema = json.loads(tool_constraint(tools, ToolChoice("required")).json)
    assert schema["$defs"] == {"P": {"type": "integer"}, "Q": {}}
    assert all("$defs" not in o["properties"]["parameters"] for o in schema["items"]["anyOf"])
    clash = check_tools([tool("a", {"P": {"type": "integer"}}), tool("b", {"P": {}})])
    with pytest.raises(ValueError, match=r"\$defs/P differently"):
        tool_constraint(clash, ToolChoice("required"))


def test_hermes_reads_calls_and_keeps_the_text_around_them():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call> and <tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.'  # noqa: E501
    content, calls = HERMES.parse(text)
    assert content == "Let me look.\n and  Done."  # no text is lost
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {}),
    ]  # fmt: skip
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    # an unclosed last block (cut by a stop string) is read; a broken one leaves the text
    assert HERMES.parse('<tool_call>{"name": "get_time", "arguments": {}}')[1][0].name == "get_time"
    broken = '<tool_call>{"name": "get_time", "arguments": </tool_call>'
    assert HERMES.parse(broken) == (broken, [])
    assert HERMES.parse("no calls here") == ("no calls here", [])
    assert HERMES.parse("") == (None, [])
    args_text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert HERMES.parse(args_text)[1][0].arguments == '{"a": 1}'  # arguments given as text


def test_llama3_json_reads_a_bare_object_or_several():
    content, calls = LLAMA.parse(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    )
    assert content is None and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    two = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "x"}}'  # noqa: E501
    assert [c.name for c in LLAMA.parse(two)[1]] == ["get_time", "get_weather"]
    assert LLAMA.parse("The answer is {x}.") == ("The answer is {x}.", [])  # not at the start
    assert LLAMA.parse('{"city": "Oslo"}') == ('{"city": "Oslo"}', [])  # no name: text
    assert LLAMA.parse('{"name": "f", "parameters": {}} and more')[1] == []


def test_mistral_reads_a_json_array_opening_the_output():
    mistral = TOOL_CALL_PARSERS["mistral"]
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lima"}}, {"name": "get_time", "arguments": {}}]'  # noqa: E501
    content, calls = mistral.parse(text)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert mistral.parse('[{"name": "get_time", "arguments": {}}]')[1][0].name == "get_time"
    assert mistral.parse("[1] a list") == ("[1] a list", [])  # not calls: text
    assert mistral.parse('[{"name": "f", "arguments": {}}] more')[1] == []
    deltas, reason = _stream(ToolChoice("auto"), mistral, ["[1", "] first"])
    assert "".join(d.get("content", "") for d in deltas) == "[1] first" and reason == "stop"


def test_an_unknown_parser_names_the_known_ones():
    assert tool_call_parser("hermes") is HERMES
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        tool_call_parser("pythonic")


def test_finish_turns_forced_output_into_calls_and_keeps_a_cut_one_as_text():
    named = ToolChoice("named", "get_weather")
    content, calls, reason = finish(named, None, '{"city": "Rome"}', "stop")
    assert (content, reason) == (None, "stop")
    assert (calls[0].name, calls[0].arguments) == ("get_weather", '{"city": "Rome"}')
    content, calls, reason = finish(named, None, '{"city": "Ro', "length")  # as streamed
    assert (content, calls[0].arguments, reason) == (None, '{"city": "Ro', "length")
    required = ToolChoice("required")
    out = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "a"}}]'  # noqa: E501
    content, calls, reason = finish(required, None, out, "stop")
    assert [c.name for c in calls] == ["get_time", "get_weather"] and reason == "tool_calls"
    assert [c.arguments for c in calls] == ["{}", '{"city": "a"}']  # the text as generated
    cut = out[: out.rindex('"a"')]  # cut by max_tokens: as streamed
    content, calls, reason = finish(required, None, cut, "length")
    assert [c.arguments for c in calls] == ["{}", '{"city": '] and reason == "length"
    assert finish(required, None, '[{"name": "get_ti', "length") == (
        '[{"name": "get_ti',
        [],
        "length",
    )  # cut before any call: the text
    assert read_forced(required, "[]") is None and read_forced(required, "{}") is None
    assert read_forced(named, '{"city": "Rome"}')[0].name == "get_weather"
    assert read_forced(named, '{"city": "Ro') is None
    auto = ToolChoice("auto")
    text = 'Hi <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert finish(auto, HERMES, text, "stop")[2] == "tool_calls"
    two = text + '<tool_call>{"name": "get_weather", "arguments": {"city": "x"}}</tool_call>'
    assert [c.name for c in finish(auto, HERMES, two, "stop")[1]] == ["get_time", "get_weather"]
    one = ToolChoice("auto", parallel=False)  # parallel_tool_calls: false keeps the first
    assert [c.name for c in finish(one, HERMES, two, "stop")[1]] == ["get_time"]
    assert finish(auto, HERMES, text, "length")[2] == "length"
    assert finish(auto, None, text, "stop") == (text, [], "stop")  # no parser: text
    assert finish(ToolChoice("none"), HERMES, text, "stop") == (text, [], "stop")


def _stream(choice, parser, pieces, reason="stop"):
    stream = ToolCallStream(choice, parser)
    deltas = [stream.push(p, None) for p in pieces]
    assert all(r is None for _, r in deltas)
    last, final = stream.push("", reason)
    return [d for d, _ in deltas if d is not None] + [last], final


def test_auto_streams_the_content_holding_back_a_partial_tag():
    text = 'Sure.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    for size in (1, 3, 7, len(text)):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        deltas, reason = _stream(ToolChoice("auto"), HERMES, pieces)
        content = "".join(d.get("content", "") for d in deltas)
        assert content == "Sure." and reason == "tool_calls"
        assert not any("<" in d.get("content", "") for d in deltas)  # no piece of the tag
        (call,) = deltas[-1]["tool_calls"]
        assert call["index"] == 0 and call["function"]["name"] == "get_time"
    # a "<" that opens no call is sent once the next text shows it
    deltas, reason = _stream(ToolChoice("auto"), HERMES, ["a <", "b", " c"])
    assert "".join(d.get("content", "") for d in deltas) == "a <b c" and reason == "stop"


def test_whitespace_before_a_call_is_not_streamed_as_content():
    text = '\n\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    deltas, reason = _stream(ToolChoice("auto"), HERMES, [text[:1], text[1:2], text[2:]])
    assert not any("content" in d for d in deltas) and reason == "tool_calls"
    assert finish(ToolChoice("auto"), HERMES, text, "stop")[0] is None  # as not streamed
    deltas, _ = _stream(ToolChoice("auto"), HERMES, ["\n", "\nHi"])
    assert "".join(d.get("content", "") for d in deltas) == "\n\nHi"


def test_a_stream_whose_calls_do_not_parse_sends_them_as_text():
    pieces = ["x", "<tool_call>", "{broken"]
    deltas, reason = _stream(ToolChoice("auto"), HERMES, pieces, "length")
    assert "".join(d.get("content", "") for d in deltas) == "x<tool_call>{broken"
    assert reason == "length" and not any("tool_calls" in d for d in deltas)


def test_a_named_choice_streams_its_arguments_as_they_come():
    deltas, reason = _stream(ToolChoice("named", "get_weather"), None, ['{"ci', 'ty": "A"}'])
    first = deltas[0]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": '{"ci'} and first["id"]
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert args == '{"city": "A"}' and reason == "stop"
    assert all(set(d["tool_calls"][0]) == {"index", "function"} for d in deltas[1:])


def test_required_streams_each_call_as_it_is_generated():
    out = '[{"name":"get_time","parameters":{"tz":"a}\\"b"}},{"name":"get_weather","parameters":{"city":"Lima"}}]'  # noqa: E501
    for size in (1, 5, len(out)):
        pieces = [out[i : i + size] for i in range(0, len(out), size)]
        deltas, reason = _stream(ToolChoice("required"), None, pieces)
        assert reason == "tool_calls" and all("content" not in d for d in deltas)
        calls: dict = {}
        for d in deltas:
            for entry in d.get("tool_calls", []):
                call = calls.setdefault(entry["index"], {"id": None, "name": None, "args": ""})
                call["id"] = entry.get("id", call["id"])
                call["name"] = entry["function"].get("name", call["name"])
                call["args"] += entry["function"]["arguments"]
        got = [(c["name"], c["args"]) for _, c in sorted(calls.items())]
        assert got == [("get_time", '{"tz":"a}\\"b"}'), ("get_weather", '{"city":"Lima"}')]
        assert [c.arguments for c in finish(ToolChoice("required"), None, out, "stop")[1]] == [
            a for _, a in got
        ]  # streamed = not streamed
        assert all(c["id"] for c in calls.values())
    deltas, reason = _stream(ToolChoice("required"), None, ['[{"na'], "length")
    assert deltas[-1] == {"content": '[{"na'} and reason == "length"


def test_no_tools_streams_content_unchanged():
    deltas, reason = _stream(ToolChoice("none"), None, ["a", "", "b"], "length")
    assert deltas == [{"content": "a"}, {"content": "b"}, {"content": ""}] and reason == "length"


def test_template_tool_calls_give_the_template_arguments_as_objects():
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]  # fmt: skip
    assert template_tool_calls(calls) == [
        {"type": "function", "id": "call_1",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"tool_calls\[0\].function.arguments"):
        template_tool_calls([{"function": {"name": "f", "arguments": "[1]"}}])
    with pytest.raises(ValueError, match=r"tool_calls\[0\] must be"):
        template_tool_calls([{"function": {"arguments": "{}"}}])


def test_a_tool_call_in_openais_form():
    call = ToolCall("f", "{}", id="call_x")
    assert call.openai() == {"id": "call_x", "type": "function",
                             "function": {"name": "f", "arguments": "{}"}}  # fmt: skip
    assert call.openai(2)["index"] == 2


# ------------------------------------------------ lossless under speculation (end to end)

TINY_TOOLS = check_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
])  # fmt: skip


@pytest.fixture(scope="module")
def byte_llm():
    from test_structured import make_byte_tokenizer

    from conftest import make_model, perturbed_copy
    from specdec import LLM, SpeculativeConfig

    target = make_model(make_byte_tokenizer(), seed=0, max_positions=256, name="tiny-bytes")
    draft = perturbed_copy(target, noise=0.02, seed=5, name="tiny-bytes-draft")
    return LLM(target, draft=draft, speculative=SpeculativeConfig("ngram"))


@pytest.mark.parametrize("choice", [ToolChoice("named", "get_weather"), ToolChoice("required")])
def test_forced_calls_under_speculation_equal_plain_decodings(byte_llm, choice):
    """Greedy: every drafter, chains and trees, returns plain decoding's calls; seeded
    sampling returns parseable calls (the constraint holds whatever was drafted)."""
    from specdec import SamplingParams, SpeculativeConfig

    spec = tool_constraint(TINY_TOOLS, choice, parallel=False)
    params = SamplingParams(max_new_tokens=200, structured_outputs=spec)
    plain = byte_llm.generate("the cat sat", params, speculative=SpeculativeConfig("none"))
    assert plain.finish_reason == "stop" and read_forced(choice, plain.text)
    for method, tree in [("ngram", None), ("draft-model", None), ("suffix", None),
                         ("draft-model", "dynamic:top_k=3,depth=4,budget=10"),
                         ("ngram", "static:tree-8")]:  # fmt: skip
        out = byte_llm.generate(
            "the cat sat", params, speculative=SpeculativeConfig(method, 4, tree=tree)
        )
        assert out.token_ids == plain.token_ids, (method, tree)
    finished = 0
    for seed in range(3):
        sampled = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=200,
                                 structured_outputs=spec)  # fmt: skip
        out = byte_llm.generate(
            "the cat sat", sampled, speculative=SpeculativeConfig("draft-model", 4)
        )
        if out.finish_reason == "stop":
            finished += 1
            calls = read_forced(choice, out.text)
            assert calls and {c.name for c in calls} <= {"get_weather", "get_time"}, out.text
    assert finished


class _Never:
    """A controller that never drafts (``choose`` -> 0)."""

    name = "never"

    def start(self, info):
        return self

    def choose(self, view):
        return 0

    def observe(self, outcome):
        pass


def test_forced_tokens_are_drafted_when_the_controller_chose_none(byte_llm):
    """The grammar's forced tokens raise a step's k (``_forced_k``): with a controller that
    never drafts, a forced call still takes fewer steps than tokens, and equals plain
    decoding."""
    from specdec import SamplingParams, SpeculativeConfig
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engine import Engine

    spec = tool_constraint(TINY_TOOLS, ToolChoice("named", "get_weather"))
    params = SamplingParams(max_new_tokens=40, structured_outputs=spec)
    prompt = byte_llm.encode("the cat sat", chat=False)
    plain = byte_llm.generate(prompt, params, speculative=SpeculativeConfig("none"))
    engine = Engine(byte_llm.target)
    engine.add_request(
        "0", prompt, params, drafter=NgramDrafter(), num_speculative_tokens=8,
        controller=_Never(), grammar=byte_llm.grammars.matcher(spec),
    )  # fmt: skip
    tokens, steps = [], 0
    while engine.has_unfinished():
        for _, out in engine.step():
            tokens += out.new_token_ids
            steps += 1
    assert tokens == plain.token_ids and plain.text.startswith('{"city":"')
    assert steps < len(tokens)
