"""Engine oracles on tiny random models: greedy equivalence, cursor rule, scripted partial
acceptance, stops and budgets, seeds, bad input."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model, make_tokenizer
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.base import DraftProposal
from specdec.engine import StopChecker, generate_steps
from specdec.models.hf import HFModel
from specdec.sampling import make_generator
from specdec.tokenizer import Tokenizer

PROMPTS = [[1, 5, 6, 7, 8, 5, 6], [1, 20, 21, 22, 23, 24, 20, 21, 22], [1, 9]]


def hf_greedy(model: HFModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Independent oracle: transformers' own greedy generate (no EOS stop)."""
    ids = torch.tensor([prompt], device=model.model.device)
    out = model.model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


class ScriptedDrafter:
    """Proposes the true continuation with wrong tokens at chosen draft positions.

    ``errors[step]`` is the draft position (0-based) made wrong at that step, or None.
    """

    def __init__(
        self, truth: list[int], num_prompt: int, errors: dict[int, int | None], vocab_size: int
    ):
        self.truth, self.num_prompt, self.errors = truth, num_prompt, errors
        self.vocab_size = vocab_size
        self.step = 0

    def start(self, prompt_ids, params):
        self.step = 0
        return self

    def close(self):
        pass

    def propose(self, token_ids, num_tokens, generator):
        done = len(token_ids) - self.num_prompt
        proposal = list(self.truth[done : done + num_tokens])
        wrong_at = self.errors.get(self.step)
        if wrong_at is not None and wrong_at < len(proposal):
            proposal[wrong_at] = (proposal[wrong_at] + 1) % self.vocab_size
        self.step += 1
        return DraftProposal(proposal)


def _greedy(n, **kwargs):
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kwargs)


DRAFTER_CASES = [
    ("none", 1, None),
    ("ngram", 1, None),
    ("ngram", 3, None),
    ("ngram", 8, None),
    ("draft-model", 1, "near_draft"),
    ("draft-model", 4, "near_draft"),
    ("draft-model", 3, "draft"),
    ("draft-model", 3, "padded_draft"),
    ("draft-model", 5, "near_padded_draft"),
]


@pytest.mark.parametrize(
    "method, k, draft_name", DRAFTER_CASES, ids=[f"{m}-k{k}-{d}" for m, k, d in DRAFTER_CASES]
)
@pytest.mark.parametrize("prompt", PROMPTS, ids=["p0", "p1", "p2"])
def test_greedy_equivalence_every_drafter(request, target, prompt, method, k, draft_name):
    draft = request.getfixturevalue(draft_name) if draft_name else None
    llm = LLM(
        target, draft=draft, speculative=SpeculativeConfig(method=method, num_speculative_tokens=k)
    )
    out = llm.generate(prompt, _greedy(40))
    assert out.token_ids == hf_greedy(target, prompt, 40)
    assert out.finish_reason == "length"
    assert out.metrics.num_output_tokens == 40


def test_plain_decoding_metrics(target):
    out = LLM(target, speculative=SpeculativeConfig(method="none")).generate(
        PROMPTS[0], _greedy(12)
    )
    m = out.metrics
    assert (m.num_steps, m.num_draft_tokens, m.mean_acceptance_length) == (12, 0, 1.0)


def test_speculative_metrics_are_consistent(target, near_draft):
    llm = LLM(
        target,
        draft=near_draft,
        speculative=SpeculativeConfig(method="draft-model", num_speculative_tokens=4),
    )
    m = llm.generate(PROMPTS[1], _greedy(40)).metrics
    assert m.num_output_tokens == 40
    assert m.num_accepted_tokens + m.num_steps == 40  # each step: accepted + one token
    assert 0 < m.acceptance_rate < 1 and m.mean_acceptance_length > 1
    rates = m.per_position_acceptance_rate
    assert len(rates) <= 4 and all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    assert sum(m.accepted_length_counts) == m.num_steps


