"""The blocked prompt kernel (``specdec.runtime.kernels.prompt_attention``, AVX512-BF16,
and its AMX variant where the CPU has AMX-BF16): causal attention of a prompt chunk against
a float64 reference (as close as the library's bfloat16 attention), the same bits whatever
the chunking, the threads or the other rows, clear errors; and in the runtime: the prefill
plan chooses it (and its variant) by measurement, the model's prompt chunks run on it, and
greedy speculation still equals plain decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model, make_tokenizer, torch_threads
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.models.base import BatchItem
from specdec.models.hf import HFModel
from specdec.models.native import NativeModel
from specdec.runtime import kernels, prefill
from specdec.runtime.prefill import NEVER, PrefillPlan

pytestmark = pytest.mark.skipif(
    not kernels.prompt_attention_available(),
    reason="the blocked prompt kernel needs AVX512-BF16 (and the compiled kernels)",
)

G, H = 3, 9  # KV heads, query heads (3 per KV head, as SmolLM2)
#: The kernel's variants this CPU runs: pair dot products, and AMX tiles where it has them.
VARIANTS = [False, True] if kernels.amx_available() else [False]


def _inputs(start: int, t: int, d: int, seed: int = 0, layers: int = 2):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, G, start + t + 5, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(t, H, d, generator=gen).to(torch.bfloat16)
    return q, kv


def _reference(q, kv, layer, start, scale, dtype=torch.float64):
    """softmax(scale q K^T) V with row i seeing slots 0 .. start + i, in ``dtype``."""
    t, h, d = q.shape
    n = start + t
    keys = kv[layer, 0, :, :n].to(dtype).repeat_interleave(h // G, 0)
    values = kv[layer, 1, :, :n].to(dtype).repeat_interleave(h // G, 0)
    scores = q.to(dtype).transpose(0, 1) @ keys.transpose(1, 2) * scale
    visible = torch.arange(n)[None, :] <= (start + torch.arange(t))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ values).transpose(0, 1).reshape(t, h * d)


@pytest.mark.parametrize("amx", VARIANTS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(
    "start,t",
    [(0, 1), (0, 3), (0, 64), (0, 150), (5, 1), (37, 53), (64, 64), (300, 250), (3, 700)],
)
def test_prompt_attention_is_as_close_to_the_reference_as_the_library(d, start, t, amx):
    q, kv = _inputs(start, t, d, seed=start + t)
    scale = d**-0.5
    out = kernels.prompt_attention(q, kv, 1, start, scale, amx)
    assert out.shape == (t, H * d) and out.dtype == torch.bfloat16
    exact = _reference(q, kv, 1, start, scale)
    visible = torch.arange(start + t)[None, :] <= (start + torch.arange(t))[:, None]
    library = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kv[1, 0, :, : start + t][None], kv[1, 1, :, : start + t][None],
        attn_mask=visible, scale=scale, enable_gqa=True,
    )[0].transpose(0, 1).reshape(t, H * d)  # fmt: skip
    err = (out.double() - exact).abs().max().item()
    library_err = (library.double() - exact).abs().max().item()
    assert err <= 1.5 * library_err + 1e-3, (err, library_err)
    assert err < 0.03


@pytest.mark.parametrize("amx", VARIANTS)
def test_a_row_gets_the_same_bits_in_any_chunking_and_on_any_threads(amx):
    """A row reads its own query and keys in blocks fixed by its position: the prompt in
    one chunk, in two chunks or one row at a time gives the same bits, on 1, 2 or 3
    threads."""
    q, kv = _inputs(0, 400, 64, seed=3)
    whole = kernels.prompt_attention(q, kv, 0, 0, 0.125, amx)
    parts = [
        kernels.prompt_attention(q[a:b].contiguous(), kv, 0, a, 0.125, amx)
        for a, b in ((0, 130), (130, 131), (131, 400))
    ]
    assert torch.equal(whole, torch.cat(parts))
    for row in (0, 63, 64, 399):
        alone = kernels.prompt_attention(q[row : row + 1].contiguous(), kv, 0, row, 0.125, amx)
        assert torch.equal(alone, whole[row : row + 1])
    for threads in (1, 3):
        with torch_threads(threads):
            assert torch.equal(kernels.prompt_attention(q, kv, 0, 0, 0.125, amx), whole)


@pytest.mark.skipif(not kernels.amx_available(), reason="needs AMX-BF16")
def test_the_amx_variant_computes_other_bits_of_the_same_attention():
    """The variants are two arithmetics (so a plan names the one it chose): close to each
    other, not the same bits everywhere."""
    q, kv = _inputs(0, 300, 64, seed=5)
    pairs = kernels.prompt_attention(q, kv, 0, 0, 0.125)
    tiles = kernels.prompt_attention(q, kv, 0, 0, 0.125, amx=True)
    assert (pairs.float() - tiles.float()).abs().max().item() < 0.02
    assert not torch.equal(pairs, tiles)


@pytest.mark.parametrize("amx", VARIANTS)
def test_what_lies_past_the_chunk_is_never_read(amx):
    """Slots past the chunk's last row (stale or never written: here NaN) change nothing."""
    q, kv = _inputs(20, 70, 64, seed=4)
    out = kernels.prompt_attention(q, kv, 0, 20, 0.125, amx)
    kv[:, :, :, 90:] = float("nan")
    assert torch.equal(kernels.prompt_attention(q, kv, 0, 20, 0.125, amx), out)
    assert not out.isnan().any()


