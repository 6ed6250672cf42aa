"""The library read as vLLM's ``LLM``: prompt dicts, ``RequestOutput``-shaped results
(``.outputs[i].text``, ``n`` choices), ``get_tokenizer``, ``chat``'s template arguments,
``use_tqdm``, and the calls that refuse what they cannot do with a clear error."""

from __future__ import annotations

import pytest

from conftest import make_server_llm
from specdec import LLM, Choices, GenerationOutput, SamplingParams, SpeculativeConfig
from specdec.engine import EngineConfig

PROMPT = "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"
GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def llm():
    return make_server_llm()


def test_vllm_prompt_dicts_are_the_text_or_the_ids(llm):
    """``{"prompt": text}`` is raw text, as vLLM reads it (the chat template only with
    ``chat=True``), ``{"prompt_token_ids": ids}`` the ids, alone and in a batch."""
    ids = llm.encode(PROMPT, chat=False)
    raw = llm.generate(PROMPT, GREEDY, chat=False)
    assert llm.generate({"prompt": PROMPT}, GREEDY).token_ids == raw.token_ids
    assert llm.generate({"prompt": PROMPT}, GREEDY).prompt_token_ids == ids
    templated = llm.generate({"prompt": PROMPT}, GREEDY, chat=True)
    assert templated.prompt_token_ids == llm.generate(PROMPT, GREEDY).prompt_token_ids
    assert llm.generate({"prompt_token_ids": ids}, GREEDY).token_ids == raw.token_ids
    batch = llm.generate([{"prompt": PROMPT}, {"prompt_token_ids": ids[:5]}], GREEDY)
    assert [o.token_ids for o in batch] == [
        raw.token_ids,
        llm.generate(ids[:5], GREEDY).token_ids,
    ]
    assert batch[0].prompt == PROMPT and batch[1].prompt is None


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"prompt": PROMPT, "prompt_token_ids": [1]}, "not both"),
        ({"prompt": PROMPT, "multi_modal_data": {}}, "'multi_modal_data' are not supported"),
        ({"role": "user", "content": PROMPT}, "must come in a list"),
        ({"prompt": 5}, "'prompt' must be a string"),
        ({"prompt_token_ids": "w1"}, "must be a list of token ids"),
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": " \n"}, "encodes to no tokens"),  # this word-level tokenizer drops whitespace
        ({}, "it has neither"),
        ([{"prompt": PROMPT}, {}], "it has neither"),  # a batch, not a chat
    ],
)
def test_bad_prompt_dicts_are_refused(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, GREEDY)


def test_results_read_as_vllm_request_outputs(llm):
    """One output is its own only choice; ``n`` choices come as :class:`Choices`, which
    is the list specdec always returned and vLLM's ``RequestOutput`` at once."""
    out = llm.generate(PROMPT, GREEDY)
    assert isinstance(out, GenerationOutput)
    assert out.outputs == [out] and out.outputs[0].index == 0 and out.finished
    assert out.prompt == PROMPT
    assert llm.generate(llm.encode(PROMPT), GREEDY).prompt is None
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3)
    results = llm.generate([PROMPT, "w3 w4"], sampled)
    for prompt, choices in zip([PROMPT, "w3 w4"], results, strict=True):
        assert isinstance(choices, Choices) and len(choices) == 3
        assert choices.outputs == list(choices) and choices.finished
        assert [c.index for c in choices.outputs] == [0, 1, 2]
        assert choices.prompt == prompt and choices.prompt_token_ids == llm.encode(prompt)
    alone = llm.generate("w3 w4", sampled)
    assert [c.token_ids for c in alone] == [c.token_ids for c in results[1]]


def test_generate_takes_vllms_keyword_names(llm):
    """``generate(prompts=..., sampling_params=...)`` as vLLM scripts call it; ``prompt=``
    too; both is a TypeError, neither a bad prompt."""
    by_name = llm.generate(prompts=[PROMPT], sampling_params=GREEDY)
    assert [o.token_ids for o in by_name] == [llm.generate(PROMPT, GREEDY).token_ids]
    assert llm.generate(prompt=PROMPT, sampling_params=GREEDY).token_ids == by_name[0].token_ids
    with pytest.raises(TypeError, match="takes the prompt"):
        llm.generate(prompts=PROMPT, prompt=PROMPT, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="prompt must be"):
        llm.generate(sampling_params=GREEDY)


