"""Oracles on the real embedded model (SmolLM2-135M-Instruct, float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams, SpeculativeConfig

pytestmark = pytest.mark.real_model

PROMPT = (
    "Repeat this sentence twice: The quick brown fox jumps over the lazy dog near the river bank."
)


@pytest.fixture(scope="module")
def llm():
    # float32: the logit comparisons below use float32 tolerances (dtype auto would follow
    # the machine)
    return LLM(
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=8), dtype="float32"
    )


@pytest.fixture(scope="module")
def baseline(llm):
    return llm.generate(
        PROMPT, SamplingParams(max_new_tokens=48), speculative=SpeculativeConfig(method="none")
    )


def test_chat_template_and_eos_ids(llm):
    ids = llm.encode(PROMPT)
    text = llm.tokenizer.hf.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    im_end = llm.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in llm.tokenizer.eos_token_ids
    assert llm.encode(PROMPT, chat=False) == llm.tokenizer.hf(PROMPT)["input_ids"]


def test_plain_decoding_equals_transformers_greedy(llm, baseline):
    ids = torch.tensor([baseline.prompt_token_ids])
    out = llm.target.model.generate(ids, max_new_tokens=48, do_sample=False)
    assert baseline.token_ids == out[0, ids.shape[1] :].tolist()


def test_ngram_greedy_equals_plain(llm, baseline):
    out = llm.generate(PROMPT, SamplingParams(max_new_tokens=48))
    assert out.token_ids == baseline.token_ids and out.text == baseline.text
    assert out.metrics.mean_acceptance_length > 1.5  # the prompt is copied


def test_draft_model_greedy_equals_plain(llm, baseline):
    # The only real model shipped offline is SmolLM2-135M, so it drafts for itself: every
    # draft token is accepted and the whole verification path is exercised on real weights.
    spec = LLM(
        llm.target,
        draft=llm.target,
        speculative=SpeculativeConfig(method="draft-model", num_speculative_tokens=3),
    )
    out = spec.generate(PROMPT, SamplingParams(max_new_tokens=48))
    assert out.token_ids == baseline.token_ids
    assert out.metrics.acceptance_rate == 1.0


def test_end_of_turn_ends_output(llm, baseline):
    out = llm.generate("Say hello.", SamplingParams(max_new_tokens=100))
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert "<|im_end|>" not in out.text and out.text.strip()


def test_sampling_is_seeded(llm):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_new_tokens=24)
    assert llm.generate(PROMPT, params).token_ids == llm.generate(PROMPT, params).token_ids


def test_tree_branch_equivalence_on_real_model(llm):
    """Logits at each node of a tree forward equal a causal forward over its path."""
    from specdec.trees import ROOT, TokenTree

    target = llm.target
    ids = llm.encode(PROMPT)
    tree = TokenTree.build([ROOT, ROOT, 0, 0, 2], [504, 260, 2115, 31, 198])
    cache = target.new_cache(len(ids) + 8)
    target.forward(ids[:-1], cache)
    logits = target.forward_tree(ids[-1], tree, cache)
    for i in range(len(tree)):
        path = ids + [tree.token_ids[n] for n in tree.path_to(i)]
        expected = target.forward(path, target.new_cache(len(path)), num_logits=1)[0]
        torch.testing.assert_close(logits[i + 1], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tree", ["dynamic:top_k=4,depth=5,budget=16", "static:tree-16"])
def test_tree_decoding_greedy_equals_plain(llm, baseline, tree):
    out = llm.generate(
        PROMPT,
        SamplingParams(max_new_tokens=48),
        speculative=SpeculativeConfig(method="ngram", tree=tree),
    )
    assert out.token_ids == baseline.token_ids
    assert out.metrics.mean_acceptance_length > 1.5


def test_text_never_ends_inside_a_character(llm):
    """SmolLM2's byte-level tokens split CJK characters; a generation that stops between
    them must not end its text (final, streamed or JSON) with U+FFFD."""
    prompt = "把这句话重复两遍：我喜欢吃苹果和香蕉。我喜欢吃苹果和香蕉。"
    full = llm.generate(prompt, SamplingParams(max_new_tokens=48, ignore_eos=True))
    decode = llm.tokenizer.decode
    cuts = [n for n in range(1, 49) if decode(full.token_ids[:n]).endswith("\ufffd")]
    assert cuts, "the prompt should produce a generation cut inside a character"
    n = cuts[0]
    out = llm.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
    assert out.token_ids == full.token_ids[:n]  # the ids keep every token
    assert not out.text.endswith("\ufffd") and full.text.startswith(out.text)
    streamed = "".join(c.text for c in llm.stream(prompt, SamplingParams(max_new_tokens=n)))
    assert streamed == out.text


BATCH_PROMPTS = [
    PROMPT,
    "Name three rivers in Europe and one fact about each.",
    "Translate to German: The weather is nice today and we will walk in the park.",
    "Summarize in one sentence: " + " ".join(["The council met on Monday to discuss the new "
    "library, the bridge repairs and the summer market, and agreed to fund all three."] * 6),
    "What is 17 times 23? Explain step by step.",
    "Write a haiku about snow.",
]  # fmt: skip


def test_bfloat16_batch_equals_plain_decoding_of_each_prompt():
    """Exact mode on the real model in bfloat16: a batch of mixed prompts with speculation
    gives each prompt exactly its plain, one-at-a-time greedy output (the kernels'
    row-invariance is what makes this hold; bf16 rounding would expose any lapse)."""
    llm = LLM(
        backend="native",
        dtype="bfloat16",
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=5),
    )
    params = SamplingParams(max_new_tokens=32)
    batch = llm.generate(BATCH_PROMPTS, params)
    for prompt, out in zip(BATCH_PROMPTS, batch, strict=True):
        plain = llm.generate(prompt, params, speculative=SpeculativeConfig(method="none"))
        assert out.token_ids == plain.token_ids, prompt


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shipped_heads_are_lossless_and_accepted(dtype):
    """The heads shipped for the embedded model load with no options on both dtypes (the
    fingerprint ignores the dtype), keep greedy output exactly (native exact mode), in
    chains and trees (EAGLE-2's; the parallel head's one-forward tree), and their drafts
    are accepted."""
    llm = LLM(backend="native", dtype=dtype, speculative=SpeculativeConfig(method="none"))
    prompt = "Write a short story about a cat who learns to play the piano."
    params = SamplingParams(max_new_tokens=40)
    plain = llm.generate(prompt, params).token_ids
    for spec in (
        SpeculativeConfig(method="eagle", num_speculative_tokens=4),
        SpeculativeConfig(method="eagle", tree="dynamic:top_k=3,depth=4,budget=8"),
        SpeculativeConfig(method="medusa", num_speculative_tokens=3),
        SpeculativeConfig(method="parallel", num_speculative_tokens=4),
        SpeculativeConfig(method="parallel", tree="dynamic:top_k=3,depth=4,budget=8"),
    ):
        out = llm.generate(prompt, params, speculative=spec)
        assert out.token_ids == plain, spec.method
        assert out.metrics.num_accepted_tokens > 0, spec.method
        # what `specdec generate` reports: the head that ran and its weights' format
        from specdec.cli import head_meta
        from specdec.runtime.kernels import kernel_available

        head = llm.drafter(spec).head
        meta = head_meta(llm.drafter(spec))
        assert spec.method in meta["head"]
        float_name = str(head.dtype).replace("torch.", "")
        quantized = kernel_available() and head.dtype == torch.float32  # auto: q8_0 there
        assert meta["head_weights"] == ("q8_0" if quantized else float_name)
    assert head_meta(llm.drafter(SpeculativeConfig(method="ngram"))) == {}
