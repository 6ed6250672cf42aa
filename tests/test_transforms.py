"""Sampling transforms under speculation: logit_bias, min_tokens, repetition / frequency /
presence penalties, min_p and user processors, each applied to every verified row with
that row's own history.

Oracles: the transforms against an independent slow reference (and transformers' own
processors where it has them); the exact output law of one production verification step
(chain and tree) against plain decoding with the same transforms, with a planted bug of
each class that the law must catch; greedy speculation equal to plain decoding end to end
for every field (chain and tree, ngram and draft model); a sampled chi-square check.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_engine import PROMPTS
from test_statistical import PROMPT, chi_square_pvalue, empirical_joint
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

import specdec.engine.commit as commit
import specdec.verify.tree as tree_verify
from exact_laws import Synthetic, _chain_draws, _extend, _subtrees, worst_error
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.base import DraftProposal
from specdec.sampling import TokenHistory, logits_to_probs, process_logits
from specdec.trees.tree import ROOT, TokenTree
from specdec.verify.exact import exact_output_law

# ---------------------------------------------------------------- the reference


def reference_row(logits, params: SamplingParams, prompt, output, stops=()) -> torch.Tensor:
    """One row's transforms written out token by token (float64), in the documented order:
    bias, min_tokens, repetition, frequency and presence, processors."""
    z = logits.double().clone()
    for token, bias in params.logit_bias:
        z[token] += bias
    if len(output) < params.min_tokens:
        for s in stops:
            z[s] = -math.inf
    for word in params.bad_words_token_ids:
        if len(word) == 1 or tuple(output[-(len(word) - 1) :]) == tuple(word[:-1]):
            z[word[-1]] = -math.inf
    r = params.repetition_penalty
    for token in set(prompt) | set(output):
        z[token] = z[token] / r if z[token] > 0 else z[token] * r
    for token in set(output):
        count = output.count(token)
        z[token] -= params.frequency_penalty * count + params.presence_penalty
    for processor in params.logits_processors:
        z = processor(list(output), z.float()).double()
    return z


def reference_probs(logits, params, prompt, output, stops=()) -> torch.Tensor:
    """The plain sampling law of one position (float64): the reference transforms, then
    temperature, min_p, top-k, top-p."""
    z = reference_row(logits, params, prompt, output, stops)
    z = (z - z.max()) / params.temperature
    probs = torch.softmax(z, -1)
    if params.min_p > 0:
        probs = torch.where(probs < params.min_p * probs.max(), 0.0, probs)
    if params.top_k:
        kth = torch.sort(probs, descending=True).values[params.top_k - 1]
        probs = torch.where(probs < kth, 0.0, probs)
    assert params.top_p == 1.0, "the reference has no top-p"
    return probs / probs.sum()


def _ban_after(token: int, banned: int):
    """A user processor: ``banned`` may not follow ``token`` (reads the row's history)."""

    def processor(output_ids, logits):
        if output_ids and output_ids[-1] == token:
            logits = logits.clone()
            logits[banned] = -math.inf
        return logits

    return processor


TRANSFORMS = {
    "bias": dict(logit_bias={1: 1.5, 3: -2.0}),
    "repetition": dict(repetition_penalty=1.8),
    "frequency": dict(frequency_penalty=1.2),
    "presence": dict(presence_penalty=-1.5),
    "min_tokens": dict(min_tokens=3),
    "min_p": dict(min_p=0.3),
    "processor": dict(logits_processors=(_ban_after(2, 1),)),
    "bad_words": dict(bad_words_token_ids=((5,), (2, 7), (7, 2, 3))),
    "all": dict(
        logit_bias={0: 0.7},
        repetition_penalty=1.5,
        frequency_penalty=0.8,
        presence_penalty=0.5,
        min_tokens=2,
        min_p=0.05,
        top_k=3,
    ),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_rows_equal_the_reference_with_their_own_history(name):
    g = torch.Generator().manual_seed(0)
    vocab = 12
    params = SamplingParams(temperature=1.0, **TRANSFORMS[name])
    prompt, output, stops = [4, 5, 4, 9], [2, 7, 2], (0, 11)
    prefixes = [(), (3,), (3, 2), (3, 2, 2), (7, 7, 3, 1)]
    logits = torch.randn(len(prefixes), vocab, generator=g) * 3
    got = process_logits(logits, params, TokenHistory(prompt, output, stops), prefixes)
    for i, pre in enumerate(prefixes):
        want = reference_row(logits[i], params, prompt, output + list(pre), stops)
        torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-5)
        probs = logits_to_probs(got[i : i + 1], params)[0].double()
        want_probs = reference_probs(logits[i], params, prompt, output + list(pre), stops)
        torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-6)