def test_bad_inputs_are_clear_errors():
    q, kv = _inputs(0, 8, 64)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.prompt_attention(q.float(), kv, 0, 0, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.prompt_attention(q, kv.float(), 0, 0, 0.125)
    with pytest.raises(RuntimeError, match="lie in the cache"):
        kernels.prompt_attention(q, kv, 0, kv.shape[3] - 4, 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernels.prompt_attention(q[:, :8].contiguous(), kv, 0, 0, 0.125)
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        kernels.prompt_attention(*_inputs(0, 8, 32), 0, 0, 0.125)
    with pytest.raises(RuntimeError, match="L, 2, G, C, D"):
        kernels.prompt_attention(q, kv, 2, 0, 0.125)


def test_the_plan_times_the_blocked_kernel_and_chooses_it_where_it_wins():
    hf = make_model(make_tokenizer(), seed=0)
    model = NativeModel(HFModel(hf.model.to(torch.bfloat16), hf.tokenizer), exact=True)
    products = [(model.decoder.layers[0]["qkv"].prefill, 32)]
    plan = prefill.measure(products, (H, G, 64), torch.bfloat16, repeats=1, kernel=True)
    a = plan.times_ms["attention"]
    assert len(a["blocked"]) == len(prefill.PREFILL_ROWS) and all(t > 0 for t in a["blocked"])
    library = [
        a["float32"][i] if plan.attention(r) else a["native"][i]
        for i, r in enumerate(prefill.PREFILL_ROWS)
    ]
    others = [min(x, y) for x, y in zip(library, a["kernel"], strict=True)]
    if kernels.amx_available():  # both variants timed, the faster in total chosen
        assert len(a["blocked_amx"]) == len(prefill.PREFILL_ROWS)
        assert plan.blocked_amx == (sum(a["blocked_amx"]) < sum(a["blocked"]))
    else:
        assert "blocked_amx" not in a and not plan.blocked_amx
    chosen = a["blocked_amx"] if plan.blocked_amx else a["blocked"]
    assert plan.blocked_attention_from == prefill.threshold(others, chosen)
    # not a candidate: float32, a head_dim it is not built for, no kernels
    for dtype, d, kernel in ((torch.float32, 64, True), (torch.bfloat16, 8, True),
                             (torch.bfloat16, 64, False)):  # fmt: skip
        times = prefill.measure([], (H, G, d), dtype, 1, kernel=kernel).times_ms
        assert "blocked" not in times["attention"]
    blocked = PrefillPlan(kernel_attention_to=1024, blocked_attention_from=256)
    assert blocked.kernel_attention(255) and not blocked.kernel_attention(256)
    assert blocked.blocked_attention(256) and not blocked.blocked_attention(255)
    assert not NEVER.blocked_attention(1 << 20)


PROMPT = [1, *[(5 * i) % 23 + 3 for i in range(90)]]


def _model_64() -> NativeModel:
    """A random bfloat16 Llama with head_dim 64 (4 heads of 64, 2 KV heads)."""
    hf = make_model(make_tokenizer(), seed=1, hidden_size=256, max_positions=256)
    return NativeModel(HFModel(hf.model.to(torch.bfloat16), hf.tokenizer), exact=True)


@pytest.mark.parametrize("amx", VARIANTS)
def test_prompt_chunks_run_on_the_blocked_kernel_close_to_the_library(monkeypatch, amx):
    """With ``blocked_attention_from``, a causal prompt chunk's attention runs on the
    blocked kernel (no row through the library or the ragged kernel), in the variant the
    plan names, logits close to the library's; a chunk after a cached prefix (chunked
    prefill) too."""
    from specdec.runtime import model as runtime_model

    model = _model_64()
    calls = []
    real = runtime_model.prompt_attention
    monkeypatch.setattr(
        runtime_model,
        "prompt_attention",
        lambda *a: calls.append(a[3]) or variants.add(a[5]) or real(*a),
    )
    variants = set()

    def prompt_logits(plan):
        model.decoder.prefill_plan = plan
        return model.forward(PROMPT, model.new_cache(256))

    library = prompt_logits(NEVER)
    float32 = prompt_logits(PrefillPlan(attention_from=1))  # the attention in float32
    assert not calls
    blocked = prompt_logits(PrefillPlan(blocked_attention_from=1, blocked_amx=amx))
    assert calls == [0, 0] and variants == {amx}  # both layers, from slot 0
    # as close to float32 attention as the library's bfloat16 attention is
    error, library_error = ((x - float32).abs().max().item() for x in (blocked, library))
    assert error <= 1.5 * library_error + 0.05, (error, library_error)
    assert torch.equal(blocked.argmax(-1), float32.argmax(-1))
    calls.clear()
    cache = model.new_cache(256)
    first = model.forward(PROMPT[:40], cache)
    second = model.decoder.forward([BatchItem(PROMPT[40:], cache, prefill=True)])[0]
    assert calls == [0, 0, 40, 40]
    # close (not the same bits: each chunk's products are one product of its own)
    chunked = torch.cat([first, second])
    assert (chunked - blocked).abs().max().item() <= 1.5 * library_error + 0.05


@pytest.mark.parametrize("amx", VARIANTS)
def test_greedy_speculation_equals_plain_decoding_with_blocked_prompts(amx):
    model = _model_64()
    model.decoder.prefill_plan = PrefillPlan(blocked_attention_from=1, blocked_amx=amx)
    llm = LLM(model, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for prompt in (PROMPT, "w5 w6 w7 w5 w6 w7 w5 w6"):
        plain = llm.generate(prompt, params, speculative=SpeculativeConfig(method="none"))
        assert llm.generate(prompt, params).token_ids == plain.token_ids
