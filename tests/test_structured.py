"""Structured output under speculation: a grammar masks every verified row with the grammar
state of that row's own history, and the grammar's end ends the output.

Oracles: the masks of a chain or tree in one pass against fresh llguidance matchers fed
each row's history; the exact output law of one production verification step (chain and
tree, with a history-dependent grammar and penalties) against plain decoding with the same
mask, and a planted bug (the grammar checked on the first row only) that the law catches;
greedy speculation equal to plain decoding end to end for every kind of constraint (ngram,
draft model, chains and trees) on a tiny model with a byte-level tokenizer; a sampled
chi-square check; refusals of bad specs.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from test_statistical import PROMPT, chi_square_pvalue
from test_transforms import (
    FLOAT32_LAW,
    OUTPUT_IDS,
    PROMPT_IDS,
    STOPS,
    Transformed,
    reference_probs,
)
from test_transforms import chain_law as transforms_chain_law
from test_transforms import tree_law as transforms_tree_law
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from conftest import make_model, perturbed_copy
from exact_laws import _extend, worst_error
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.base import DraftProposal, NoDrafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engine.generate import generate_steps
from specdec.engine.stops import StopChecker
from specdec.sampling import TokenHistory
from specdec.structured import GrammarCompiler, GrammarState, StructuredOutputsParams

# ------------------------------------------------------------ a byte-level tiny model

CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["math", "poetry"], "ok": true}',
    "the cat sat on the mat, yes or no",
    "(555) 123-4567 and 42.5e3",
] * 20


def make_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 300-token byte-level BPE (GPT-2 style), trained in code: ``<unk>`` = 0,
    ``<s>`` = 1, ``</s>`` = 2 (EOS)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def byte_target():
    return make_model(make_byte_tokenizer(), seed=0, max_positions=256, name="tiny-bytes")


@pytest.fixture(scope="module")
def byte_draft(byte_target):
    return perturbed_copy(byte_target, noise=0.02, seed=5, name="tiny-bytes-draft")


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
    "grammar": StructuredOutputsParams(
        grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/\n'
    ),
}


def _valid(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        return set(value) == {"name", "age", "ok"} and isinstance(value["age"], int)
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", text) is not None
    if kind == "choice":
        return text in ("yes", "no", "maybe so")
    return re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", text) is not None


# ------------------------------------------------------------ the spec


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "exactly one"),
        (dict(regex="a", choice=["a"]), "exactly one"),
        (dict(json="[1, 2]"), "JSON object"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(choice=[]), "non-empty"),
        (dict(choice="yes"), "list of strings"),
        (dict(choice=["a", ""]), "non-empty"),
        (dict(regex=""), "non-empty"),
        (dict(grammar="x" * (1 << 17 + 1)), "at most"),
    ],
)
def test_bad_specs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_the_spec_or_a_dict_of_its_fields():
    params = SamplingParams(structured_outputs={"regex": "a+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs="a+")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(regex="(ab"), "invalid regex"),
        (dict(grammar="start: undefined_rule"), "invalid grammar"),
        (dict(json={"type": "no-such-type"}), "invalid JSON schema"),
        (dict(json={"type": "string", "minLength": 3, "maxLength": 1}), "invalid JSON schema"),
    ],
)
def test_invalid_grammars_are_refused_before_any_model(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_a_tokenizer_llguidance_cannot_read_is_refused(target):
    """The word-level test tokenizer has no byte form of its tokens."""
    llm = LLM(target, speculative=SpeculativeConfig("none"))
    params = SamplingParams(max_new_tokens=4, structured_outputs=SPECS["choice"])
    with pytest.raises(ValueError, match="byte-level"):
        llm.generate([3, 4, 5], params)


def test_the_engine_wants_the_spec_and_the_state_together(byte_target):
    params = SamplingParams(max_new_tokens=4, structured_outputs=SPECS["choice"])
    steps = generate_steps(
        byte_target, NoDrafter(), [5, 6], params, 0, StopChecker(()), torch.Generator()
    )
    with pytest.raises(ValueError, match="go together"):
        next(steps)


# ------------------------------------------------------------ masks


def _fresh_mask(compiler, spec, tokens) -> torch.Tensor:
    """The reference: a new matcher fed ``tokens`` one by one."""
    state = compiler.matcher(spec)
    for t in tokens:
        assert state.matcher.consume_token(t)
    return state.allowed([()])[0]


@pytest.mark.parametrize("kind", ["json", "regex", "grammar"])
def test_chain_and_tree_masks_equal_fresh_matchers(byte_target, kind):
    tok = byte_target.tokenizer
    compiler = GrammarCompiler(tok.hf, byte_target.vocab_size, tok.eos_token_ids)
    spec = SPECS[kind]
    text = {
        "json": '{"name":"Ada","age":36,"ok":true}',
        "regex": "(555) 123-4567",
        "grammar": "(1,22,333)",
    }[kind]
    ids = tok.hf.encode(text, add_special_tokens=False)
    committed, rest = ids[:2], ids[2:]
    state = compiler.matcher(spec)
    assert state.commit(committed) == len(committed)
    before = state.allowed([()])
    chain = [rest[:i] for i in range(len(rest) + 1)]
    bad = rest[:1] + [300 - 1]  # a path through a forbidden token, then on
    tree = [(), rest[:1], rest[:2], bad, [*bad, rest[1]], rest[:3], rest[:1]]
    for prefixes in (chain, tree):
        masks = state.allowed(prefixes)
        assert masks.shape == (len(prefixes), byte_target.vocab_size)
        for row, prefix in zip(masks, prefixes, strict=True):
            reachable = prefix[-1:] != [299] and 299 not in prefix
            if reachable:
                assert torch.equal(row, _fresh_mask(compiler, spec, committed + list(prefix)))
            else:  # unreachable: the mask of the last reachable state, never empty
                assert row.any()
    assert torch.equal(state.allowed([()]), before)  # exploring drafts changed nothing
    assert state.valid_prefix_length(rest) == len(rest)
    assert state.valid_prefix_length(bad) == 1


def test_padding_ids_beyond_the_tokenizer_are_never_allowed(byte_target):
    tok = byte_target.tokenizer
    compiler = GrammarCompiler(tok.hf, byte_target.vocab_size + 20, tok.eos_token_ids)
    masks = compiler.matcher(SPECS["json_object"]).allowed([()])
    assert masks.shape[1] == byte_target.vocab_size + 20 and not masks[0, -20:].any()


# ------------------------------------------------------------ the exact law


class NoRepeat:
    """A history-dependent toy grammar on the law oracle's 4-token vocabulary: no token
    twice in a row, and token 3 never right after token 0. It reads the committed output
    plus each row's prefix, as a real grammar state does."""

    def __init__(self, committed, first_row_only: bool = False) -> None:
        self.committed = list(committed)
        self.first_row_only = first_row_only

    @staticmethod
    def mask(history) -> torch.Tensor:
        allowed = torch.ones(4, dtype=torch.bool)
        if history:
            allowed[history[-1]] = False
            if history[-1] == 0:
                allowed[3] = False
        return allowed

    def allowed(self, prefixes):
        rows = []
        for prefix in prefixes:
            if self.first_row_only and prefix:  # the planted bug: later rows unchecked
                rows.append(torch.ones(4, dtype=torch.bool))
            else:
                rows.append(self.mask(self.committed + list(prefix)))
        return torch.stack(rows)


