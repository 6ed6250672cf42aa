"""Native runtime oracles: logits equal transformers' (tiny Llama, Qwen2, Qwen3, Mistral and
the real model), ragged batches, batch invariance of the exact mode (bit for bit), greedy
speculative identity, rollback / compaction, and clear refusals."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from conftest import make_tokenizer
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.models.base import BatchItem
from specdec.models.hf import HFModel
from specdec.models.native import NativeModel
from specdec.runtime.weights import UnsupportedModel
from specdec.trees import ROOT, TokenTree

COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.3,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v biases
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),  # q/k norms, wide heads
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


def tiny_hf(arch: str, seed: int = 0, dtype=torch.float32, **overrides) -> HFModel:
    config_cls, model_cls, extra = ARCHS[arch]
    tokenizer = make_tokenizer()
    config = config_cls(vocab_size=len(tokenizer), **COMMON, **{**extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if arch == "qwen2":  # random biases (transformers initialises them to zero)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    proj.bias.normal_(0, 0.3)
    return HFModel(model.to(dtype), tokenizer, name=f"tiny-{arch}")


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request):
    hf = tiny_hf(request.param)
    return hf, NativeModel(hf, exact=False)


PROMPT = [1, 5, 6, 7, 8, 9, 10, 5, 6, 7]
TREE = TokenTree.build([ROOT, ROOT, 0, 0, 1, 2], [11, 12, 13, 14, 15, 16])


def test_logits_equal_transformers(pair):
    hf, native = pair
    ref, mine = hf.new_cache(32), native.new_cache(32)
    close = dict(atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(native.forward(PROMPT, mine), hf.forward(PROMPT, ref), **close)
    chain = [3, 4, 20]
    torch.testing.assert_close(native.forward(chain, mine), hf.forward(chain, ref), **close)
    torch.testing.assert_close(
        native.forward_tree(21, TREE, mine), hf.forward_tree(21, TREE, ref), **close
    )
    assert mine.num_tokens == ref.num_tokens == len(PROMPT) + 3 + len(TREE) + 1
    # only the last rows' logits
    last = native.forward([5], native.new_cache(4), num_logits=1)
    assert last.shape == (1, hf.vocab_size)


def test_hidden_states_equal_transformers(pair):
    hf, native = pair
    close = dict(atol=2e-5, rtol=1e-5)
    ref = hf.forward_full(PROMPT, hf.new_cache(16), num_logits=3)
    mine = native.forward_full(PROMPT, native.new_cache(16), num_logits=3)
    assert mine.hidden.shape == ref.hidden.shape == (3, hf.model.config.hidden_size)
    torch.testing.assert_close(mine.hidden, ref.hidden, **close)
    torch.testing.assert_close(mine.logits, ref.logits, **close)
    # the hidden states are what the LM head reads
    head = hf.model.get_output_embeddings().weight.detach()
    torch.testing.assert_close(mine.hidden @ head.t(), mine.logits, **close)
    with pytest.raises(ValueError, match="native backend"):
        hf.forward_full(PROMPT, hf.new_cache(16), layers=[0])


def _hf_with_layers(hf: HFModel, layers: list[int]) -> HFModel:
    """A transformers model made of ``layers`` of ``hf`` only (same embeddings, norm, head)."""
    import copy

    module = copy.deepcopy(hf.model)
    module.model.layers = torch.nn.ModuleList([module.model.layers[i] for i in layers])
    for new_index, layer in enumerate(module.model.layers):
        layer.self_attn.layer_idx = new_index
    module.config.num_hidden_layers = len(layers)
    if getattr(module.config, "layer_types", None):
        module.config.layer_types = [module.config.layer_types[i] for i in layers]
    return HFModel(module, hf.tokenizer, name="subset")


@pytest.mark.parametrize("layers", [[0], [1]], ids=["first-layer", "skip-first"])
def test_layer_subset_equals_a_model_of_those_layers(pair, layers):
    hf, native = pair
    subset = _hf_with_layers(hf, layers)
    close = dict(atol=2e-5, rtol=1e-5)
    ref_cache, cache = subset.new_cache(16), native.new_cache(16)
    ref = subset.forward(PROMPT, ref_cache)
    mine = native.forward_full(PROMPT, cache, layers=layers)
    torch.testing.assert_close(mine.logits, ref, **close)
    # drafting continues on the subset, sharing the cache with the full model
    torch.testing.assert_close(
        native.forward_full([3, 4], cache, layers=layers).logits,
        subset.forward([3, 4], ref_cache),
        **close,
    )
    with pytest.raises(ValueError, match="increasing"):
        native.forward_full([3], cache, layers=[1, 0])
    with pytest.raises(ValueError, match="increasing"):
        native.forward_full([3], cache, layers=[5])


def test_layer_skip_drafting_then_full_verification_equals_plain(pair):
    """Draft on the first layer over the shared cache, roll back, verify with all layers:
    the same logits as a cache that never saw the drafting pass."""
    _, native = pair
    cache, fresh = native.new_cache(16), native.new_cache(16)
    for c in (cache, fresh):
        native.forward(PROMPT, c)
    start = cache.num_tokens
    native.forward_full([3, 4, 20], cache, layers=[0])
    cache.truncate(start)
    torch.testing.assert_close(
        native.forward([3, 4, 20], cache), native.forward([3, 4, 20], fresh), atol=0, rtol=0
    )


def test_ragged_batch_equals_separate_forwards(pair):
    _, native = pair
    for exact in (False, True):
        prompts = [PROMPT, [1, 9], [1, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]]
        caches = [native.new_cache(8) for _ in prompts]
        for p, c in zip(prompts, caches, strict=True):
            native.decoder.forward([BatchItem(p[:-1], c)], exact=exact)
        tree_item = BatchItem(
            [prompts[2][-1], *TREE.token_ids],
            caches[2],
            positions=caches[2].num_tokens + TREE.position_offsets(),
            tree_mask=TREE.attention_mask(),
        )
        items = [
            BatchItem([prompts[0][-1], 3, 4], caches[0]),
            BatchItem([prompts[1][-1]], caches[1]),
            tree_item,
        ]
        batched = native.decoder.forward(items, exact=exact)
        for item, logits in zip(items, batched, strict=True):
            item.cache.truncate(item.cache.num_tokens - len(item.token_ids))
            alone = native.decoder.forward([item], exact=exact)[0]
            if exact:
                assert torch.equal(logits, alone)
            else:
                torch.testing.assert_close(logits, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group_rows", [1, 40, 256], ids=["alone", "mixed", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prompt_chunks_in_a_batch_equal_alone(dtype, group_rows, monkeypatch):
    """Exact mode runs the prompt chunks of a ragged batch shorter than
    ``PREFILL_GROUP_ROWS`` as one forward, each longer one as a forward of its own, and the
    decoding rows together: logits and cached keys and values are the bits each item gets
    alone, whatever else is in the batch (two prompts, a later chunk of a prompt, a
    decoding row, a chain) and whatever the grouping."""
    from specdec.runtime import model as runtime_model

    monkeypatch.setattr(runtime_model, "PREFILL_GROUP_ROWS", group_rows)
    native = NativeModel(tiny_hf("llama", dtype=dtype, head_dim=64), exact=True)
    long = [1, *[(5 * i) % 23 + 2 for i in range(70)]]

    def items():
        caches = [native.new_cache(128) for _ in range(4)]
        native.decoder.forward([BatchItem(long[:40], caches[2], prefill=True)])
        native.decoder.forward([BatchItem(PROMPT, caches[3])])
        return [
            BatchItem(long[:50], caches[0], num_logits=1),  # a prompt from an empty cache
            BatchItem(PROMPT[:5], caches[1]),  # another prompt
            BatchItem(long[40:70], caches[2], prefill=True),  # a prompt's second chunk
            BatchItem([3, 4, 5], caches[3]),  # a chain after a prompt
        ]

    batch = items()
    groups = runtime_model._prefill_groups(batch)
    expected = {1: [[3], [0], [1], [2]], 40: [[3], [1, 2], [0]], 256: [[3], [0, 1, 2]]}
    assert groups == expected[group_rows]
    together = native.decoder.forward_full(batch)
    alone_items = items()
    for item, mixed, single in zip(batch, together, alone_items, strict=True):
        (own,) = native.decoder.forward_full([single])
        assert torch.equal(mixed.logits, own.logits)
        assert item.cache.num_tokens == single.cache.num_tokens
        n = item.cache.num_tokens
        assert torch.equal(item.cache.kv[:, :, :, :n], single.cache.kv[:, :, :, :n])


def test_causal_prompt_attention_equals_the_masked_one():
    """A prompt from an empty cache runs causal attention without a mask; it equals the
    masked formulation (to rounding) and the mask builder says so only for that case."""
    from specdec.runtime.attention import CAUSAL, attention_fast, visibility_mask

    torch.manual_seed(0)
    t, h, g, d = 37, 6, 2, 16
    q, k, v = torch.randn(t, h, d), torch.randn(g, t, d), torch.randn(g, t, d)
    visible = [i + 1 for i in range(t)]
    assert visibility_mask(visible, t, "cpu") == CAUSAL
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    torch.testing.assert_close(
        attention_fast(q, k, v, CAUSAL, 0.25), attention_fast(q, k, v, mask, 0.25)
    )
    later = visibility_mask([i + 4 for i in range(t)], t + 3, "cpu")  # a second chunk
    assert isinstance(later, torch.Tensor) and later.shape == (t, t + 3)
    assert visibility_mask([t], t, "cpu") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "attention, head_dim",
    [("kernel", 8), ("kernel", 64), ("reference", 8)],
    ids=["kernel-d8", "kernel-d64", "reference-d8"],
)
def test_exact_mode_is_batch_invariant(dtype, attention, head_dim):
    """A row's logits: the same bits decoded alone, as row i of a chain of 1..64 rows, as a
    tree node, and next to other sequences; with the compiled attention kernel (both of its
    code paths: head_dim 64 takes the AVX-512 one where the CPU has it) and with the
    PyTorch reference the runtime falls back to."""
    native = NativeModel(tiny_hf("llama", dtype=dtype, head_dim=head_dim), exact=True)
    if attention == "reference":
        native.decoder.use_kernel = False
    elif os.environ.get("SPECDEC_ATTENTION", "").lower() == "reference":
        pytest.skip("SPECDEC_ATTENTION=reference turns the kernels off")
    else:
        assert native.decoder.use_kernel, "the C++ kernels did not build"
    seq = [1, *[(7 * i) % 29 + 3 for i in range(80)]]
    cache = native.new_cache(128)
    native.forward(seq[:10], cache)
    decoded = []
    for i in range(10, 80):  # plain decoding, one token at a time
        decoded.append(native.forward([seq[i]], cache)[0])
    for width in (2, 3, 7, 16, 33, 64):
        for start in (10, 12):
            if start + width > 80:
                continue
            cache.truncate(start)
            rows = native.forward(seq[start : start + width], cache)
            for j in range(width):
                assert torch.equal(rows[j], decoded[start - 10 + j]), (width, start, j)
    # in a cache of another capacity (keys read in place at other strides)
    big = native.new_cache(1000)
    native.forward(seq[:10], big)  # the same first forward (the prompt)
    native.forward(seq[10:12], big)
    rows = native.forward(seq[12:40], big)
    for j in range(28):
        assert torch.equal(rows[j], decoded[2 + j]), j
    # as the deepest node of a tree whose other branches are noise
    cache.truncate(20)
    tree = TokenTree.build([ROOT, ROOT, 1, 1, 3], [5, seq[21], 9, seq[22], seq[23]])
    rows = native.forward_tree(seq[20], tree, cache)
    for node, i in ((1, 21), (3, 22), (4, 23)):
        assert torch.equal(rows[node + 1], decoded[i - 10])
    # beside other sequences in one ragged forward
    cache.truncate(20)
    native.forward(seq[20:30], cache)
    other = native.new_cache(16)
    native.forward([1, 4, 4, 4], other)
    out = native.forward_batch([BatchItem([9, 9], other), BatchItem(seq[30:34], cache)])
    for j in range(4):
        assert torch.equal(out[1][j], decoded[20 + j])


def test_compaction_and_rollback_equal_recompute(pair):
    _, native = pair
    cache = native.new_cache(8)
    native.forward(PROMPT, cache)
    base = cache.num_tokens
    native.forward_tree(3, TREE, cache)
    path = TREE.path_to(4)  # root's child 1, then node 4
    cache.compact([base + 1 + n for n in path], start=base + 1)
    fresh = native.new_cache(8)
    native.forward([*PROMPT, 3, *[TREE.token_ids[n] for n in path]], fresh)
    a = native.forward([7], cache)
    b = native.forward([7], fresh)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    cache.truncate(4)
    fresh = native.new_cache(8)
    native.forward(PROMPT[:4], fresh)
    torch.testing.assert_close(native.forward([7], cache), native.forward([7], fresh))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "method, tree",
    [
        ("ngram", None),
        ("draft-model", None),
        ("ngram", "dynamic:top_k=2,depth=4,budget=8"),
        ("draft-model", "static:tree-8"),
        ("draft-model", "best-first:budget=8,depth=4"),
        ("ngram", "sequoia:budget=8,depth=4"),
    ],
)
def test_greedy_speculation_is_identical_to_plain_decoding(dtype, method, tree):
    """Exact mode: identity is guaranteed in any dtype, not observed."""
    target = NativeModel(tiny_hf("llama", dtype=dtype), exact=True)
    draft = NativeModel(tiny_hf("llama", seed=1, dtype=dtype), exact=True)
    llm = LLM(target, draft=draft, speculative=SpeculativeConfig(method="none"))
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    method = "ngram:min_n=1" if method == "ngram" else method
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4, tree=tree)
    for prompt in (PROMPT, [1, 20, 21, 22, 20, 21]):
        plain = llm.generate(prompt, params, speculative=SpeculativeConfig(method="none"))
        out = llm.generate(prompt, params, speculative=spec)
        assert out.token_ids == plain.token_ids


def test_unsupported_architecture_is_a_clear_error():
    tokenizer = make_tokenizer()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(UnsupportedModel, match="architecture 'gpt2' is not implemented"):
        NativeModel(HFModel(gpt2.eval(), tokenizer))


@pytest.mark.real_model
def test_real_model_native_equals_transformers_and_is_invariant():
    from specdec.models.loading import load

    hf = load()
    native = NativeModel(hf, exact=True)
    ids = hf.tokenizer.encode("Explain how tides work in two sentences.")
    ref = hf.forward(ids, hf.new_cache(64))
    cache = native.new_cache(64)
    mine = native.forward(ids, cache)
    torch.testing.assert_close(mine, ref, atol=5e-4, rtol=1e-4)
    # after the prefill: decoding token by token vs a 16-token chain vs a tree path
    start = len(ids) - 16
    cache.truncate(start)
    decoded = [native.forward([t], cache)[0] for t in ids[start:]]
    cache.truncate(start)
    chain = native.forward(ids[start:], cache)
    assert all(torch.equal(chain[i], decoded[i]) for i in range(16))
    cache.truncate(start)
    tree = TokenTree.build([ROOT, ROOT, 1, 2, 2], [7, ids[start + 1], ids[start + 2], 9, 11])
    rows = native.forward_tree(ids[start], tree, cache)
    assert torch.equal(rows[0], decoded[0])
    assert torch.equal(rows[2], decoded[1]) and torch.equal(rows[3], decoded[2])


def test_backend_choice(tmp_path, caplog):
    from specdec.models.loading import load

    hf = tiny_hf("qwen3")
    hf.model.save_pretrained(tmp_path / "qwen3")
    hf.tokenizer.hf.save_pretrained(tmp_path / "qwen3")
    assert load(str(tmp_path / "qwen3"), backend="native").backend == "native"
    assert load(str(tmp_path / "qwen3"), backend="auto").backend == "native"
    assert load(str(tmp_path / "qwen3")).backend == "hf"
    tokenizer = make_tokenizer()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2))
    gpt2.save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="backend native cannot run .*'gpt2'"):
        load(str(tmp_path / "gpt2"), backend="native")
    with caplog.at_level("WARNING"):
        assert load(str(tmp_path / "gpt2"), backend="auto").backend == "hf"
    assert "runs on transformers (backend auto)" in caplog.text
    # dtype auto on that fallback is float32, as for backend hf, whatever the native choice
    with mock.patch("specdec.models.loading.resolve_dtype", return_value="bfloat16"):
        fell_back = load(str(tmp_path / "gpt2"), dtype="auto", backend="auto")
        assert fell_back.backend == "hf" and fell_back.dtype == torch.float32
        assert load(str(tmp_path / "qwen3"), dtype="auto", backend="auto").dtype == torch.bfloat16
    assert load(str(tmp_path / "gpt2"), dtype="bfloat16", backend="auto").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown backend"):
        load(str(tmp_path / "gpt2"), backend="tpu")
    with pytest.raises(ValueError, match="needs the transformers backend"):
        load(str(tmp_path / "gpt2"), dtype="int8-dynamic", backend="native")
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert load(str(tmp_path / "qwen3"), dtype="int8-dynamic", backend="auto").backend == "hf"
    assert "int8-dynamic layers" in caplog.text
    # the backend applies to the draft too, but an int8 draft runs on transformers
    llm = LLM(
        str(tmp_path / "qwen3"),
        draft=str(tmp_path / "qwen3"),
        draft_dtype="int8-dynamic",
        backend="native",
        speculative=SpeculativeConfig(method="draft-model"),
    )
    assert llm.target.backend == "native" and llm._draft.backend == "hf"


def test_cli_refuses_native_int8_before_loading(tmp_path, capsys):
    from specdec.cli import main

    missing = str(tmp_path / "no-model")
    argv = ["generate", "hi", "--model", missing, "--backend", "native", "--dtype", "int8-dynamic"]
    assert main(argv) == 2
    assert "needs the transformers backend" in capsys.readouterr().err


def test_both_backends_implement_the_protocol(pair):
    from specdec.models import Backend, KVCacheLike

    hf, native = pair
    for model in (hf, native):
        assert isinstance(model, Backend)
        assert isinstance(model.new_cache(4), KVCacheLike)
    assert (hf.backend, native.backend) == ("hf", "native")
    # the native model is not a transformers model: it shares only the tokenizer
    assert not isinstance(native, HFModel) and native.tokenizer is hf.tokenizer
    llm = LLM(native, speculative=SpeculativeConfig(method="ngram"))
    assert llm.tokenizer is hf.tokenizer
    out = llm.generate([1, 5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4 and out.text == hf.tokenizer.decode(out.token_ids)


@pytest.mark.parametrize("name", ["linear", "w_xt", "x_wt"])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
def test_exact_product_is_row_major_whatever_the_row_count(name, rows):
    """Downstream kernels (CPU SDPA on 2 threads) give other bits for the same values in
    another memory layout, so the exact product's layout must not depend on how many tiles
    the rows took: ``w_xt`` returned a transposed view for one tile and a row-major
    ``cat`` for several, and a prompt prefilled in a batch differed from it alone."""
    from specdec.runtime.linear import FORMULATIONS, exact_product

    weight = torch.randn(24, 8, dtype=torch.bfloat16)
    x = torch.randn(rows, 8, dtype=torch.bfloat16)
    y = exact_product(x, FORMULATIONS[name].prepare(weight), name, tile=16, min_rows=2)
    assert y.shape == (rows, 24) and y.is_contiguous()


@pytest.mark.parametrize("window", [None, (2, 5), (4, 60), (2, 5, 4), (4, 60, 64)])
@pytest.mark.parametrize("start,t", [(0, 1), (0, 9), (7, 1), (7, 16), (128, 16), (3, 70)])
def test_causal_rows_see_what_the_same_rows_as_a_chain_tree_see(start, t, window):
    """The causal shortcut of ``_visibility`` (no tree mask: row r sees ``start + r + 1``
    slots while inside the window) gives each row what the general path gives the same
    rows written as a chain's tree mask, with and without a StreamingLLM window."""
    from specdec.runtime.model import _visibility

    chain = torch.tril(torch.ones(t, t, dtype=torch.bool))
    fast = _visibility(None, start, t, "cpu", window)
    general = _visibility(chain, start, t, "cpu", window)
    assert len(fast) == len(general) == t
    for a, b in zip(fast, general, strict=True):
        if isinstance(b, int):
            assert a == b
        else:
            assert torch.equal(torch.as_tensor(a), b)