def test_repetition_penalty_and_min_tokens_match_transformers():
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([[3, 5, 5, 8]])
    scores = torch.randn(1, 10, generator=g) * 2
    params = SamplingParams(repetition_penalty=1.7, min_tokens=3)
    history = TokenHistory([3, 5], [5, 8], (2,))  # 2 output tokens < 3: EOS held back
    got = process_logits(scores, params, history)
    want = RepetitionPenaltyLogitsProcessor(1.7)(ids, scores.clone())
    want = MinNewTokensLengthLogitsProcessor(2, 3, eos_token_id=2)(ids, want)
    torch.testing.assert_close(got, want)


def test_min_p_matches_transformers():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(3, 50, generator=g) * 3
    for min_p in (0.01, 0.2, 0.9, 1.0):
        got = logits_to_probs(scores, SamplingParams(temperature=0.7, min_p=min_p))
        warped = MinPLogitsWarper(min_p)(None, scores / 0.7)
        torch.testing.assert_close(got, torch.softmax(warped, -1), rtol=1e-5, atol=1e-7)


def test_neutral_values_change_nothing():
    logits = torch.randn(3, 9)
    params = SamplingParams(temperature=1.0)
    assert not params.transforms_logits
    assert torch.equal(process_logits(logits, params, None, [(), (1,), (1, 2)]), logits)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(logit_bias={-3: 1.0}), "logit_bias keys"),
        (dict(logit_bias={"a": 1.0}), "logit_bias keys"),
        (dict(logit_bias={3: 101}), "logit_bias value"),
        (dict(logit_bias=[(3, 1.0), (3, 2.0)]), "twice"),
        (dict(logit_bias=7), "logit_bias must map"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=20, max_new_tokens=10), "must not exceed"),
        (dict(logits_processors=("not callable",)), "logits_processors"),
    ],
)
def test_bad_transform_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary_is_refused(target):
    llm = LLM(target)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={target.vocab_size: 1.0}))


def test_history_transforms_need_the_history():
    with pytest.raises(ValueError, match="history"):
        process_logits(torch.zeros(1, 4), SamplingParams(presence_penalty=1.0))


# ------------------------------------------------- exact law of one verification step

PROMPT_IDS, OUTPUT_IDS, STOPS = (1, 2), (0, 2, 3), (3,)
LAW_PARAMS = {
    "penalties": dict(repetition_penalty=2.0, frequency_penalty=0.9, presence_penalty=0.6),
    "bias": dict(logit_bias={1: 1.2, 2: -0.8}),
    "min_tokens": dict(min_tokens=5),  # the output has 3: the first two rows hold 3 back
    "min_p+top_k": dict(min_p=0.2, top_k=3, presence_penalty=0.7),
    "processor": dict(logits_processors=(_ban_after(0, 1),), frequency_penalty=0.5),
    "bad_words": dict(bad_words_token_ids=((1,), (3, 2), (2, 0, 1)), presence_penalty=0.4),
}


#: The production transforms run in float32 (as on real logits), the reference in float64:
#: laws agree to float32 rounding; every planted bug below moves them by more than 1e-3.
FLOAT32_LAW = 1e-6


class Transformed(Synthetic):
    """Raw target tables (``raw``) and, as ``p``, plain decoding's law with the transforms
    (the reference), given the committed output before the context."""

    def __init__(self, seed, draft, params: SamplingParams):
        super().__init__(seed, draft)
        self.params = params

    def raw(self, ctx: tuple) -> torch.Tensor:
        return Synthetic.p(self, ctx)

    def p(self, ctx: tuple) -> torch.Tensor:
        logits = self.raw(ctx).log()
        output = list(OUTPUT_IDS) + list(ctx)
        return reference_probs(logits, self.params, PROMPT_IDS, output, STOPS)