class Masked(Transformed):
    """Plain decoding's law with the toy grammar (first) and the other transforms."""

    def p(self, ctx: tuple) -> torch.Tensor:
        logits = self.raw(ctx).log()
        output = list(OUTPUT_IDS) + list(ctx)
        logits = logits.masked_fill(~NoRepeat.mask(output), -math.inf)
        return reference_probs(logits, self.params, PROMPT_IDS, output, STOPS)


def _history(bug: bool = False):
    """The oracle's committed state with the toy grammar (``bug``: first row only)."""
    return lambda: TokenHistory(PROMPT_IDS, OUTPUT_IDS, STOPS, NoRepeat(OUTPUT_IDS, bug))


def chain_law(model: Masked, k: int, mode: str, bug: bool = False) -> dict:
    return transforms_chain_law(model, k, mode, history=_history(bug))


def tree_law(model: Masked, shape, mode: str) -> dict:
    return transforms_tree_law(model, shape, mode, history=_history())


def _want(model, length: int) -> dict:
    law: dict = {}
    _extend(model, {(): 1.0}, length, 1.0, law)
    return law


#: the spec rides along (it tells the verifier a grammar is there); NoRepeat decides
TOY = StructuredOutputsParams(regex="toy")
LAW_PARAMS = {
    "grammar": dict(structured_outputs=TOY),
    "grammar+penalties": dict(
        structured_outputs=TOY, repetition_penalty=1.7, frequency_penalty=0.9, logit_bias={2: 1.0}
    ),
}


