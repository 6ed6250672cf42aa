"""OpenAI Predicted Outputs: the prediction as a draft source, lossless, with OpenAI's
accepted / rejected prediction token counts, in the library and on the live server.

Oracles: the drafter's alignment on hand-made outputs; greedy output with a prediction
(exact, edited, unrelated) equal to plain decoding token for token, and the counts derived
from the output by hand; a sampled chi-square against the exact law of plain decoding;
the server's usage against the library; refusals.
"""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch
from test_engine import PROMPTS
from test_statistical import PROMPT, chi_square_pvalue

from conftest import make_server_llm, uvicorn_thread
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.prediction import PredictionDrafter
from specdec.server import create_app

# ------------------------------------------------------------ the drafter


def test_the_drafter_follows_the_prediction_and_realigns():
    pred = [10, 11, 12, 13, 14, 15, 16, 17]
    drafter = PredictionDrafter(pred)
    state = drafter.start([1, 2], SamplingParams())
    g = torch.Generator()
    assert state.propose([1, 2], 3, g).token_ids == [10, 11, 12]  # empty output: the start
    assert state.propose([1, 2, 10, 11], 3, g).token_ids == [12, 13, 14]
    # an inserted token (99), then the output rejoins the prediction at 13
    assert state.propose([1, 2, 10, 11, 12, 99], 3, g).token_ids == []  # nothing matches 99...
    assert state.propose([1, 2, 10, 11, 12, 99, 13], 3, g).token_ids == [14, 15, 16]
    assert state.propose([1, 2, 10, 11, 12, 99, 13, 14, 15, 16, 17], 3, g).token_ids == []
    output = [10, 11, 12, 99, 13, 14, 15, 16, 17]
    assert drafter.usage(output) == (8, 0)  # every prediction token is in the output, in order
    assert drafter.usage(output[:1]) == (1, 7)  # a stop cut the output
    assert drafter.usage([17, 10]) == (1, 7)  # in order only


def test_repeated_lines_are_followed_in_order():
    """With a repeated n-gram the draft continues after the previous alignment."""
    line = [5, 6, 7]
    drafter = PredictionDrafter(line + [8] + line + [9])
    state = drafter.start([1], SamplingParams())
    g = torch.Generator()
    state.propose([1], 4, g)  # aligned at 0
    assert state.propose([1, 5, 6, 7, 8, 5, 6, 7], 2, g).token_ids == [9]


def test_the_prompt_lookup_fallback_drafts_where_the_prediction_does_not_match():
    drafter = PredictionDrafter([50, 51])
    state = drafter.start([1, 2, 3, 4, 1, 2], SamplingParams())
    tokens = [1, 2, 3, 4, 1, 2, 7, 1, 2]
    assert state.propose(tokens, 2, torch.Generator()).token_ids == [3, 4]


# ------------------------------------------------------------ the library


def _plain(llm, prompt, params):
    return llm.generate(prompt, params, speculative=SpeculativeConfig("none"))


@pytest.mark.parametrize("case", ["exact", "edited", "unrelated"])
def test_greedy_output_with_a_prediction_equals_plain_decoding(target, case):
    llm = LLM(target, speculative=SpeculativeConfig("ngram", num_speculative_tokens=6))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for prompt in PROMPTS[:3]:
        plain = _plain(llm, prompt, params)
        ids = list(plain.token_ids)
        prediction = {
            "exact": ids,
            "edited": ids[:8] + [7, 8] + ids[10:20] + ids[22:],
            "unrelated": [5, 6] * 10,
        }[case]
        out = llm.generate(prompt, params, prediction=prediction)
        assert out.token_ids == plain.token_ids
        accepted, rejected = out.accepted_prediction_tokens, out.rejected_prediction_tokens
        assert accepted + rejected == len(prediction)
        if case == "exact":  # the output is the prediction: all of it accepted
            assert (accepted, rejected) == (len(ids), 0)
            assert out.metrics.mean_acceptance_length > 3
        if case == "edited":
            assert 0 < accepted < len(ids)


def test_text_predictions_stream_and_batch(target):
    llm = LLM(target, speculative=SpeculativeConfig("ngram", num_speculative_tokens=6))
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    prompt = PROMPTS[0]
    plain = _plain(llm, prompt, params)
    text = plain.text
    out = llm.generate(prompt, params, prediction=text)
    assert out.token_ids == plain.token_ids and out.accepted_prediction_tokens > 10
    assert out.to_dict()["accepted_prediction_tokens"] == out.accepted_prediction_tokens
    chunks = list(llm.stream(prompt, params, prediction=text))
    final = chunks[-1].output
    assert final.token_ids == plain.token_ids
    assert final.accepted_prediction_tokens == out.accepted_prediction_tokens
    batch = llm.generate([prompt, PROMPTS[1]], params, prediction=[text, None])
    assert batch[0].token_ids == plain.token_ids
    assert batch[0].accepted_prediction_tokens == out.accepted_prediction_tokens
    assert batch[1].accepted_prediction_tokens is None
    assert batch[1].token_ids == _plain(llm, PROMPTS[1], params).token_ids


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prediction=""), "empty"),
        (dict(prediction=[]), "empty"),
        (dict(prediction=[1, 99999]), "outside the vocabulary"),
        (dict(prediction=[1.5]), "string or a list of token ids"),
        (dict(prediction="w1", speculative=SpeculativeConfig("none")), "speculation on"),
        (dict(prediction="\ud800"), "not valid Unicode"),
    ],
)
def test_bad_predictions_are_refused(target, kwargs, message):
    llm = LLM(target, speculative=SpeculativeConfig("ngram"))
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=4), **kwargs)