def test_get_tokenizer_is_the_hugging_face_tokenizer(llm):
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer.hf
    assert tokenizer(PROMPT)["input_ids"] == llm.encode(PROMPT, chat=False)


def test_chat_takes_vllms_template_arguments(llm):
    """``chat(..., continue_final_message=, add_generation_prompt=, chat_template_kwargs=)``
    is ``generate`` on what ``encode`` makes of the conversation with them."""
    messages = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]
    for flags in (
        {"add_generation_prompt": False, "continue_final_message": True},
        {"chat_template_kwargs": {"enable_thinking": False}},
    ):
        ids = llm.encode(messages, True, **flags)
        expected = llm.generate(ids, GREEDY).token_ids
        assert llm.chat(messages, GREEDY, **flags).token_ids == expected
        assert [o.token_ids for o in llm.chat([messages, messages], GREEDY, **flags)] == [
            expected,
            expected,
        ]
    with pytest.raises(ValueError, match="add_generation_prompt=false"):
        llm.chat(messages, GREEDY, continue_final_message=True)


def test_use_tqdm_shows_progress_and_changes_nothing(llm, capsys):
    prompts = [PROMPT, "w3 w4 w5"]
    quiet = llm.generate(prompts, GREEDY)
    assert "requests" not in capsys.readouterr().err
    shown = llm.generate(prompts, GREEDY, use_tqdm=True)
    assert "requests" in capsys.readouterr().err
    assert [o.token_ids for o in shown] == [o.token_ids for o in quiet]


def test_stream_refuses_a_batch_by_name(llm):
    with pytest.raises(ValueError, match="stream takes one prompt"):
        llm.stream([PROMPT, PROMPT], GREEDY)
    chunks = list(llm.stream({"prompt": PROMPT}, GREEDY))
    assert chunks[-1].output.token_ids == llm.generate({"prompt": PROMPT}, GREEDY).token_ids


def test_outputs_carry_vllms_request_id_cumulative_logprob_and_cached_tokens(llm):
    """``request_id`` counts prompts per LLM as vLLM's do ("0", "1", ...; a prompt's n
    choices share one; stream and chat count too); ``outputs[0].cumulative_logprob`` is the
    sum of the tokens' log-probabilities when they were asked for, else None;
    ``num_cached_tokens`` is the prompt tokens the prefix cache served."""
    fresh = LLM(llm.target, speculative=llm.speculative)
    one = fresh.generate(PROMPT, GREEDY)
    batch = fresh.generate([PROMPT, {"prompt": PROMPT}], GREEDY)
    choices = fresh.generate(PROMPT, SamplingParams(max_tokens=4, n=2, temperature=1, seed=0))
    streamed = list(fresh.stream(PROMPT, GREEDY))[-1].output
    chatted = fresh.chat([{"role": "user", "content": PROMPT}], GREEDY)
    assert [one.request_id, *(o.request_id for o in batch)] == ["0", "1", "2"]
    assert choices.request_id == "3" and {c.request_id for c in choices} == {"3"}
    assert (streamed.request_id, chatted.request_id) == ("4", "5")
    assert one.outputs[0].cumulative_logprob is None
    scored = fresh.generate(PROMPT, SamplingParams(max_tokens=6, logprobs=1))
    assert scored.outputs[0].cumulative_logprob == sum(t.logprob for t in scored.logprobs)
    assert scored.outputs[0].cumulative_logprob < 0
    assert one.num_cached_tokens == 0 and choices.num_cached_tokens == 0
    config = EngineConfig(enable_prefix_caching=True, prefill_chunk=8)
    cached = LLM(llm.target, speculative=llm.speculative, engine_config=config)
    long = " ".join(f"w{i % 7}" for i in range(40))
    cached.generate([long], GREEDY)
    again = cached.generate([long], GREEDY)[0]
    assert again.num_cached_tokens > 0
    assert again.num_cached_tokens == again.metrics.num_cached_tokens