@pytest.mark.parametrize("name", list(LAW_PARAMS))
@pytest.mark.parametrize("mode", ["iid", "deterministic"])
def test_chain_step_law_equals_plain_decoding_with_the_grammar(name, mode):
    params = SamplingParams(temperature=1.0, **LAW_PARAMS[name])
    for seed in range(2):
        model = Masked(seed, "random", params)
        assert worst_error(chain_law(model, 2, mode), _want(model, 3)) < FLOAT32_LAW


@pytest.mark.parametrize("mode", ["iid", "wor"])
def test_tree_step_law_equals_plain_decoding_with_the_grammar(mode):
    params = SamplingParams(temperature=1.0, **LAW_PARAMS["grammar+penalties"])
    model = Masked(0, "random", params)
    assert worst_error(tree_law(model, (2, 1), mode), _want(model, 3)) < FLOAT32_LAW


def test_planted_bug_grammar_unchecked_after_the_first_row_is_caught():
    """vLLM's bug (PR #36138): grammar checks skipped for tokens later in a draft block."""
    model = Masked(0, "random", SamplingParams(temperature=1.0, structured_outputs=TOY))
    assert worst_error(chain_law(model, 2, "iid", bug=True), _want(model, 3)) > 1e-3


# ------------------------------------------------------------ end to end

METHODS = [
    ("ngram", None),
    ("draft-model", None),
    ("draft-model", "dynamic:top_k=3,depth=4,budget=10"),
    ("ngram", "static:tree-8"),
    ("suffix", None),
]


def _plain(llm, prompt, params):
    return llm.generate(prompt, params, speculative=SpeculativeConfig("none"))


@pytest.mark.parametrize("kind", list(SPECS))
def test_greedy_speculation_equals_plain_decoding(byte_target, byte_draft, kind):
    params = SamplingParams(max_new_tokens=40, structured_outputs=SPECS[kind])
    llm = LLM(byte_target, draft=byte_draft, speculative=SpeculativeConfig("ngram"))
    for prompt in ['{"name": "', "the cat sat"]:
        plain = _plain(llm, prompt, params)
        if plain.finish_reason == "stop":
            assert _valid(kind, plain.text), plain.text
        for method, tree in METHODS:
            spec = SpeculativeConfig(method, num_speculative_tokens=4, tree=tree)
            out = llm.generate(prompt, params, speculative=spec)
            assert out.token_ids == plain.token_ids, (method, tree)
            assert (out.text, out.finish_reason) == (plain.text, plain.finish_reason)


def test_the_grammar_changes_greedy_output_and_completes(byte_target):
    """Every kind really constrains the tiny model, and most complete within the budget
    (else the test above would only compare cut-off outputs)."""
    llm = LLM(byte_target, speculative=SpeculativeConfig("none"))
    free = llm.generate("the cat sat", SamplingParams(max_new_tokens=40)).token_ids
    completed = 0
    for kind, spec in SPECS.items():
        out = llm.generate(
            "the cat sat", SamplingParams(max_new_tokens=40, structured_outputs=spec)
        )
        assert out.token_ids != free, kind
        if out.finish_reason == "stop":
            completed += 1
            assert _valid(kind, out.text), (kind, out.text)
    assert completed >= 3