def _history():
    return TokenHistory(PROMPT_IDS, OUTPUT_IDS, STOPS)


def chain_law(
    model: Transformed, k: int, mode: str, verify=None, history=None, verifier="rejection"
) -> dict:
    """Law of the first k + 1 tokens: drafts from the raw draft, one production
    :func:`specdec.engine.commit.verify` step on the raw target logits (with ``history()``
    and ``verifier``), then plain (transformed) target sampling."""
    verify = verify or commit.verify
    history = history or _history
    total: dict = {}
    for drafts, prob in _chain_draws(model, k, mode):
        logits = torch.stack([model.raw(drafts[:i]).log() for i in range(k + 1)]).float()
        q = (
            None
            if mode == "deterministic"
            else torch.stack([model.q(drafts[:i]) for i in range(k)])
        )
        proposal = DraftProposal(list(drafts), None if q is None else q.float())

        def run(source, proposal=proposal, logits=logits):
            result = verify(proposal, logits, model.params, source, history(), verifier)
            return tuple(result.output_token_ids)

        _extend(model, exact_output_law(run), k + 1, prob, total)
    return total


def tree_law(model: Transformed, shape: tuple[int, ...], mode: str, history=None) -> dict:
    """As :func:`chain_law` for a full tree through :func:`specdec.verify.tree.verify_tree`."""
    history = history or _history
    total: dict = {}
    for nodes, prob in _subtrees(model, shape, mode, (), 0):
        parents = [ROOT if parent < 0 else parent for parent, _, _ in nodes]
        rows = None if mode == "deterministic" else torch.stack([q for _, _, q in nodes]).float()
        tree = TokenTree.build(
            parents, [t for _, t, _ in nodes], rows, without_replacement=mode == "wor"
        )
        contexts = [()] + [
            tuple(tree.token_ids[n] for n in tree.path_to(i)) for i in range(len(tree))
        ]
        logits = torch.stack([model.raw(c).log() for c in contexts]).float()

        def run(source, tree=tree, logits=logits):
            result = tree_verify.verify_tree(tree, logits, model.params, source, history())
            return tuple(result.output_token_ids)

        _extend(model, exact_output_law(run), len(shape) + 1, prob, total)
    return total


def _want(model: Transformed, length: int) -> dict:
    law: dict = {}
    _extend(model, {(): 1.0}, length, 1.0, law)
    return law


@pytest.mark.parametrize("name", list(LAW_PARAMS))
@pytest.mark.parametrize("mode", ["iid", "deterministic"])
def test_chain_step_law_equals_plain_decoding_with_the_transforms(name, mode):
    params = SamplingParams(temperature=1.0, **LAW_PARAMS[name])
    for seed in range(2):
        model = Transformed(seed, "random", params)
        assert worst_error(chain_law(model, 2, mode), _want(model, 3)) < FLOAT32_LAW


@pytest.mark.parametrize("name", ["penalties", "bias", "processor", "bad_words"])
@pytest.mark.parametrize("mode", ["iid", "wor"])
def test_tree_step_law_equals_plain_decoding_with_the_transforms(name, mode):
    params = SamplingParams(temperature=1.0, **LAW_PARAMS[name])
    model = Transformed(0, "random", params)
    assert worst_error(tree_law(model, (2, 1), mode), _want(model, 3)) < FLOAT32_LAW


def test_planted_bug_penalty_fed_only_the_last_token_is_caught(monkeypatch):
    """SGLang's bug (PR #33643): each row's penalty state saw only the block's last token."""
    params = SamplingParams(temperature=1.0, **LAW_PARAMS["penalties"])
    model = Transformed(0, "random", params)
    assert worst_error(chain_law(model, 2, "iid"), _want(model, 3)) < FLOAT32_LAW
    real = commit.process_logits

    def last_token_only(logits, params, history, prefixes):
        return real(logits, params, history, [tuple(p[-1:]) for p in prefixes])

    monkeypatch.setattr(commit, "process_logits", last_token_only)
    assert worst_error(chain_law(model, 2, "iid"), _want(model, 3)) > 1e-3