class RecordingModel(HFModel):
    """Records the cache cursor at every forward (the position of the first input)."""

    def __init__(self, base: HFModel):
        super().__init__(base.model, base.tokenizer, base.name)
        self.starts: list[tuple[int, int]] = []

    def forward(self, token_ids, cache, num_logits=0):
        self.starts.append((cache.num_tokens, len(token_ids)))
        return super().forward(token_ids, cache, num_logits)


def test_cursor_rule_holds_after_every_step(target, near_draft):
    from specdec.drafters import DraftModelDrafter

    recording = RecordingModel(target)
    drafter = DraftModelDrafter(near_draft, target.vocab_size, len(target.tokenizer))
    prompt = PROMPTS[1]
    steps = generate_steps(
        recording, drafter, prompt, _greedy(30), 4, StopChecker([]), make_generator(0)
    )
    lengths = [len(prompt)]
    for step in steps:
        lengths.append(lengths[-1] + len(step.new_token_ids))
    prefill, *step_calls = recording.starts
    assert prefill == (0, len(prompt) - 1)
    # Before step s the cache holds every token except the last (pending) one.
    assert [start for start, _ in step_calls] == [n - 1 for n in lengths[:-1]]


@pytest.mark.parametrize(
    "errors, expected_accepted",
    [
        ({0: 0, 1: 3, 2: None, 3: 1}, [0, 3, 5, 1]),
        ({0: 4, 1: 2, 2: 0, 3: None}, [4, 2, 0, 5]),
    ],
)
def test_scripted_partial_acceptance(target, errors, expected_accepted):
    prompt = PROMPTS[0]
    truth = hf_greedy(target, prompt, 40)
    drafter = ScriptedDrafter(truth, len(prompt), errors, target.vocab_size)
    steps = list(
        generate_steps(target, drafter, prompt, _greedy(40), 5, StopChecker([]), make_generator(0))
    )
    assert all(len(step.new_token_ids) >= 1 for step in steps)
    output = [t for s in steps for t in s.new_token_ids]
    assert output == truth
    # Step i emitted accepted_i + 1 tokens.
    emitted = [len(s.new_token_ids) for s in steps[:4]]
    assert emitted == [a + 1 for a in expected_accepted]


def test_a_drafter_that_drafts_at_most_m_tokens_caps_k(target):
    """``max_draft_tokens`` (Medusa's heads, a parallel head's block): the engine asks for
    at most that many tokens and counts the choices it really made."""
    prompt = PROMPTS[0]
    truth = hf_greedy(target, prompt, 24)
    drafter = ScriptedDrafter(truth, len(prompt), {}, target.vocab_size)
    asked = []
    propose = drafter.propose

    def spy(token_ids, num_tokens, generator):
        asked.append(num_tokens)
        return propose(token_ids, num_tokens, generator)

    drafter.propose = spy
    drafter.max_draft_tokens = 2
    config = SpeculativeConfig(method="custom", num_speculative_tokens=5)
    out = LLM(target, drafter=drafter, speculative=config).generate(prompt, _greedy(24))
    assert out.token_ids == truth
    assert asked and max(asked) == 2
    assert len(out.metrics.chosen_k_counts) == 3  # choices 0, 1, 2 only


@pytest.mark.parametrize("most", [0, -1, 2.0, True, "3"])
def test_a_bad_max_draft_tokens_is_refused(target, most):
    drafter = ScriptedDrafter([], 0, {}, target.vocab_size)
    drafter.max_draft_tokens = most
    with pytest.raises(ValueError, match="max_draft_tokens must be None or an integer >= 1"):
        LLM(target, drafter=drafter)


@pytest.mark.parametrize("prior", [-0.1, 1.5, True, "0.8"])
def test_a_bad_acceptance_prior_is_refused(target, prior):
    drafter = ScriptedDrafter([], 0, {}, target.vocab_size)
    drafter.acceptance_prior = prior
    with pytest.raises(ValueError, match="acceptance_prior must be None or in"):
        LLM(target, drafter=drafter)


