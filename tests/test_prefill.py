"""Prompt chunks in float32 where that is faster (``specdec.runtime.prefill``): the choice
(measured once, kept, forced by the environment), what an upcast chunk computes, and that
exact mode's promises hold with it (chunks alone or in a batch, greedy speculation equal
to plain decoding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model, make_tokenizer
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.models.base import BatchItem
from specdec.models.hf import HFModel
from specdec.models.native import NativeModel
from specdec.runtime import prefill
from specdec.runtime.kernels import kernel_available
from specdec.runtime.prefill import ALWAYS, ENV, NEVER, PrefillPlan, forced_plan, threshold
from specdec.runtime.quant import PREFILL_DENSE_ROWS

ROWS = (64, 256, 1024)


def test_threshold_is_where_float32_wins_from_there_on():
    assert threshold([10, 40, 160], [5, 20, 80], ROWS) == 64
    assert threshold([10, 40, 160], [12, 30, 100], ROWS) == 256
    assert threshold([10, 40, 160], [5, 50, 100], ROWS) == 1024  # must win at every larger
    assert threshold([10, 40, 160], [12, 50, 170], ROWS) is None
    assert threshold([10, 40, 160], [9.8, 39, 156], ROWS) is None  # within the 5% margin
    plan = PrefillPlan(256, None)
    assert not plan.products(255) and plan.products(256) and not plan.attention(4096)
    assert ALWAYS.products(1) and ALWAYS.attention(1) and not NEVER.products(1 << 20)


def test_the_environment_forces_the_plan(monkeypatch):
    for value, plan in (("on", ALWAYS), ("OFF", NEVER), ("auto", None), ("", None)):
        monkeypatch.setenv(ENV, value)
        assert forced_plan() == plan
    monkeypatch.setenv(ENV, "Sometimes")
    with pytest.raises(ValueError, match="SPECDEC_PREFILL_FLOAT32='Sometimes': expected on"):
        forced_plan()
    from specdec.models.loading import check_quantization

    with pytest.raises(ValueError, match="SPECDEC_PREFILL_FLOAT32"):  # before any load
        check_quantization("none", "hf")
    with pytest.raises(ValueError, match="SPECDEC_PREFILL_FLOAT32"):
        _bf16_model()


def _bf16_model(**kw) -> NativeModel:
    hf = make_model(make_tokenizer(), seed=0)
    return NativeModel(HFModel(hf.model.to(torch.bfloat16), hf.tokenizer), exact=True, **kw)


def test_the_plan_is_measured_once_per_machine_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv(ENV, raising=False)
    calls = []

    def fake_measure(products, heads, dtype, repeats=2, quantized=None, kernel=False):
        assert quantized is None  # not a q8 model
        assert kernel == kernel_available(torch.device("cpu"))
        calls.append((len(products), heads, dtype))
        assert [k for _, k in products] == [32, 32, 32, 64]  # qkv, o, gate_up, down inputs
        return PrefillPlan(256, 1024, {"products": {}})

    monkeypatch.setattr(prefill, "measure", fake_measure)
    first = _bf16_model().decoder.prefill_plan
    assert (first.products_from, first.attention_from) == (256, 1024)
    assert _bf16_model().decoder.prefill_plan == first  # read back from the table
    assert calls == [(4, (4, 2, 8), torch.bfloat16)]
    fp32 = NativeModel(make_model(make_tokenizer(), seed=0), exact=True)
    if kernel_available(torch.device("cpu")):  # float32: only the attention kernel to choose
        assert fp32.decoder.prefill_plan == first and calls[1][2] == torch.float32
    else:
        assert fp32.decoder.prefill_plan == NEVER and len(calls) == 1  # nothing to gain


def test_kernel_threshold_is_where_the_kernel_wins_up_to_there():
    assert prefill.kernel_threshold([10, 40, 160], [5, 20, 80], ROWS) == 1024
    assert prefill.kernel_threshold([10, 40, 160], [5, 20, 170], ROWS) == 256
    assert prefill.kernel_threshold([10, 40, 160], [5, 50, 100], ROWS) == 64  # every smaller
    assert prefill.kernel_threshold([10, 40, 160], [12, 20, 80], ROWS) is None
    assert prefill.kernel_threshold([10, 40, 160], [9.8, 39, 156], ROWS) is None  # margin
    plan = PrefillPlan(kernel_attention_to=256)
    assert plan.kernel_attention(1) and plan.kernel_attention(256)
    assert not plan.kernel_attention(257) and not NEVER.kernel_attention(1)
    assert not ALWAYS.kernel_attention(1)  # a forced plan keeps the library's attention


def test_measure_times_both_arithmetics_at_each_size():
    model = _bf16_model(quantization="none")
    layer = model.decoder.layers[0]
    products = [(layer[n].prefill, k) for n, k in (("qkv", 32), ("down", 64))]
    plan = prefill.measure(products, (4, 2, 8), torch.bfloat16, repeats=1)
    for part in ("products", "attention"):
        for arithmetic in ("native", "float32"):
            times = plan.times_ms[part][arithmetic]
            assert len(times) == len(prefill.PREFILL_ROWS) and all(t > 0 for t in times)
    assert plan.products_from in (None, *prefill.PREFILL_ROWS)


@pytest.mark.parametrize("quantization", ["none", "q8_0", "q4_1"])
def test_an_upcast_chunk_is_one_float32_product_rounded_once(quantization, monkeypatch):
    monkeypatch.setenv(ENV, "off")
    model = _bf16_model(quantization=quantization)
    torch.manual_seed(0)
    for name, k in (("qkv", 32), ("down", 64)):
        linear = model.decoder.layers[0][name]
        x = torch.randn(PREFILL_DENSE_ROWS + 3, k).bfloat16()
        if quantization == "none":
            weight = linear.weight.float()
        else:
            weight = linear.dense(torch.float32)
            # the float32 weights are the quantized ones, unrounded: their bfloat16
            # rounding is the dense matrix the 16-bit prefill multiplies
            assert torch.equal(weight.bfloat16(), linear.dense(torch.bfloat16))
        want = F.linear(x.float(), weight).bfloat16()
        assert torch.equal(linear.prefill(x, upcast=True), want)
        native = linear.prefill(x)
        assert native.dtype == torch.bfloat16
        torch.testing.assert_close(native.float(), want.float(), atol=0.1, rtol=0.02)


def _forward_prompt(model: NativeModel, plan: PrefillPlan, prompt) -> torch.Tensor:
    model.decoder.prefill_plan = plan
    cache = model.new_cache(128)
    return model.forward(prompt, cache)


PROMPT = [1, *[(5 * i) % 23 + 3 for i in range(60)]]


def test_upcast_prompt_logits_are_close_to_the_16_bit_ones():
    model = _bf16_model()
    native = _forward_prompt(model, NEVER, PROMPT)
    upcast = _forward_prompt(model, ALWAYS, PROMPT)
    assert upcast.dtype == native.dtype == torch.float32
    assert not torch.equal(native, upcast)  # the arithmetic did change
    torch.testing.assert_close(upcast, native, atol=0.15, rtol=0.05)
    model.decoder.exact = False  # fast mode: one product for the rows
    fast = _forward_prompt(model, ALWAYS, PROMPT)
    torch.testing.assert_close(fast, upcast, atol=0.15, rtol=0.05)


@pytest.mark.parametrize("plan", [NEVER, ALWAYS, PrefillPlan(32, 40)], ids=str)
def test_upcast_chunks_in_a_batch_equal_alone(plan):
    """The bits of a prompt chunk (and of the rows after it) do not depend on what else is
    in the batch, with every chunk upcast, none, or some (by size)."""
    model = _bf16_model()
    model.decoder.prefill_plan = plan

    def items():
        caches = [model.new_cache(128) for _ in range(3)]
        model.decoder.forward([BatchItem(PROMPT[:40], caches[1], prefill=True)])
        model.decoder.forward([BatchItem(PROMPT[:8], caches[2])])
        return [
            BatchItem(PROMPT[:50], caches[0], num_logits=1),
            BatchItem(PROMPT[40:60], caches[1], prefill=True),
            BatchItem([3, 4, 5], caches[2]),
        ]

    batch, alone = items(), items()
    together = model.decoder.forward_full(batch)
    for item, mixed, single in zip(batch, together, alone, strict=True):
        (own,) = model.decoder.forward_full([single])
        assert torch.equal(mixed.logits, own.logits)
        n = item.cache.num_tokens
        assert torch.equal(item.cache.kv[:, :, :, :n], single.cache.kv[:, :, :, :n])


@pytest.mark.parametrize("quantization", ["none", "q4_1"])
def test_greedy_speculation_equals_plain_decoding_with_upcast_prompts(quantization):
    model = _bf16_model(quantization=quantization)
    model.decoder.prefill_plan = ALWAYS
    llm = LLM(model, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for prompt in ([1, *[(3 * i) % 11 + 3 for i in range(40)]], "w5 w6 w7 w5 w6 w7 w5 w6"):
        plain = llm.generate(prompt, params, speculative=SpeculativeConfig(method="none"))
        assert llm.generate(prompt, params).token_ids == plain.token_ids


def test_the_quantized_kernel_computes_prompts_up_to_the_largest_size_where_it_wins():
    """``measure`` with a quantized model's products: the kernel computes chunks up to the
    largest size at which, and at every smaller one, it beats the chosen dense arithmetic
    by the 5% margin; winning at the largest size means every chunk."""
    import time

    def dense(x, upcast):
        time.sleep(0.003 if x.shape[0] < 512 else 0.001)

    def timed(small, large):
        return [lambda x: time.sleep(small if x.shape[0] < 512 else large)]

    for dtype in (torch.float32, torch.bfloat16):
        plan = prefill.measure([(dense, 8)], (2, 1, 4), dtype, 1, quantized=timed(0.0, 0.0))
        assert plan.quantized_to == prefill.PREFILL_ROWS[-1]
        assert plan.quantized(prefill.PREFILL_ROWS[-1] * 4)  # every chunk
        assert set(plan.times_ms["products"]) == (
            {"native", "float32", "quantized"} if dtype == torch.bfloat16 else
            {"native", "quantized"}
        )  # fmt: skip
        assert plan.products_from is None or dtype == torch.bfloat16
        if dtype == torch.float32:  # the dense product wins from 512 rows on
            up_to = prefill.measure([(dense, 8)], (2, 1, 4), dtype, 1, quantized=timed(0.0, 0.006))
            assert up_to.quantized_to == 256
            assert up_to.quantized(256) and up_to.quantized(20) and not up_to.quantized(257)
        slower = prefill.measure([(dense, 8)], (2, 1, 4), dtype, 1, quantized=timed(0.006, 0.006))
        assert slower.quantized_to is None and not slower.quantized(64)
    assert prefill.measure([(dense, 8)], (2, 1, 4), torch.float32, 1).quantized_to is None


def _q8_model(monkeypatch) -> NativeModel:
    monkeypatch.setenv("SPECDEC_QUANT_KERNEL", "q8")
    model = _bf16_model(quantization="q4_1")
    assert model.decoder.layers[0]["qkv"].kernel == "q8"
    model.decoder.prefill_plan = PrefillPlan(quantized_to=prefill.PREFILL_ROWS[-1])
    return model


def test_q8_prompt_chunks_on_the_kernel_are_its_product_alone_or_in_a_batch(monkeypatch):
    """With the plan's ``quantized_to``, a prompt chunk's products are the q8 kernel's
    (8-bit activations), not the dense product; a chunk gets the same bits alone or next
    to other sequences; greedy speculation still equals plain decoding."""
    model = _q8_model(monkeypatch)
    linear = model.decoder.layers[0]["gate_up"]
    x = torch.randn(PREFILL_DENSE_ROWS + 5, 32).bfloat16()
    assert torch.equal(linear.prefill(x, quantized=True), linear(x))
    assert not torch.equal(linear.prefill(x), linear(x))  # the dense product differs
    on = _forward_prompt(model, PrefillPlan(quantized_to=prefill.PREFILL_ROWS[-1]), PROMPT)
    off = _forward_prompt(model, NEVER, PROMPT)
    assert not torch.equal(on, off)
    torch.testing.assert_close(on, off, atol=0.3, rtol=0.1)
    model.decoder.prefill_plan = PrefillPlan(quantized_to=prefill.PREFILL_ROWS[-1])
    _assert_alone_equals_batched(model, PROMPT[:50])
    _assert_speculation_equals_plain(model)


def _assert_alone_equals_batched(model: NativeModel, prompt: list[int]) -> None:
    """A prompt chunk's logits alone equal its logits beside another sequence's rows."""
    caches = [model.new_cache(128) for _ in range(2)]
    model.decoder.forward([BatchItem(PROMPT[:8], caches[1])])
    batch = [BatchItem(prompt, caches[0], num_logits=1), BatchItem([3, 4, 5], caches[1])]
    together = model.decoder.forward_full(batch)
    (alone,) = model.decoder.forward_full([BatchItem(prompt, model.new_cache(128), num_logits=1)])
    assert torch.equal(together[0].logits, alone.logits)


def _assert_speculation_equals_plain(model: NativeModel) -> None:
    llm = LLM(model, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompt = [1, *[(3 * i) % 11 + 3 for i in range(40)]]
    plain = llm.generate(prompt, params, speculative=SpeculativeConfig(method="none"))
    assert llm.generate(prompt, params).token_ids == plain.token_ids


needs_kernels = pytest.mark.skipif(
    not kernel_available(torch.device("cpu")), reason="the compiled kernels are not available"
)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_measure_times_the_attention_kernel_against_the_chosen_arithmetic(dtype):
    hf = make_model(make_tokenizer(), seed=0)
    model = NativeModel(HFModel(hf.model.to(dtype), hf.tokenizer), exact=True)
    products = [(model.decoder.layers[0]["qkv"].prefill, 32)]
    plan = prefill.measure(products, (4, 2, 64), dtype, repeats=1, kernel=True)
    times = plan.times_ms["attention"]
    assert len(times["kernel"]) == len(prefill.PREFILL_ROWS) and all(t > 0 for t in times["kernel"])
    library = [
        times["float32"][i] if plan.attention(r) else times["native"][i]
        for i, r in enumerate(prefill.PREFILL_ROWS)
    ]
    assert plan.kernel_attention_to == prefill.kernel_threshold(library, times["kernel"])
    assert "kernel" not in prefill.measure(products, (4, 2, 64), dtype, 1).times_ms["attention"]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prompt_attention_on_the_kernel_is_close_and_the_same_alone_or_in_a_batch(
    dtype, monkeypatch
):
    """With ``kernel_attention_to``, a prompt chunk's attention runs on the runtime's kernel
    (not ``scaled_dot_product_attention``): logits close to the library's, the same bits
    alone or next to other sequences (exact mode), and greedy speculation still equals
    plain decoding."""
    from specdec.runtime import model as runtime_model

    hf = make_model(make_tokenizer(), seed=0)
    model = NativeModel(HFModel(hf.model.to(dtype), hf.tokenizer), exact=True)
    on_kernel = PrefillPlan(kernel_attention_to=1 << 20)
    library = _forward_prompt(model, NEVER, PROMPT)
    calls = []
    real = runtime_model.attention_fast
    monkeypatch.setattr(runtime_model, "attention_fast", lambda *a: calls.append(1) or real(*a))
    kernel = _forward_prompt(model, on_kernel, PROMPT)
    assert not calls  # no prompt row went through the library
    _forward_prompt(model, NEVER, PROMPT)
    assert calls
    tolerance = (
        {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.15, "rtol": 0.05}
    )
    torch.testing.assert_close(kernel, library, **tolerance)
    model.decoder.prefill_plan = on_kernel
    for exact in (True, False):
        caches = [model.new_cache(128) for _ in range(2)]
        model.decoder.forward([BatchItem(PROMPT[:8], caches[1])], exact)
        batch = [BatchItem(PROMPT[:50], caches[0], num_logits=1), BatchItem([3, 4, 5], caches[1])]
        together = model.decoder.forward_full(batch, exact)
        (alone,) = model.decoder.forward_full(
            [BatchItem(PROMPT[:50], model.new_cache(128), num_logits=1)], exact
        )
        if exact:
            assert torch.equal(together[0].logits, alone.logits)
        else:
            torch.testing.assert_close(together[0].logits, alone.logits, **tolerance)
    llm = LLM(model, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for prompt in ([1, *[(3 * i) % 11 + 3 for i in range(40)]], "w5 w6 w7 w5 w6 w7 w5 w6"):
        plain = llm.generate(prompt, params, speculative=SpeculativeConfig(method="none"))
        assert llm.generate(prompt, params).token_ids == plain.token_ids


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_short_prompt_chunks_of_a_quantized_model_run_on_its_kernel(dtype):
    """Measured choice for every quantized kernel (not only q8): a chunk up to the plan's
    ``quantized_to`` rows computes its products on the kernel of decoding rows, a longer
    one as the dense product; either way a chunk gets the same bits alone or beside other
    sequences, and greedy speculation equals plain decoding."""
    hf = make_model(make_tokenizer(), seed=0)
    model = NativeModel(HFModel(hf.model.to(dtype), hf.tokenizer), exact=True,
                        quantization="q4_1")  # fmt: skip
    linear = model.decoder.layers[0]["gate_up"]
    assert linear.kernel != "q8"
    plan = PrefillPlan(quantized_to=64)
    assert plan.quantized(64) and not plan.quantized(65)
    on = _forward_prompt(model, plan, PROMPT[:40])  # on the kernel
    off = _forward_prompt(model, NEVER, PROMPT[:40])  # dense
    assert not torch.equal(on, off)  # the kernel reads the weights unrounded
    torch.testing.assert_close(on, off, atol=0.3, rtol=0.1)
    long = [1, *[(7 * i) % 29 + 3 for i in range(90)]]  # 91 rows: dense either way
    assert torch.equal(_forward_prompt(model, plan, long), _forward_prompt(model, NEVER, long))
    model.decoder.prefill_plan = plan
    for prompt in (PROMPT[:40], long):  # on the kernel, dense
        _assert_alone_equals_batched(model, prompt)
    _assert_speculation_equals_plain(model)