def test_planted_bug_bias_on_the_bonus_token_only_is_caught(monkeypatch):
    """vLLM's bug (#42744): the transforms reached the bonus row only."""
    params = SamplingParams(temperature=1.0, **LAW_PARAMS["bias"])
    model = Transformed(0, "random", params)
    real = commit.process_logits

    def bonus_only(logits, params, history, prefixes):
        out = logits.float().clone()
        out[-1:] = real(logits[-1:], params, history, prefixes[-1:])
        return out

    monkeypatch.setattr(commit, "process_logits", bonus_only)
    assert worst_error(chain_law(model, 2, "iid"), _want(model, 3)) > 1e-3


def test_planted_bug_tree_rows_with_the_chain_history_is_caught(monkeypatch):
    """A tree verified with every node's row given its depth's chain prefix (the first
    child's path) instead of its own root-to-node path."""
    params = SamplingParams(temperature=1.0, **LAW_PARAMS["penalties"])
    model = Transformed(0, "random", params)
    real = tree_verify.process_logits

    def first_path(logits, params, history, prefixes):
        by_depth: dict[int, tuple] = {}
        for p in prefixes:
            by_depth.setdefault(len(p), tuple(p))
        return real(logits, params, history, [by_depth[len(p)] for p in prefixes])

    monkeypatch.setattr(tree_verify, "process_logits", first_path)
    assert worst_error(tree_law(model, (2, 1), "iid"), _want(model, 3)) > 1e-3


# ------------------------------------------------------------------- end to end

E2E = {
    "repetition": dict(repetition_penalty=1.6),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=1.2),
    "bias": dict(logit_bias={5: 3.0, 6: -5.0, 20: 2.5}),
    "min_tokens": dict(min_tokens=12, logit_bias={2: 6.0}),  # EOS likely, held back
    "processor": dict(logits_processors=(_ban_after(31, 22),)),  # 31, 22 occurs in both
    "bad_words": dict(bad_words_token_ids=((31, 22), (4,))),
    "all": dict(repetition_penalty=1.3, frequency_penalty=0.4, logit_bias={9: 1.0}),
}
SPECS = [
    ("ngram", None, None),
    ("draft-model", "near_draft", None),
    ("draft-model", "near_draft", "dynamic:top_k=3,depth=4,budget=10"),
    ("ngram", None, "static:tree-8"),
    ("suffix", None, None),
]


def _plain(target, prompt, params):
    return LLM(target, speculative=SpeculativeConfig("none")).generate(prompt, params).token_ids


@pytest.mark.parametrize("field", list(E2E))
@pytest.mark.parametrize(
    "method, draft_name, tree", SPECS, ids=["ngram", "draft", "draft-tree", "ngram-tree", "suffix"]
)
def test_greedy_speculation_equals_plain_decoding(request, target, field, method, draft_name, tree):
    draft = request.getfixturevalue(draft_name) if draft_name else None
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4, tree=tree)
    llm = LLM(target, draft=draft, speculative=spec)
    params = SamplingParams(max_new_tokens=30, **E2E[field])
    for prompt in PROMPTS[:2]:
        out = llm.generate(prompt, params)
        assert out.token_ids == _plain(target, prompt, params)


def test_the_transforms_change_greedy_output(target):
    """Each end-to-end case really transforms something (else the test above is empty)."""
    plain = SamplingParams(max_new_tokens=30)
    for field, kwargs in E2E.items():
        changed = [
            _plain(target, p, SamplingParams(max_new_tokens=30, **kwargs))
            != _plain(target, p, plain)
            for p in PROMPTS[:2]
        ]
        assert any(changed), field