def _scripted_llm(target, truth, prompt, k):
    drafter = ScriptedDrafter(truth, len(prompt), {}, target.vocab_size)
    llm = LLM(target, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=k))
    llm._drafters[llm.speculative] = drafter  # perfect drafter: whole blocks are accepted
    return llm


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("budget", [1, 2, 3, 5, 9, 10])
def test_max_new_tokens_never_exceeded(target, k, budget):
    prompt = PROMPTS[0]
    truth = hf_greedy(target, prompt, 12)
    for llm in (
        _scripted_llm(target, truth, prompt, k),
        LLM(target, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=k)),
    ):
        out = llm.generate(prompt, _greedy(budget))
        assert out.token_ids == truth[:budget]
        assert out.finish_reason == "length"
        assert out.metrics.num_draft_tokens <= budget * k


def test_stop_token_inside_accepted_block(target):
    prompt = PROMPTS[0]
    truth = hf_greedy(target, prompt, 30)
    j = next(i for i in range(3, 30) if truth[i] not in truth[:i])  # first occurrence at j > 2
    llm = _scripted_llm(target, truth, prompt, 8)
    out = llm.generate(prompt, _greedy(30, stop_token_ids=(truth[j],)))
    assert out.token_ids == truth[: j + 1]
    assert out.finish_reason == "stop"
    assert out.text == target.tokenizer.decode(truth[:j])
    assert out.metrics.num_output_tokens == j + 1


def test_model_eos_and_end_of_turn_stop_generation(target):
    prompt = PROMPTS[0]
    truth = hf_greedy(target, prompt, 30)
    j = next(i for i in range(3, 30) if truth[i] not in truth[:i])
    eos_model = HFModel(target.model, Tokenizer(target.tokenizer.hf, [truth[j]]), "eos")
    eos_model.tokenizer.eos_token_ids = frozenset({truth[j]})
    llm = _scripted_llm(eos_model, truth, prompt, 8)
    out = llm.generate(prompt, SamplingParams(max_new_tokens=30))
    assert out.token_ids == truth[: j + 1] and out.finish_reason == "stop"
    ignored = llm.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert ignored.token_ids == truth


def _expected_stop(target, truth, stop):
    for m in range(1, len(truth) + 1):
        text = target.tokenizer.decode(truth[:m])
        if stop in text:
            return truth[:m], text[: text.find(stop)]
    raise AssertionError("stop string not in output")


@pytest.mark.parametrize("k", [1, 8])
def test_stop_string_ends_output_exactly(target, k):
    prompt = PROMPTS[1]
    truth = hf_greedy(target, prompt, 30)
    words = target.tokenizer.decode(truth).split(" ")
    stop = f"{words[6]} {words[7]}"
    expected_ids, expected_text = _expected_stop(target, truth, stop)
    for llm in (
        _scripted_llm(target, truth, prompt, k),
        LLM(target, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=k)),
    ):
        chunks = list(llm.stream(prompt, _greedy(30, stop=(stop,))))
        out = chunks[-1].output
        assert out.token_ids == expected_ids
        assert out.text == expected_text and stop not in out.text
        assert out.finish_reason == "stop"
        assert "".join(c.text for c in chunks) == expected_text  # nothing leaked while streaming