def test_call_arguments_of_the_wrong_type_are_refused_by_name(llm):
    """``generate`` / ``stream`` / ``chat`` with a string for ``speculative``, a dict of
    unknown fields for ``sampling_params``, or messages a chat template cannot read get a
    ValueError naming the argument (they raised AttributeError or jinja2's UndefinedError);
    a dict of SamplingParams' fields is read as SamplingParams."""
    for call in (llm.generate, llm.stream):
        with pytest.raises(ValueError, match="speculative must be a SpeculativeConfig.*got str"):
            list(call(PROMPT, GREEDY, speculative="suffix"))
        with pytest.raises(ValueError, match="sampling_params must be a SamplingParams.*int"):
            list(call(PROMPT, 4))
        with pytest.raises(ValueError, match="unknown field.*'max_length'"):
            list(call(PROMPT, {"max_length": 4}))
    with pytest.raises(ValueError, match="speculative must be a SpeculativeConfig"):
        llm.generate([PROMPT, PROMPT], GREEDY, speculative=["suffix", None])
    as_dict = llm.generate(PROMPT, {"max_tokens": 4, "temperature": 0})
    assert as_dict.token_ids == llm.generate(PROMPT, SamplingParams(max_tokens=4)).token_ids
    batch = llm.generate([PROMPT, PROMPT], [{"max_tokens": n, "ignore_eos": True} for n in (3, 4)])
    assert [len(o.token_ids) for o in batch] == [3, 4]
    bad = [
        ([{"role": "user"}], r"messages\[0\] \(user\) has no 'content'"),
        ([{"role": "", "content": "hi"}], r"messages\[0\].role must be a non-empty string"),
        ([{"content": "hi"}], r"messages\[0\].role must be a non-empty string, got None"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}],
         r"messages\[1\].content must be a string or a list of content parts, got int"),
    ]  # fmt: skip
    for messages, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.chat(messages, GREEDY)
    parts = [{"type": "text", "text": "w1 w2"}, {"type": "text", "text": "w3"}]
    with pytest.raises(ValueError, match=r"messages\[0\].content\[1\] must be a text part"):
        llm.chat([{"role": "user", "content": [parts[0], {"type": "image_url"}]}], GREEDY)
    with pytest.raises(ValueError, match=r"messages\[0\].content is None"):
        llm.chat([{"role": "user", "content": None}], GREEDY)
    # as the server and vLLM read them: text parts joined with "\n", an assistant's None ""
    joined = [{"role": "user", "content": "w1 w2\nw3"}]
    assert llm.encode([{"role": "user", "content": parts}]) == llm.encode(joined)
    assert (llm.chat([{"role": "user", "content": parts}], GREEDY).token_ids
            == llm.chat(joined, GREEDY).token_ids)  # fmt: skip
    reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
             {"role": "user", "content": "again"}]  # fmt: skip
    empty = [reply[0], {"role": "assistant", "content": ""}, reply[2]]
    assert llm.chat(reply, GREEDY).prompt_token_ids == llm.encode(empty)
    assert reply[1]["content"] is None  # the caller's messages are not changed
    # any role the template knows, as vLLM's LLM.chat takes (e.g. Llama 3.1's ipython)
    assert llm.encode([{"role": "ipython", "content": "w1"}, reply[0]])
    pair = llm.generate([PROMPT, PROMPT], (GREEDY, SamplingParams(max_tokens=3)))  # a tuple
    assert len(pair) == 2


