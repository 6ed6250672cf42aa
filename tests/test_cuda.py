"""What only a GPU can show: a target on CUDA with its draft on the CPU (overlapped or not),
exact mode's batch invariance on the GPU's own products, ``dtype="auto"`` on CUDA, and the
forward-cost report timing a GPU.

Skipped without CUDA (CI has none). ``benchmarks/gpu_check.sh`` runs this module and the
rest of the suite with ``SPECDEC_TEST_DEVICE=cuda``, which puts the suite's models on the
GPU (``conftest.TEST_DEVICE``)."""

from __future__ import annotations

import pytest
import torch
from drafter_conformance import PROMPTS, hf_greedy

from conftest import make_model, make_tokenizer, perturbed_copy
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.models.hf import HFModel
from specdec.models.native import NativeModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


def _on(model: HFModel, device: str) -> HFModel:
    return HFModel(model.model.to(device), model.tokenizer, name=f"{model.name}-{device}")


@pytest.fixture(scope="module")
def gpu_target() -> HFModel:
    tokenizer = make_tokenizer()
    return _on(make_model(tokenizer, seed=0, name="tiny-target"), "cuda")


@pytest.fixture(scope="module")
def cpu_draft(gpu_target) -> HFModel:
    """The target's weights plus noise, on the CPU: a draft that agrees often."""
    return _on(perturbed_copy(gpu_target, noise=0.01, seed=3), "cpu")


@pytest.mark.parametrize("spec", ["draft-model", "draft-model:overlap=true"])
def test_cpu_draft_for_a_gpu_target_is_lossless(gpu_target, cpu_draft, spec):
    """DuoDecoding's setting (a CPU draft, a GPU target): greedy output is the target's
    own, and the draft is accepted (the check is not vacuous)."""
    config = SpeculativeConfig(method=spec, num_speculative_tokens=4)
    llm = LLM(gpu_target, draft=cpu_draft, speculative=config)
    accepted = 0
    for prompt in PROMPTS:
        out = llm.generate(prompt, GREEDY)
        assert out.token_ids == hf_greedy(gpu_target, prompt, 40)
        accepted += out.metrics.num_accepted_tokens
    assert accepted > 0


def test_draft_device_loads_the_draft_on_the_cpu(tiny_model_dir):
    """``draft_device="cpu"`` (``--draft-device cpu``) beside a CUDA target."""
    llm = LLM(
        tiny_model_dir, draft=tiny_model_dir, device="cuda", draft_device="cpu", backend="hf",
        dtype="float32", speculative=SpeculativeConfig(method="draft-model:overlap=true"),
    )  # fmt: skip
    out = llm.generate(PROMPTS[0], GREEDY)
    assert llm.target.device.type == "cuda" and llm.loaded_draft.device.type == "cpu"
    assert out.token_ids == hf_greedy(llm.target, PROMPTS[0], 40)


def test_cpu_draft_for_a_gpu_target_samples_reproducibly(gpu_target, cpu_draft):
    params = SamplingParams(max_new_tokens=30, temperature=0.8, seed=11, ignore_eos=True)
    config = SpeculativeConfig(method="draft-model:overlap=true", num_speculative_tokens=4)
    runs = [
        LLM(gpu_target, draft=cpu_draft, speculative=config).generate(PROMPTS[1], params)
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_exact_mode_rows_are_batch_invariant_on_the_gpu(dtype):
    """The native runtime's exact mode on cuBLAS: a row's logits are the same bits whether
    it is decoded alone, verified among 8 rows, or run beside another sequence."""
    model = make_model(make_tokenizer(), seed=0)
    model.model.to("cuda", dtype)
    native = NativeModel(model, exact=True)
    prompt, block = PROMPTS[1], [5, 6, 7, 8, 9, 10, 11, 12]
    cache = native.new_cache(64)
    native.forward(prompt, cache, num_logits=1)
    together = native.forward(block, cache)
    cache.truncate(len(prompt))
    alone = torch.cat([native.forward([t], cache) for t in block])
    assert torch.equal(together, alone)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=6)
    plain = LLM(native, speculative=SpeculativeConfig(method="none"))
    batch = LLM(native, speculative=spec).generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, batch, strict=True):
        assert out.token_ids == plain.generate(prompt, GREEDY).token_ids


def test_auto_dtype_on_cuda_is_a_16_bit_float():
    from specdec.models.loading import resolve_dtype

    want = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    assert resolve_dtype("auto", "cuda") == want


def test_forward_cost_times_the_gpu(gpu_target):
    from specdec.bench.forward_cost import forward_times, measure_machine

    machine = measure_machine(dtypes=("bfloat16",), repeats=1, device="cuda")
    assert machine.device == torch.cuda.get_device_name()
    assert machine.bandwidth_gbs > 100 and machine.peak_gflops["bfloat16"] > 1000
    times = forward_times(gpu_target, tokens=(1, 8), repeats=3, context=16)
    assert len(times) == 2 and all(t > 0 for t in times)