class Continuation:
    """Proposes a fixed continuation (the tokens after what is already output)."""

    def __init__(self, tokens: list[int], num_prompt: int) -> None:
        self.tokens, self.num_prompt = tokens, num_prompt

    def start(self, prompt_ids, params):
        return self

    def close(self):
        pass

    def propose(self, token_ids, num_tokens, generator):
        done = len(token_ids) - self.num_prompt
        return DraftProposal(self.tokens[done : done + num_tokens])


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_grammar_that_ends_mid_block_ends_the_output(byte_target, ignore_eos):
    """The drafter proposes the whole choice and more in one block; the output is the
    choice exactly, ended with "stop" in that one step, nothing after it (stop token
    included), in text, ids, stream and counts."""
    text = "the cat sat on the mat"
    hf = byte_target.tokenizer.hf
    choice = hf.encode(text, add_special_tokens=False)
    prompt = hf.encode("yes", add_special_tokens=False)
    drafter = Continuation(choice + [5, 6, 7, 2, 9], len(prompt))
    llm = LLM(byte_target, drafter=drafter, speculative=SpeculativeConfig("custom", 16))
    params = SamplingParams(
        max_new_tokens=30, ignore_eos=ignore_eos, logprobs=1,
        structured_outputs=StructuredOutputsParams(choice=[text, "no"]),
    )  # fmt: skip
    out = llm.generate(prompt, params)
    assert (out.text, out.token_ids, out.finish_reason) == (text, choice, "stop")
    assert out.metrics.num_steps == 1  # one block: the grammar ended it
    assert out.metrics.num_output_tokens == len(choice) == len(out.logprobs)
    # the draft was cut at the first token the grammar forbids; every kept token was drafted
    assert out.metrics.num_draft_tokens == out.metrics.num_accepted_tokens == len(choice)
    chunks = list(llm.stream(prompt, params))
    assert "".join(c.text for c in chunks) == text and chunks[-1].output.token_ids == choice


def test_max_tokens_inside_the_grammar_ends_with_length(byte_target):
    llm = LLM(byte_target, speculative=SpeculativeConfig("ngram", num_speculative_tokens=4))
    params = SamplingParams(max_new_tokens=3, structured_outputs=SPECS["regex"])
    out = llm.generate("the cat", params)
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith("(")


def test_batched_requests_with_different_grammars_equal_alone(byte_target, byte_draft):
    llm = LLM(byte_target, draft=byte_draft, speculative=SpeculativeConfig("draft-model", 4))
    prompts = ["the cat", '{"name', "(555", "yes"]
    params = [
        SamplingParams(max_new_tokens=24, structured_outputs=SPECS[k])
        for k in ("json", "regex", "choice", "grammar")
    ]
    together = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        assert out.token_ids == llm.generate(prompt, p).token_ids


def test_seeded_sampling_with_a_grammar_equals_plain_and_stays_valid(byte_target, byte_draft):
    """Sampled with a seed, speculation and plain decoding give valid outputs; each output
    satisfies the grammar whatever the drafts proposed."""
    llm = LLM(byte_target, draft=byte_draft, speculative=SpeculativeConfig("draft-model", 4))
    for seed in range(4):
        params = SamplingParams(
            temperature=1.0, seed=seed, max_new_tokens=40, structured_outputs=SPECS["grammar"]
        )
        out = llm.generate("the cat", params)
        if out.finish_reason == "stop":
            assert _valid("grammar", out.text), out.text
        else:
            assert re.fullmatch(r"\(\d{1,3}(,\d{1,3})*,?", out.text), out.text