def test_a_batch_wants_one_prediction_per_prompt(target):
    llm = LLM(target, speculative=SpeculativeConfig("ngram"))
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([PROMPTS[0], PROMPTS[1]], SamplingParams(max_new_tokens=4), prediction="w1")
    with pytest.raises(ValueError, match="1 predictions for 2 prompts"):
        llm.generate([PROMPTS[0], PROMPTS[1]], SamplingParams(max_new_tokens=4), prediction=["w1"])


def test_sampled_output_with_a_prediction_matches_plain_law(small):
    """Chi-square on the first two tokens: a prediction that drafts the most likely pair
    (accepted often, rejected sometimes) against the exact law of plain sampling."""
    target, _ = small
    vocab = target.vocab_size

    def next_probs(ids):
        logits = target.forward(ids, target.new_cache(len(ids)), num_logits=1)[0].double()
        return torch.softmax(logits, -1)

    first = next_probs(PROMPT)
    joint = torch.stack([first[x] * next_probs(PROMPT + [x]) for x in range(vocab)])
    top = int(first.argmax())
    prediction = [top, int(next_probs(PROMPT + [top]).argmax())]
    llm = LLM(target, speculative=SpeculativeConfig("ngram", num_speculative_tokens=2))
    counts = np.zeros((vocab, vocab))
    accepted = 0
    for seed in range(1500):
        params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=2, ignore_eos=True)
        out = llm.generate(PROMPT, params, prediction=prediction)
        counts[out.token_ids[0], out.token_ids[1]] += 1
        accepted += out.accepted_prediction_tokens
    assert accepted > 300  # the prediction was really drafted from
    assert chi_square_pvalue(counts, np.asarray(joint)) > 1e-3


# ------------------------------------------------------------ the server

NAME = "tiny"
SERVER_PROMPT = "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"


@pytest.fixture(scope="module")
def served():
    llm = make_server_llm()
    with uvicorn_thread(create_app(llm, NAME), log_level="error") as (url, _):
        yield url, llm


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_reports_prediction_tokens(served, stream):
    url, llm = served
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = llm.generate(SERVER_PROMPT, params, chat=False, speculative=SpeculativeConfig("none"))
    prediction = plain.text
    want = llm.generate(SERVER_PROMPT, params, chat=False, prediction=prediction)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    out = client.completions.create(
        model=NAME, prompt=SERVER_PROMPT, max_tokens=16, temperature=0, stream=stream,
        stream_options={"include_usage": True} if stream else None,
        extra_body={"prediction": {"type": "content", "content": prediction},
                    "ignore_eos": True},
    )  # fmt: skip
    if stream:
        chunks = list(out)
        text, usage = "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
    else:
        text, usage = out.choices[0].text, out.usage
    assert text == plain.text
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens == want.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens == want.rejected_prediction_tokens


def test_chat_prediction_as_text_parts_and_n_choices_sum(served):
    url, llm = served
    messages = [{"role": "user", "content": SERVER_PROMPT}]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = llm.generate(messages, params, speculative=SpeculativeConfig("none"))
    want = llm.generate(messages, params, prediction=plain.text)
    parts = [{"type": "text", "text": plain.text}]
    body = {"model": NAME, "messages": messages, "max_tokens": 12, "temperature": 0, "n": 2,
            "ignore_eos": True, "prediction": {"type": "content", "content": parts}}  # fmt: skip
    response = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert [c["message"]["content"] for c in data["choices"]] == [plain.text] * 2
    details = data["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] == 2 * want.accepted_prediction_tokens
    assert details["rejected_prediction_tokens"] == 2 * want.rejected_prediction_tokens


def test_no_prediction_no_details(served):
    url, _ = served
    body = {"model": NAME, "prompt": SERVER_PROMPT, "max_tokens": 4}
    assert (
        "completion_tokens_details"
        not in httpx.post(f"{url}/v1/completions", json=body).json()["usage"]
    )


@pytest.mark.parametrize(
    "prediction, extra, param",
    [
        ({"type": "content", "content": ""}, {}, "prediction"),
        ({"type": "image", "content": "w1"}, {}, "prediction.type"),
        ({"type": "content"}, {}, "prediction.content"),
        ({"type": "content", "content": "w1"}, {"speculative": {"enabled": False}}, "prediction"),
        ("w1 w2", {}, "prediction"),
    ],
)
def test_bad_predictions_are_400s(served, prediction, extra, param):
    url, _ = served
    body = {"model": NAME, "prompt": SERVER_PROMPT, "max_tokens": 4, "prediction": prediction}
    response = httpx.post(f"{url}/v1/completions", json=body | extra)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
