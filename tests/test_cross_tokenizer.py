"""A draft model with another tokenizer (``draft-model`` through text): the aligner's
translations, greedy output identical to plain decoding (a random character-level draft
and an oracle one that spells the target's own continuation, so drafts are long and end
inside target tokens), the exact law of sampled output, and the refusals."""

from __future__ import annotations

import pytest
import torch
from drafter_conformance import PROMPTS, hf_greedy
from test_statistical import PARAMS, PROMPT, chi_square_pvalue, empirical_joint, exact_joint
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from conftest import make_model, make_tokenizer
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.cross_tokenizer import CrossTokenizerDrafter, TextAligner
from specdec.models.hf import HFModel
from specdec.models.native import NativeModel
from specdec.tokenizer import Tokenizer

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


def char_tokenizer(chars: str = "w0123456789 ") -> PreTrainedTokenizerFast:
    """One token per character (``<unk>``=0, ``<s>``=1, ``</s>``=2, then the characters):
    the target's word ``w12`` is three draft tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({c: 3 + i for i, c in enumerate(chars)})
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def char_model(seed: int, chars: str = "w0123456789 ") -> HFModel:
    tok = char_tokenizer(chars)
    config = LlamaConfig(
        vocab_size=len(tok) + 3, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.3, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    return HFModel(LlamaForCausalLM(config).eval(), tok, name="tiny-chars")


class _ListCache:
    def __init__(self) -> None:
        self.ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def truncate(self, n: int) -> None:
        del self.ids[n:]


class OracleCharDraft:
    """A character-level "draft model" that spells the target's greedy next word: given
    the draft text, it finds the target's argmax word after the text's complete words and
    puts a large logit on the next character of it (a space once the word is complete)."""

    backend = "hf"
    name = "oracle-chars"
    max_context = 4096

    def __init__(self, target: HFModel, chars: str = "w0123456789 ") -> None:
        self.target = target
        self.tokenizer = Tokenizer(char_tokenizer(chars), name=self.name)
        self.vocab_size = len(self.tokenizer)
        self.calls = 0
        self._words: dict[tuple[int, ...], str] = {}  # target context -> its argmax word

    def new_cache(self, capacity: int = 0) -> _ListCache:
        return _ListCache()

    def forward(self, token_ids, cache, num_logits: int = 0, **kwargs) -> torch.Tensor:
        self.calls += 1
        cache.ids.extend(int(t) for t in token_ids)
        text = self.tokenizer.hf.decode(cache.ids)
        *complete, partial = text.split(" ")
        ids = [1] + self.target.tokenizer.hf(" ".join(complete), add_special_tokens=False)[
            "input_ids"
        ]
        word = self._words.get(tuple(ids))
        if word is None:
            logits = self.target.forward(ids, self.target.new_cache(len(ids)), num_logits=1)
            word = self.target.tokenizer.hf.convert_ids_to_tokens(int(logits[0].argmax()))
            self._words[tuple(ids)] = word
        inside = word.startswith(partial) and len(partial) < len(word)
        char = word[len(partial)] if inside else " "
        out = torch.zeros(max(num_logits, 1), self.vocab_size)
        out[-1, self.tokenizer.hf.convert_tokens_to_ids(char)] = 10.0
        return out


@pytest.fixture(scope="module")
def pair():
    """The tests' word-level target and a random character-level draft."""
    return make_model(make_tokenizer(), seed=0), char_model(seed=3)


def _cross(target, draft, k: int = 4, **kw) -> LLM:
    config = SpeculativeConfig(method="draft-model", num_speculative_tokens=k, **kw)
    return LLM(target, draft=draft, speculative=config)


def test_aligner_translates_through_text(pair):
    target, draft = pair
    aligner = TextAligner(target.tokenizer, draft.tokenizer)
    words = target.tokenizer.hf("w12 w3", add_special_tokens=False)["input_ids"]
    assert aligner.text([1, *words]) == "w12 w3"  # the target's BOS is not text
    assert aligner.draft_ids([1, *words]) == draft.tokenizer.hf("w12 w3")["input_ids"]
    expected = target.tokenizer.hf("w5 w7", add_special_tokens=False)["input_ids"]
    assert aligner.target_ids([1, *words], " w5 w7") == expected
    # text that merges with the last target token ("w3" -> "w35") proposes nothing
    assert aligner.target_ids([1, *words], "5 w7") == []
    chars = draft.tokenizer.hf("w12", add_special_tokens=False)["input_ids"]
    assert aligner.drafted_text(chars, draft.tokenizer.hf(" w4")["input_ids"]) == " w4"