@pytest.mark.parametrize("k", [1, 8])
def test_min_tokens_defers_stop_strings_like_vllm(target, k):
    """A stop string ending inside the first min_tokens tokens' text is ignored; the next
    one stops the output: the same ids and text with whole accepted blocks, prompt lookup
    and streaming, as plain decoding with the rule applied by hand."""
    prompt = PROMPTS[1]
    truth = hf_greedy(target, prompt, 40)
    decode = target.tokenizer.decode
    text = decode(truth)
    stop = max(sorted(set(text) - {" "}), key=text.count)  # the most frequent character
    first = text.find(stop)
    m = next(i for i in range(1, 40) if len(decode(truth[:i])) > first)  # holds `first`
    floor = len(decode(truth[:m]))
    assert text.find(stop, floor) > 0, "the test needs a second occurrence"
    n = next(i for i in range(m + 1, 41) if decode(truth[:i]).find(stop, floor) >= 0)
    expected_ids, expected_text = truth[:n], text[: text.find(stop, floor)]
    params = _greedy(40, stop=(stop,), min_tokens=m)
    for llm in (
        _scripted_llm(target, truth, prompt, k),
        LLM(target, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=k)),
    ):
        chunks = list(llm.stream(prompt, params))
        out = chunks[-1].output
        assert (out.token_ids, out.text, out.finish_reason) == (expected_ids, expected_text, "stop")
        assert "".join(c.text for c in chunks) == expected_text
    plain = LLM(target).generate(prompt, _greedy(40, stop=(stop,)))
    assert plain.text == text[:first]  # without min_tokens the first occurrence stops it


def test_streamed_text_equals_final_text(target):
    llm = LLM(target, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    chunks = list(llm.stream(PROMPTS[1], _greedy(25)))
    assert "".join(c.text for c in chunks) == chunks[-1].output.text
    assert [t for c in chunks for t in c.token_ids] == chunks[-1].output.token_ids


def test_generation_stops_at_context_limit(target):
    prompt = [1] + [5, 6, 7] * 40  # 121 tokens; the tiny model holds 128
    out = LLM(
        target, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=8)
    ).generate(prompt, _greedy(50))
    assert len(out.token_ids) == 128 - len(prompt)
    assert out.finish_reason == "length"
    assert out.token_ids == hf_greedy(target, prompt, 128 - len(prompt))


@pytest.mark.parametrize("method, draft_name", [("draft-model", "near_draft"), ("ngram", None)])
def test_same_seed_same_output(request, target, method, draft_name):
    draft = request.getfixturevalue(draft_name) if draft_name else None
    llm = LLM(
        target, draft=draft, speculative=SpeculativeConfig(method=method, num_speculative_tokens=3)
    )
    runs = {
        seed: [
            llm.generate(
                PROMPTS[1], SamplingParams(temperature=1.0, seed=seed, max_new_tokens=30)
            ).token_ids
            for _ in range(2)
        ]
        for seed in (0, 1, 2)
    }
    assert all(a == b for a, b in runs.values())
    assert len({tuple(a) for a, _ in runs.values()}) > 1  # the seed matters


@pytest.mark.parametrize("prompt", ["", "   ", []])
def test_empty_prompt_raises(target, prompt):
    """Nothing to generate from: an empty prompt, or whitespace this word-level tokenizer
    drops (a byte-level one makes tokens of it, and generates)."""
    with pytest.raises(ValueError, match="empty|encodes to no tokens"):
        LLM(target).generate(prompt)


def test_prompt_longer_than_context_raises(target):
    with pytest.raises(ValueError, match="at most 128 tokens"):
        LLM(target).generate([1] * 200)
    with pytest.raises(ValueError, match="at most 128 tokens"):
        LLM(target).generate(" ".join(["w3"] * 130), chat=False)


def test_token_ids_outside_vocabulary_raise(target):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        LLM(target).generate([1, 2, 10_000])


def test_mismatched_vocabulary_is_refused_when_ids_must_be_shared(target):
    other = make_model(make_tokenizer(prefix="v"), seed=5, name="other-vocab")
    shared = SpeculativeConfig(method="draft-model:tokenizers=shared")
    with pytest.raises(ValueError, match="different vocabularies"):
        LLM(target, draft=other, speculative=shared)
    # by default such a draft translates through text (tests/test_cross_tokenizer.py)
    llm = LLM(target, draft=other, speculative=SpeculativeConfig(method="draft-model"))
    plain = LLM(target, speculative=SpeculativeConfig(method="none"))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    assert llm.generate([1, 5, 6], params).token_ids == plain.generate([1, 5, 6], params).token_ids


