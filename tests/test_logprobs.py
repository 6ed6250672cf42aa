"""Log-probabilities of the emitted tokens: the target's raw distribution at each emitted
position, the same under speculation (accepted, recovered and bonus tokens; chains and
trees) as in plain decoding, bit-equal in exact mode, trimmed with the tokens at a stop."""

from __future__ import annotations

import pytest
import torch
from test_engine import PROMPTS

from conftest import make_model, make_tokenizer
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.models.native import NativeModel
from specdec.sampling import token_logprobs

SPECS = [
    SpeculativeConfig("ngram", num_speculative_tokens=4),
    SpeculativeConfig("ngram", tree="static:tree-8"),
    SpeculativeConfig("suffix", num_speculative_tokens=6),
]


@pytest.fixture(scope="module")
def exact_target():
    return NativeModel(make_model(make_tokenizer(), seed=0, name="tiny-target"), exact=True)


def _values(output):
    return [(t.token_id, t.logprob, t.top) for t in output.logprobs]


@pytest.mark.parametrize("spec", SPECS, ids=["ngram", "ngram-tree", "suffix"])
def test_exact_mode_logprobs_are_bit_equal_to_plain_decoding(exact_target, spec):
    plain = LLM(exact_target, speculative=SpeculativeConfig("none"))
    llm = LLM(exact_target, speculative=spec)
    params = SamplingParams(max_new_tokens=30, logprobs=4, ignore_eos=True)
    accepted = 0
    for prompt in PROMPTS:
        want, got = plain.generate(prompt, params), llm.generate(prompt, params)
        assert got.token_ids == want.token_ids
        assert _values(got) == _values(want)
        accepted += got.metrics.num_accepted_tokens
    assert accepted > 0  # accepted and bonus rows were both compared


def test_draft_model_logprobs_equal_plain_within_float32(target, near_draft):
    params = SamplingParams(max_new_tokens=30, logprobs=2, ignore_eos=True)
    plain = LLM(target, speculative=SpeculativeConfig("none")).generate(PROMPTS[0], params)
    spec = SpeculativeConfig("draft-model", num_speculative_tokens=4)
    got = LLM(target, draft=near_draft, speculative=spec).generate(PROMPTS[0], params)
    assert got.token_ids == plain.token_ids and got.metrics.num_accepted_tokens > 0
    for a, b in zip(got.logprobs, plain.logprobs, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-5
        assert [i for i, _ in a.top] == [i for i, _ in b.top]


def test_values_are_the_targets_raw_distribution_teacher_forced(target):
    """An independent recomputation: one transformers forward over prompt + output, its
    log_softmax at each position (temperature and penalties do not enter: raw)."""
    llm = LLM(target, speculative=SpeculativeConfig("ngram", num_speculative_tokens=4))
    params = SamplingParams(
        max_new_tokens=20, logprobs=3, temperature=0.7, seed=1, repetition_penalty=1.3,
        ignore_eos=True,
    )  # fmt: skip
    out = llm.generate(PROMPTS[1], params)
    ids = torch.tensor([PROMPTS[1] + out.token_ids], device=target.model.device)
    with torch.no_grad():
        logits = target.model(ids).logits[0, len(PROMPTS[1]) - 1 : -1]
    logp = torch.log_softmax(logits.float(), -1)
    for i, t in enumerate(out.logprobs):
        assert t.token_id == out.token_ids[i]
        assert abs(t.logprob - float(logp[i, t.token_id])) < 1e-4
        assert [j for j, _ in t.top] == torch.topk(logp[i], 3).indices.tolist()
        values = [lp for _, lp in t.top]
        assert values == sorted(values, reverse=True) and t.logprob <= values[0] + 1e-6


def test_logprobs_stop_where_the_tokens_stop(target):
    """A stop token inside an accepted block: one entry per kept token, nothing after."""
    plain = LLM(target, speculative=SpeculativeConfig("none"))
    free = plain.generate(PROMPTS[0], SamplingParams(max_new_tokens=20, ignore_eos=True))
    stop = free.token_ids[6]
    params = SamplingParams(max_new_tokens=20, stop_token_ids=(stop,), logprobs=1)
    llm = LLM(target, speculative=SpeculativeConfig("ngram", num_speculative_tokens=8))
    out = llm.generate(PROMPTS[0], params)
    assert out.token_ids[-1] == stop and len(out.logprobs) == len(out.token_ids)
    assert [t.token_id for t in out.logprobs] == out.token_ids


def test_batch_stream_and_single_agree(exact_target):
    llm = LLM(exact_target, speculative=SpeculativeConfig("ngram", num_speculative_tokens=4))
    params = SamplingParams(max_new_tokens=16, logprobs=2, ignore_eos=True)
    single = [llm.generate(p, params) for p in PROMPTS]
    batch = llm.generate(PROMPTS, params)
    assert [_values(o) for o in batch] == [_values(o) for o in single]
    chunks = list(llm.stream(PROMPTS[0], params))
    streamed = [t for c in chunks for t in c.logprobs]
    assert streamed == single[0].logprobs == chunks[-1].output.logprobs
    assert single[0].to_dict()["logprobs"][0]["token_id"] == single[0].token_ids[0]


def test_no_logprobs_unless_asked(target):
    out = LLM(target).generate(PROMPTS[0], SamplingParams(max_new_tokens=4))
    assert out.logprobs is None and "logprobs" not in out.to_dict()


@pytest.mark.parametrize("value", [-1, 21, 2.0, True])
def test_bad_logprobs_values_are_refused(value):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=value)