def test_the_pair_really_differs(pair, caplog):
    target, draft = pair
    assert target.tokenizer.get_vocab() != draft.tokenizer.get_vocab()
    with caplog.at_level("WARNING", logger="specdec.registry"):
        llm = _cross(target, draft)
        assert isinstance(llm.drafter(llm.speculative), CrossTokenizerDrafter)
    assert "has another tokenizer than" in caplog.text  # the user learns which path


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_plain_decoding_random_draft(pair, k):
    target, draft = pair
    llm = _cross(target, draft, k=k)
    for prompt in PROMPTS:
        assert llm.generate(prompt, GREEDY).token_ids == hf_greedy(target, prompt, 40)


@pytest.mark.parametrize("k", [2, 5])
def test_oracle_draft_is_accepted_and_exact(pair, k):
    """A draft that spells the target's own words: long drafts accepted (the alignment
    works, drafts cut inside a word lose only their last token), output unchanged."""
    target, _ = pair
    oracle = OracleCharDraft(target)
    llm = _cross(target, oracle, k=k)
    for prompt in PROMPTS:
        out = llm.generate(prompt, GREEDY)
        assert out.token_ids == hf_greedy(target, prompt, 40)
        s = out.metrics
        assert s.num_draft_tokens > 0
        # tokens per step; the misses are the <s>, </s> and <unk> it cannot spell
        assert s.num_output_tokens / s.num_steps >= 1 + 0.5 * (k - 1), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_exact_identity(dtype):
    tokenizer = make_tokenizer()
    hf = make_model(tokenizer, seed=0)
    hf.model.to(dtype)
    target = NativeModel(hf, exact=True)
    draft_hf = char_model(seed=4)
    draft_hf.model.to(dtype)
    plain = LLM(target, speculative=SpeculativeConfig(method="none"))
    for draft in (NativeModel(draft_hf, exact=True), OracleCharDraft(hf)):
        llm = _cross(target, draft, k=4)
        for prompt in PROMPTS:
            expected = plain.generate(prompt, GREEDY).token_ids
            assert llm.generate(prompt, GREEDY).token_ids == expected


def test_batch_and_stops(pair):
    target, _ = pair
    llm = _cross(target, OracleCharDraft(target), k=6)
    params = [GREEDY, SamplingParams(max_new_tokens=7, ignore_eos=True), GREEDY]
    outs = llm.generate(PROMPTS, params)
    for prompt, p, out in zip(PROMPTS, params, outs, strict=True):
        assert out.token_ids == hf_greedy(target, prompt, p.max_new_tokens)
    expected = hf_greedy(target, PROMPTS[0], 30)
    stop = expected[9]
    params = SamplingParams(max_new_tokens=30, stop_token_ids=(stop,), ignore_eos=True)
    out = llm.generate(PROMPTS[0], params)
    assert out.token_ids == expected[: expected.index(stop) + 1]


def test_sampling_follows_the_target_distribution(small):
    """Sampled drafts are verified as point masses (SLEM's exact match): the two-token
    joint law of the output is the target's. The oracle character draft samples its own
    tokens (through the drafter's sampling path) and mostly spells the target's likeliest
    words, so proposals are both accepted and rejected."""
    target, _ = small
    llm = _cross(target, OracleCharDraft(target, "w01234 "), k=3)
    joint = exact_joint(target, SamplingParams(**PARAMS))
    counts = empirical_joint(llm, PARAMS, 1500, 3)
    assert chi_square_pvalue(counts, joint) > 1e-3
    drafted = llm.generate(PROMPT, SamplingParams(max_new_tokens=20, seed=0, **PARAMS))
    assert drafted.metrics.num_draft_tokens > drafted.metrics.num_accepted_tokens > 0


def test_modes_and_refusals(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="different vocabularies.*tokenizers=auto"):
        _cross(target, draft, options={"tokenizers": "shared"}).generate([1, 5], GREEDY)
    with pytest.raises(ValueError, match="another tokenizer cannot draft token trees"):
        _cross(target, draft, tree="dynamic:top_k=2,depth=3,budget=6").generate([1, 5], GREEDY)
    with pytest.raises(ValueError, match="tokenizers must be auto, shared or text"):
        SpeculativeConfig(method="draft-model:tokenizers=other")
    # the text path on a pair that shares a tokenizer still decodes exactly
    same = make_model(make_tokenizer(), seed=1, hidden_size=16, num_layers=1)
    llm = _cross(target, same, options={"tokenizers": "text"})
    assert isinstance(llm.drafter(llm.speculative), CrossTokenizerDrafter)
    assert llm.generate(PROMPTS[0], GREEDY).token_ids == hf_greedy(target, PROMPTS[0], 40)