def test_draft_model_method_needs_a_draft(target):
    with pytest.raises(ValueError, match="needs a draft model"):
        LLM(target, speculative=SpeculativeConfig(method="draft-model"))


def test_padded_draft_never_proposes_padding_ids(target, padded_draft):
    from specdec.drafters import DraftModelDrafter

    drafter = DraftModelDrafter(padded_draft, target.vocab_size, len(target.tokenizer))
    sequence = drafter.start(PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=20))
    proposal = sequence.propose(PROMPTS[0], 4, make_generator(0))
    assert proposal.draft_probs.shape == (4, target.vocab_size)
    ones = torch.ones(4, device=proposal.draft_probs.device)
    torch.testing.assert_close(proposal.draft_probs.sum(-1), ones)
    assert all(t < len(target.tokenizer) for t in proposal.token_ids)


def test_accepted_count_excludes_tokens_dropped_by_a_stop(target):
    prompt = PROMPTS[0]
    truth = hf_greedy(target, prompt, 30)
    j = next(i for i in range(12, 30) if truth[i] not in truth[:i] and (i + 1) % 9)
    out = _scripted_llm(target, truth, prompt, 8).generate(
        prompt, _greedy(30, stop_token_ids=(truth[j],))
    )
    m = out.metrics
    steps = -(-(j + 1) // 9)  # perfect drafts: 9 tokens per step
    kept_last = (j + 1) - 9 * (steps - 1)
    assert m.num_steps == steps and m.num_output_tokens == j + 1
    assert m.num_accepted_tokens == 8 * (steps - 1) + min(8, kept_last)
    assert sum(n * c for n, c in enumerate(m.accepted_length_counts)) == m.num_accepted_tokens


def test_per_position_rates_cover_every_drafted_position(target):
    prompt = PROMPTS[0]
    truth = hf_greedy(target, prompt, 12)
    drafter = ScriptedDrafter(truth, len(prompt), {i: 0 for i in range(20)}, target.vocab_size)
    llm = LLM(target, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=5))
    llm._drafters[llm.speculative] = drafter  # every first draft token is wrong
    m = llm.generate(prompt, _greedy(12)).metrics
    assert m.per_position_acceptance_rate == [0.0] * 5
    assert m.acceptance_rate == 0.0 and m.mean_acceptance_length == 1.0


@pytest.mark.parametrize("prompt", [123, None, 4.5])
def test_prompt_of_wrong_type_raises(target, prompt):
    with pytest.raises(ValueError, match="prompt must be"):
        LLM(target).generate(prompt)


def test_draft_with_fewer_logits_than_tokens_is_refused(target, tokenizer):
    small = make_model(tokenizer, seed=6, vocab_size=len(tokenizer) - 4, name="small-vocab")
    with pytest.raises(ValueError, match="scores 28 tokens but its tokenizer has 32"):
        LLM(target, draft=small, speculative=SpeculativeConfig(method="draft-model"))


class _Broken:
    """A user drafter returning ``result`` from propose."""

    def __init__(self, result):
        self.result = result

    def start(self, prompt_ids, params):
        return self

    def close(self):
        pass

    def propose(self, token_ids, num_tokens, generator):
        return self.result(num_tokens) if callable(self.result) else self.result


@pytest.mark.parametrize(
    "result, message",
    [
        (lambda k: DraftProposal([5] * (k + 3)), "proposed .* tokens; it was asked for"),
        (DraftProposal([5, 10_000]), "outside the vocabulary"),
        (DraftProposal([-1]), "outside the vocabulary"),
        ([5, 6], "must return a DraftProposal, got list"),
        (None, "must return a DraftProposal, got NoneType"),
    ],
)
def test_a_broken_user_drafter_is_a_clear_error(target, result, message):
    llm = LLM(target, drafter=_Broken(result), speculative=SpeculativeConfig(method="custom"))
    with pytest.raises(ValueError, match=message):
        llm.generate([1, 5, 6], _greedy(8))