def test_tied_top_logprobs_come_in_token_id_order_as_greedy_breaks_ties():
    """From a new user's trial: a greedy token listed after another with the same
    log-probability in its own top list. Ties now come in id order, the order argmax picks
    from, so the greedy token is first among its equals."""
    logits = torch.full((3, 300), -5.0)
    tied = [250, 7, 130, 31]  # four equal maxima, and a row where they are all there is
    logits[0, tied] = 2.0
    logits[1, tied[:2]] = 2.0
    logits[1, 99] = 1.0
    logits[2, :] = 0.0
    greedy = logits.argmax(-1).tolist()
    rows = token_logprobs(logits, greedy, 5)
    assert [r.top[0][0] for r in rows] == greedy == [7, 7, 0]
    assert [t for t, _ in rows[0].top[:4]] == sorted(tied)
    assert [t for t, _ in rows[1].top[:3]] == [7, 250, 99]
    assert all(r.rank == 1 for r in rows)
    for r in rows:
        values = [v for _, v in r.top]
        assert values == sorted(values, reverse=True)


def test_token_logprobs_checks_its_rows():
    with pytest.raises(ValueError, match="rows"):
        token_logprobs(torch.zeros(2, 5), [1], 0)


# ------------------------------------------------------------ prompt_logprobs


def _teacher_forced(target, ids):
    with torch.no_grad():
        logits = target.model(torch.tensor([ids], device=target.model.device)).logits[0]
    return torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("chunk", [None, 3])
def test_prompt_logprobs_are_the_targets_teacher_forced(target, chunk):
    """Every prompt token after the first, scored from the prefill rows (chunked or not),
    with speculation on or off: the values of one transformers forward over the prompt."""
    from specdec.engine import EngineConfig

    config = EngineConfig(prefill_chunk=chunk) if chunk else None
    prompt = PROMPTS[1]
    want = _teacher_forced(target, prompt)
    for spec in (SpeculativeConfig("none"), SpeculativeConfig("ngram", num_speculative_tokens=4)):
        llm = LLM(target, speculative=spec, engine_config=config)
        out = llm.generate(prompt, SamplingParams(max_new_tokens=5, prompt_logprobs=3))
        scored = out.prompt_logprobs
        assert len(scored) == len(prompt) and scored[0] is None
        for i, entry in enumerate(scored[1:], start=1):
            row = want[i - 1]
            assert entry.token_id == prompt[i]
            assert abs(entry.logprob - float(row[prompt[i]])) < 1e-5
            assert [t for t, _ in entry.top] == torch.topk(row, 3).indices.tolist()
            assert entry.rank == int((row > row[prompt[i]]).sum()) + 1
        assert out.logprobs is None  # only what was asked