@pytest.mark.parametrize("forcing", [False, True])
@pytest.mark.parametrize("method", ["draft-model", "ngram"])
def test_sampled_speculation_with_a_grammar_matches_plain_law(small, method, forcing):
    """Chi-square on the first two tokens (toy grammar on the 8-token model): speculation
    against the exact law of plain decoding with the same mask. ``forcing``: the grammar
    allows only token 5 first and offers it as forced, which the engine drafts in place
    of the drafter's chain (``_with_forced``)."""
    target, draft = small
    vocab = target.vocab_size

    class Toy(NoRepeat):
        @staticmethod
        def mask(history):
            allowed = torch.ones(vocab, dtype=torch.bool)
            allowed[:3] = False  # no special tokens
            if history:
                allowed[history[-1]] = False
            elif forcing:
                allowed[:] = False
                allowed[5] = True
            return allowed

        def commit(self, tokens):
            self.committed += list(tokens)
            return len(tokens)

        def forced_tokens(self, max_tokens):
            return [5][:max_tokens] if forcing and not self.committed else []

        is_stopped = False
        valid_prefix_length = GrammarState.valid_prefix_length  # reads allowed() only

    def next_probs(ids):
        logits = target.forward(ids, target.new_cache(len(ids)), num_logits=1)[0].double()
        logits = logits.masked_fill(~Toy.mask(ids[len(PROMPT) :]), -math.inf)
        return torch.softmax(logits, -1)

    first = next_probs(PROMPT)
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for x1 in range(vocab):
        if first[x1] > 0:
            joint[x1] = first[x1] * next_probs(PROMPT + [x1])
    drafter = (
        DraftModelDrafter(draft, vocab, vocab) if method == "draft-model" else NgramDrafter(1, 3)
    )
    counts = np.zeros((vocab, vocab))
    for seed in range(1500):
        params = SamplingParams(temperature=1.0, max_new_tokens=2, structured_outputs=TOY)
        gen = torch.Generator().manual_seed(seed)
        ids = []
        for step in generate_steps(
            target, drafter, PROMPT, params, 3, StopChecker(()), gen, grammar=Toy([])
        ):
            ids += step.new_token_ids
        counts[ids[0], ids[1]] += 1
    assert chi_square_pvalue(counts, np.asarray(joint)) > 1e-3


# ------------------------------------------------------------ dead ends


@pytest.mark.parametrize("tree", [None, "static:tree-8"])
def test_a_grammar_whose_words_are_banned_fails_that_request_only(byte_target, tree):
    """choice "the cat" with the bad word "cat": after "the" nothing is allowed. The
    request fails with a clear error (never a crash, never a token outside the grammar);
    in a batch, the other requests finish as they would alone."""
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engine import Engine
    from specdec.sampling import NoAllowedToken

    llm = LLM(byte_target, speculative=SpeculativeConfig("ngram", 4, tree=tree))
    spec = StructuredOutputsParams(choice=["the cat"])
    bad = SamplingParams(max_new_tokens=10, structured_outputs=spec, bad_words=["cat"])
    with pytest.raises(
        NoAllowedToken, match="no token is allowed.*choice constraint and bad_words"
    ):
        llm.generate("yes", bad)
    banned_first = SamplingParams(max_new_tokens=10, structured_outputs=spec, bad_words=["the"])
    with pytest.raises(ValueError, match="no token is allowed after 0 output tokens"):
        llm.generate("yes", banned_first)
    good = SamplingParams(
        max_new_tokens=10, structured_outputs=StructuredOutputsParams(regex="[a-z ]+")
    )
    engine = Engine(byte_target)
    hf = byte_target.tokenizer.hf
    prompt = hf.encode("the cat sat", add_special_tokens=False)
    ok = engine.add_request(
        "ok", prompt, good, drafter=NgramDrafter(), num_speculative_tokens=4,
        grammar=llm.grammar(good),
    )  # fmt: skip
    failing = engine.add_request(
        "bad", prompt, llm.resolve_params(bad), drafter=NgramDrafter(), num_speculative_tokens=4,
        grammar=llm.grammar(bad),
    )  # fmt: skip
    while engine.has_unfinished():
        engine.step()
    assert failing.finish_reason == "error" and "no token is allowed" in failing.error
    assert ok.output_ids == llm.generate(prompt, good).token_ids