def test_vllms_speculative_config_fields_are_read():
    """A new user's trial: vLLM's ``{"method": "eagle3", "model": HEAD}`` and its
    prompt-lookup sizes were refused as unknown fields."""
    from specdec.llm import _from_vllm_fields, _speculative_config

    def spec(**fields):
        return _speculative_config(fields)

    assert spec(method="ngram", prompt_lookup_max=5, prompt_lookup_min=1) == SpeculativeConfig(
        "ngram:max_n=5,min_n=1"
    )
    assert spec(prompt_lookup_max=3, num_speculative_tokens=4) == SpeculativeConfig(
        "ngram:max_n=3", num_speculative_tokens=4
    )
    assert _from_vllm_fields({"method": "eagle3", "model": "/heads/e"}) == {
        "method": "eagle:head=/heads/e"
    }
    assert _from_vllm_fields({"method": "medusa", "model": "h"}) == {"method": "medusa:head=h"}
    for fields in ({"model": "d"}, {"method": "draft_model", "model": "d"}):
        assert _from_vllm_fields(fields) == {"method": "draft-model", "draft_model": "d"}
    assert _from_vllm_fields({"method": "eagle3"}) == {"method": "eagle"}
    assert _from_vllm_fields({"method": "suffix", "num_speculative_tokens": 8}) == {
        "method": "suffix", "num_speculative_tokens": 8
    }  # fmt: skip
    with pytest.raises(ValueError, match="'model' names a draft model or a head"):
        spec(method="suffix", model="x")
    with pytest.raises(ValueError, match="prompt_lookup_max / prompt_lookup_min are ngram's"):
        spec(method="suffix", prompt_lookup_max=3)


def test_speculative_settings_as_a_dict(llm):
    """``speculative={...}`` (vLLM's ``speculative_config`` shape) is a
    :class:`SpeculativeConfig` of those fields; anything else is refused by name."""
    as_dict = LLM(llm.target, speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert as_dict.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert as_dict.generate(PROMPT, GREEDY).token_ids == llm.generate(PROMPT, GREEDY).token_ids
    with pytest.raises(ValueError, match="unknown field.*'prompt_lookup'.*vLLM's fields"):
        LLM(llm.target, speculative={"method": "ngram", "prompt_lookup": 4})
    with pytest.raises(ValueError, match="must be a SpeculativeConfig.*got str"):
        LLM(llm.target, speculative="ngram")
    # vLLM's own keyword takes the same values; both at once are refused
    vllm_style = LLM(
        llm.target, speculative_config={"method": "ngram", "num_speculative_tokens": 3}
    )
    assert vllm_style.speculative == as_dict.speculative
    with pytest.raises(ValueError, match="speculative or speculative_config"):
        LLM(llm.target, speculative=as_dict.speculative, speculative_config={"method": "ngram"})
    plain = {"method": "none"}  # per call too: generate, a batch, stream
    expected = llm.generate(PROMPT, GREEDY, speculative=SpeculativeConfig(method="none"))
    assert llm.generate(PROMPT, GREEDY, speculative=plain).metrics.num_draft_tokens == 0
    batch = llm.generate([PROMPT, PROMPT], GREEDY, speculative=[plain, None])
    assert [o.token_ids for o in batch] == [expected.token_ids] * 2
    chunks = list(llm.stream(PROMPT, GREEDY, speculative=plain))
    assert chunks[-1].output.token_ids == expected.token_ids


def test_stop_reason_names_the_stop_like_vllm(llm):
    """``stop_reason``: the stop string or requested stop token id that ended the output,
    ``None`` for the length limit; the same alone, in a batch and streamed."""
    ids = llm.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)).token_ids
    word = llm.tokenizer.decode(ids[3:4]).strip()
    for extra, reason in (({"stop": ["w_none", word]}, word), ({"stop_token_ids": [ids[3]]},
                          ids[3]), ({}, None)):  # fmt: skip
        params = SamplingParams(max_tokens=8, ignore_eos=True, **extra)
        alone = llm.generate(PROMPT, params)
        assert alone.stop_reason == reason and alone.outputs[0].stop_reason == reason
        assert [o.stop_reason for o in llm.generate([PROMPT, PROMPT], params)] == [reason] * 2
        assert list(llm.stream(PROMPT, params))[-1].output.stop_reason == reason