def test_prompt_logprobs_bit_equal_across_batch_stream_and_preemption(exact_target):
    from specdec.engine import EngineConfig

    params = SamplingParams(max_new_tokens=12, prompt_logprobs=2, ignore_eos=True)
    llm = LLM(exact_target, speculative=SpeculativeConfig("ngram", num_speculative_tokens=4))
    alone = [llm.generate(p, params).prompt_logprobs for p in PROMPTS[:3]]
    assert [o.prompt_logprobs for o in llm.generate(PROMPTS[:3], params)] == alone
    chunks = list(llm.stream(PROMPTS[0], params))
    assert chunks[-1].output.prompt_logprobs == alone[0]
    assert llm.generate(PROMPTS[0], params).to_dict()["prompt_logprobs"][0] is None
    # a KV budget so small that sequences are preempted and recomputed
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engine import Engine

    engine = Engine(
        exact_target,
        EngineConfig(max_num_batched_tokens=32, max_kv_tokens=112, prefill_chunk=16),
    )
    long = SamplingParams(max_new_tokens=40, prompt_logprobs=2, ignore_eos=True)
    sequences = [
        engine.add_request(str(i), p, long, drafter=NgramDrafter(), num_speculative_tokens=4)
        for i, p in enumerate(PROMPTS[:3])
    ]
    while engine.has_unfinished():
        engine.step()
    assert engine.num_preemptions > 0
    assert [s.prompt_logprobs for s in sequences] == alone


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_values_are_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


# ------------------------------------------------------------ n and best_of


def test_n_choices_are_seeded_sequences_of_their_own(target):
    llm = LLM(target, speculative=SpeculativeConfig("ngram", num_speculative_tokens=4))
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7, n=3)
    outs = llm.generate(PROMPTS[0], params)
    assert isinstance(outs, list) and len(outs) == 3
    for i, out in enumerate(outs):
        alone = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7 + i)
        assert out.token_ids == llm.generate(PROMPTS[0], alone).token_ids
    assert len({tuple(o.token_ids) for o in outs}) > 1
    batch = llm.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in batch[0]] == [o.token_ids for o in outs]
    greedy = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=6, n=2))
    assert greedy[0].token_ids == greedy[1].token_ids


def test_best_of_keeps_the_most_probable_candidates(target):
    llm = LLM(target, speculative=SpeculativeConfig("ngram", num_speculative_tokens=4))
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, n=2, best_of=5)
    outs = llm.generate(PROMPTS[1], params)
    scored = []
    for i in range(5):
        alone = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3 + i, logprobs=0)
        out = llm.generate(PROMPTS[1], alone)
        scored.append((-sum(t.logprob for t in out.logprobs) / len(out.logprobs), i, out))
    best = [o for _, _, o in sorted(scored, key=lambda c: (c[0], c[1]))[:2]]
    assert [o.token_ids for o in outs] == [o.token_ids for o in best]
    assert all(o.logprobs is None for o in outs)  # computed to rank, not asked for
    # n == 1 with best_of: one output (not a list), the best candidate
    one = llm.generate(PROMPTS[1], SamplingParams(max_new_tokens=10, temperature=1.0, seed=3,
                                                  best_of=5))  # fmt: skip
    assert one.token_ids == best[0].token_ids


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n must be"),
        (dict(n=17), "n must be"),
        (dict(n=3, best_of=2), "best_of must be"),
        (dict(best_of=17), "best_of must be"),
        (dict(best_of=2, temperature=0.0), "best_of > 1 needs sampling"),
    ],
)
def test_bad_choice_counts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stream_refuses_several_choices(target):
    llm = LLM(target, speculative=SpeculativeConfig("none"))
    with pytest.raises(ValueError, match="stream returns one output"):
        llm.stream(PROMPTS[0], SamplingParams(n=2))  # at the call, not at the first next


def test_stream_refuses_bad_prompts_at_the_call(target):
    """An empty or over-long prompt raises when ``stream`` is called, as ``generate``
    does, not later at the first ``next``; a good one streams as before."""
    llm = LLM(target, speculative=SpeculativeConfig("none"))
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.stream([])
    with pytest.raises(ValueError, match="holds at most"):
        llm.stream([5] * target.max_context)
    chunks = list(llm.stream(PROMPTS[0], SamplingParams(max_new_tokens=4)))
    assert chunks and chunks[-1].output is not None
