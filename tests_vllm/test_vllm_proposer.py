"""specdec's drafters inside a real vLLM (``make test-vllm``; vLLM's CPU build in its own
virtual environment, with specdec installed in it).

vLLM runs the embedded SmolLM2-135M with :class:`specdec.integrations.vllm.SuffixProposer`
through its ``custom_class`` hook. Greedy outputs must equal vLLM's own plain decoding and
specdec's. The check runs in float32: in bfloat16 vLLM's CPU kernels give a verification
forward over several tokens slightly different logits from a one-token step, so vLLM's
*own* speculative decoding (n-gram included) already differs from its plain decoding on
some prompts (``benchmarks/vllm_proposer_cpu`` measures it); float32 leaves no such gap.
"""

from __future__ import annotations

import gc
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

vllm = pytest.importorskip("vllm")

from specdec import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from specdec.models.loading import cached_gguf_conversion, embedded_gguf_path  # noqa: E402

K = 8
MAX_TOKENS = 48
PROMPTS = [
    "Rewrite this code with the variable x renamed to total:\n\ndef f(items):\n    x = 0\n"
    "    for item in items:\n        x = x + item\n    return x\n",
    "List the days of the week, one per line, then list them again in reverse order.",
    "Repeat the sentence 'the quick brown fox jumps over the lazy dog' three times.",
    "What is the capital of France? Answer in one sentence.",
]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(cached_gguf_conversion(embedded_gguf_path("smollm2-135m-instruct")))


@pytest.fixture(scope="module")
def prompt_ids(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                add_generation_prompt=True)
        for p in PROMPTS
    ]  # fmt: skip
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def run_vllm(model_dir, prompt_ids, speculative_config=None):
    """Greedy outputs and vLLM's speculative-decoding counters."""
    from vllm.inputs import TokensPrompt

    llm = vllm.LLM(
        model=model_dir, dtype="float32", max_model_len=2048, seed=0, enforce_eager=True,
        enable_prefix_caching=False, disable_log_stats=False,
        speculative_config=speculative_config,
    )  # fmt: skip
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = []
    for ids in prompt_ids:  # one at a time, as a chat user would
        result = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        outs.append(list(result[0].outputs[0].token_ids))
    metrics = llm.get_metrics()
    counters = {m.name: m.value for m in metrics if "spec_decode" in m.name and hasattr(m, "value")}
    del llm
    gc.collect()
    return outs, counters


@pytest.fixture(scope="module")
def plain(model_dir, prompt_ids):
    return run_vllm(model_dir, prompt_ids)[0]


def test_specdec_suffix_inside_vllm_is_lossless_and_accepts(model_dir, prompt_ids, plain):
    spec = {
        "method": "custom_class",
        "model": "specdec.integrations.vllm.SuffixProposer",
        "num_speculative_tokens": K,
    }
    outs, counters = run_vllm(model_dir, prompt_ids, spec)
    assert outs == plain  # vLLM's own plain decoding, token for token
    assert counters["vllm:spec_decode_num_draft_tokens"] > 0
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0
    # and specdec's plain decoding of the same prompts (native runtime, exact, float32)
    ours = LLM(model_dir, dtype="float32", speculative=SpeculativeConfig(method="none"))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    assert [ours.generate(ids, params).token_ids for ids in prompt_ids] == plain


def test_a_drafter_needing_logits_is_refused_at_engine_start(model_dir, monkeypatch):
    monkeypatch.setenv("SPECDEC_VLLM_DRAFTER", "recycling")
    spec = {
        "method": "custom_class",
        "model": "specdec.integrations.vllm.SpecdecProposer",
        "num_speculative_tokens": K,
    }
    with pytest.raises(Exception, match="needs the target's logits"):
        vllm.LLM(model=model_dir, dtype="float32", max_model_len=2048, enforce_eager=True,
                 speculative_config=spec)  # fmt: skip