def test_plain_greedy_repetition_penalty_matches_transformers(target):
    prompt = PROMPTS[0]
    want = target.model.generate(
        torch.tensor([prompt], device=target.model.device), max_new_tokens=20, do_sample=False,
        repetition_penalty=1.6,
        eos_token_id=None, pad_token_id=0,
    )[0, len(prompt):].tolist()  # fmt: skip
    params = SamplingParams(max_new_tokens=20, repetition_penalty=1.6, ignore_eos=True)
    got = LLM(target, speculative=SpeculativeConfig("ngram", num_speculative_tokens=4)).generate(
        prompt, params
    )
    assert got.token_ids == want


def test_bad_words_as_text_never_appear(target):
    """vLLM's ``bad_words``: tokenized by the LLM (as written and after a space); the
    word's last token is banned where the output ends with the rest of it."""
    llm = LLM(target, speculative=SpeculativeConfig("ngram", num_speculative_tokens=4))
    free = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=30)).token_ids
    word = llm.tokenizer.decode(free[2:4])  # two words the free output holds
    params = SamplingParams(max_new_tokens=30, bad_words=[word])
    resolved = llm.resolve_params(params)
    assert tuple(free[2:4]) in resolved.bad_words_token_ids
    out = llm.generate(PROMPTS[0], params)
    assert out.token_ids != free
    pairs = set(zip(out.token_ids, out.token_ids[1:], strict=False))
    assert tuple(free[2:4]) not in pairs
    assert out.token_ids == _plain(target, PROMPTS[0], resolved)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(bad_words=[""]), "non-empty strings"),
        (dict(bad_words=["\ud800"]), "not valid Unicode"),
        (dict(bad_words_token_ids=[[]]), "non-empty lists"),
        (dict(bad_words_token_ids=[[1, -2]]), "non-empty lists"),
        (dict(bad_words_token_ids=[5]), "list of token id lists"),
        (dict(bad_words=["x"] * 300), "at most 256"),
    ],
)
def test_bad_words_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_the_engine_wants_bad_words_resolved_and_in_the_vocabulary(target):
    llm = LLM(target, speculative=SpeculativeConfig("none"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=4, bad_words_token_ids=[[99999]]))
    from specdec.engine import Engine

    with pytest.raises(ValueError, match="resolve_params"):
        Engine(target).add_request("x", PROMPTS[0], SamplingParams(bad_words=["w1"]))


def test_min_tokens_holds_back_eos_then_lets_it_through(target):
    """A large EOS bias makes EOS the argmax everywhere; min_tokens holds it back exactly
    that many tokens, under speculation as in plain decoding."""
    eos = 2
    params = SamplingParams(max_new_tokens=20, logit_bias={eos: 100.0}, min_tokens=6)
    llm = LLM(target, speculative=SpeculativeConfig("ngram", num_speculative_tokens=4))
    out = llm.generate(PROMPTS[1], params)
    assert len(out.token_ids) == 7 and out.token_ids[-1] == eos
    assert eos not in out.token_ids[:-1] and out.finish_reason == "stop"


@pytest.mark.parametrize("method", ["draft-model", "ngram"])
def test_sampled_speculation_with_penalties_matches_plain_law(small, method):
    """Chi-square on the first two tokens: speculation with penalties, a bias and min_p
    against the exact law of plain decoding with the same transforms."""
    target, draft = small
    kwargs = dict(
        temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.7, logit_bias={4: 1.0},
        min_p=0.02,
    )  # fmt: skip
    params = SamplingParams(**kwargs)

    def next_probs(ids):
        logits = target.forward(ids, target.new_cache(len(ids)), num_logits=1)
        history = TokenHistory(PROMPT, ids[len(PROMPT) :])
        return logits_to_probs(process_logits(logits, params, history), params)[0].double()

    first = next_probs(PROMPT)
    joint = torch.zeros(first.numel(), first.numel(), dtype=torch.float64)
    for x1 in range(first.numel()):
        if first[x1] > 0:
            joint[x1] = first[x1] * next_probs(PROMPT + [x1])
    llm = LLM(target, draft=draft, speculative=SpeculativeConfig(method, num_speculative_tokens=3))
    counts = empirical_joint(llm, kwargs, 1500, 3)
    assert chi_square_pvalue(counts, np.asarray(joint)) > 1e-3
