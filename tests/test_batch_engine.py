"""Batched engine oracles: every request of a mixed batch (prompt lengths, drafters, k,
trees, greedy and seeded sampling, staggered arrivals, chunked prefill, tight token and
KV budgets with preemption, aborts) gets exactly the output of single-sequence
generation; KV and drafter state are released; bad requests are clear errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specdec import SamplingParams
from specdec.drafters.base import NoDrafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine, EngineConfig, SequenceStatus, StopChecker, generate_steps
from specdec.models.native import NativeModel
from specdec.sampling import make_generator
from specdec.trees.builders import make_tree_builder


@dataclass
class Request:
    prompt: list[int]
    drafter: str  # none | ngram | draft
    k: int = 0
    tree: str | None = None
    temperature: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 20
    arrive_at: int = 0  # engine step at which the request is added


def _prompt(seed: int, length: int) -> list[int]:
    """A repetitive prompt (n-gram drafts get accepted) of ``length`` tokens."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, 32, (5,), generator=g).tolist()
    return [1, *(motif * length)[: length - 1]]


REQUESTS = [
    Request(_prompt(0, 12), "ngram", k=4),
    Request(_prompt(1, 3), "none", arrive_at=1),
    Request(_prompt(2, 25), "draft", k=3, arrive_at=1),
    Request(_prompt(3, 7), "ngram", k=6, temperature=0.8, seed=11, arrive_at=2),
    Request(_prompt(4, 18), "draft", k=2, temperature=1.0, seed=5, arrive_at=3),
    Request(_prompt(5, 9), "ngram", tree="static:tree-8", arrive_at=3),
    Request(_prompt(6, 14), "draft", tree="dynamic:top_k=2,depth=3,budget=6", arrive_at=5),
    Request(_prompt(7, 1), "ngram", k=3, max_new_tokens=9, arrive_at=6),
    Request(_prompt(8, 30), "draft", k=4, temperature=0.7, seed=3, arrive_at=8),
]


def _drafter(kind: str, draft_model, target):
    if kind == "none":
        return NoDrafter()
    if kind == "ngram":
        return NgramDrafter()
    return DraftModelDrafter(draft_model, target.vocab_size, len(target.tokenizer))


def _args(req: Request, target, draft_model):
    params = SamplingParams(
        max_new_tokens=req.max_new_tokens, temperature=req.temperature, seed=req.seed,
        ignore_eos=True,
    )  # fmt: skip
    return dict(
        params=params,
        drafter=_drafter(req.drafter, draft_model, target),
        num_speculative_tokens=req.k,
        tree_builder=make_tree_builder(req.tree) if req.tree else None,
        stop_checker=StopChecker(()),
        generator=make_generator(req.seed if req.seed is not None else 0),
    )


def _alone(target, draft_model, req: Request, config: EngineConfig) -> list[int]:
    a = _args(req, target, draft_model)
    steps = generate_steps(
        target, a["drafter"], req.prompt, a["params"], a["num_speculative_tokens"],
        a["stop_checker"], a["generator"], a["tree_builder"], config,
    )  # fmt: skip
    return [t for step in steps for t in step.new_token_ids]


def _batched(target, draft_model, requests, config: EngineConfig, abort=None):
    """Run ``requests`` through one engine with staggered arrivals; ``abort``: (request
    index, step) pairs."""
    engine = Engine(target, config)
    sequences, step, aborts = {}, 0, dict(abort or {})
    while len(sequences) < len(requests) or engine.has_unfinished():
        for i, req in enumerate(requests):
            if req.arrive_at == step and i not in sequences:
                sequences[i] = engine.add_request(
                    str(i), req.prompt, **_args(req, target, draft_model)
                )
        for i, at in aborts.items():
            if at == step:
                assert engine.abort(str(i))
        engine.step()
        step += 1
        assert step < 500
    assert engine.num_kv_tokens_used == 0 and not engine.running and not engine.waiting
    return engine, {i: s for i, s in sequences.items()}


@pytest.fixture(scope="module")
def native(target):
    return NativeModel(target, exact=True)


CONFIGS = {
    "default": EngineConfig(),
    "tight": EngineConfig(max_num_seqs=3, max_num_batched_tokens=24, prefill_chunk=8),
    "preempt": EngineConfig(max_num_batched_tokens=32, max_kv_tokens=112, prefill_chunk=16),
}


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("backend", ["native", "hf"])
def test_batch_equals_single_sequence_generation(request, target, near_draft, backend, config):
    model = request.getfixturevalue("native") if backend == "native" else target
    cfg = CONFIGS[config]
    engine, sequences = _batched(model, near_draft, REQUESTS, cfg)
    for i, req in enumerate(REQUESTS):
        seq = sequences[i]
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "length"
        assert seq.output_ids == _alone(model, near_draft, req, cfg), i
        assert len(seq.output_ids) == req.max_new_tokens
    if config == "preempt":
        assert engine.num_preemptions > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_batch_equals_plain_decoding_in_exact_mode(target, dtype):
    """Exact mode: greedy speculative output in a batch equals plain decoding token for
    token, in float32 and bfloat16."""
    from test_runtime import tiny_hf

    model = NativeModel(tiny_hf("llama", dtype=dtype), exact=True)
    requests = [Request(_prompt(i, 6 + 5 * i), "ngram", k=2 + i, arrive_at=i) for i in range(5)]
    _, sequences = _batched(model, None, requests, CONFIGS["tight"])
    for i, req in enumerate(requests):
        plain = Request(req.prompt, "none", max_new_tokens=req.max_new_tokens)
        assert sequences[i].output_ids == _alone(model, None, plain, CONFIGS["tight"]), i


class CountingDrafter(NgramDrafter):
    """An n-gram drafter whose sequences count ``close`` calls."""

    def __init__(self):
        super().__init__()
        self.started = self.closed = 0

    def start(self, prompt_ids, params):
        self.started += 1
        outer = self

        class State:
            def propose(self, token_ids, num_tokens, generator):
                return NgramDrafter.propose(outer, token_ids, num_tokens, generator)

            def close(self):
                outer.closed += 1

        return State()


def test_aborts_free_everything_and_leave_others_unchanged(native, near_draft):
    cfg = CONFIGS["tight"]
    engine, sequences = _batched(native, near_draft, REQUESTS, cfg, abort={2: 3, 5: 6})
    for i in (2, 5):
        assert sequences[i].status is SequenceStatus.ABORTED
        assert sequences[i].finish_reason == "abort" and sequences[i].cache is None
    for i, req in enumerate(REQUESTS):
        if i not in (2, 5):
            assert sequences[i].output_ids == _alone(native, near_draft, req, cfg), i
    assert not engine.abort("2")  # no longer live

    drafter = CountingDrafter()
    engine = Engine(native, cfg)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for i in range(4):
        engine.add_request(
            str(i), _prompt(i, 10), params, drafter=drafter, num_speculative_tokens=3
        )
    engine.step()
    engine.step()
    engine.abort("1")
    engine.abort("3")  # may still be waiting
    while engine.has_unfinished():
        engine.step()
    assert drafter.started == drafter.closed and engine.num_kv_tokens_used == 0


def test_a_prefilled_prompt_gets_its_first_token_before_more_prompts_run(native):
    """The step after a prompt's prefill verifies its pending token without prompt chunks
    of later arrivals (they would delay its first token by their whole prefill); the next
    step prefills them; outputs are unchanged."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine = Engine(native, EngineConfig())
    engine.add_request("a", _prompt(0, 20), params)
    assert engine.step() == []  # a's prompt
    engine.add_request("b", _prompt(1, 30), params)
    b = engine.waiting[0]
    (out,) = engine.step()  # a's first token, b still waits
    assert out[0].request_id == "a" and len(out[1].new_token_ids) == 1
    assert b.num_prefilled == 0
    (out,) = engine.step()  # a's second token beside b's prompt
    assert out[0].request_id == "a" and b.num_prefilled == len(b.prompt_ids) - 1
    (first, second) = engine.step()  # b's first token, and a goes on
    assert {first[0].request_id, second[0].request_id} == {"a", "b"}
    while engine.has_unfinished():
        engine.step()
    for seq in (out[0], b):
        alone = Engine(native, EngineConfig())
        alone.add_request("x", seq.prompt_ids, params)
        steps = []
        while alone.has_unfinished():
            steps += alone.step()
        assert seq.output_ids == [t for _, step in steps for t in step.new_token_ids]


def test_preempted_request_is_recomputed_and_counted(native):
    cfg = EngineConfig(max_num_batched_tokens=16, max_kv_tokens=64, prefill_chunk=8)
    reqs = [Request(_prompt(i, 12), "ngram", k=3, max_new_tokens=24) for i in range(3)]
    engine, sequences = _batched(native, None, reqs, cfg)
    assert engine.num_preemptions > 0
    assert any(s.num_preemptions for s in sequences.values())
    for i, req in enumerate(reqs):
        assert sequences[i].output_ids == _alone(native, None, req, cfg)


def test_prompt_tokens_are_counted_as_their_chunks_run(native):
    """``num_prompt_tokens_computed`` (the server's load line): each prefill chunk's tokens
    when it runs, not the whole prompt when it arrives."""
    engine = Engine(native, EngineConfig(max_num_batched_tokens=8, prefill_chunk=8))
    engine.add_request("a", _prompt(0, 21), SamplingParams(max_new_tokens=2))
    assert engine.num_prompt_tokens_computed == 0
    counts = []
    while engine.has_unfinished():
        engine.step()
        counts.append(engine.num_prompt_tokens_computed)
    # the prompt but its pending last token, 8 at a time
    assert counts[:3] == [8, 16, 20] and counts[-1] == 20


def test_bad_requests_and_configs_are_clear_errors(native):
    engine = Engine(native, EngineConfig(max_kv_tokens=64))
    params = SamplingParams(max_new_tokens=4)
    engine.add_request("a", [1, 2, 3], params)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("a", [1, 2], params)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("b", [], params)
    with pytest.raises(ValueError, match="holds at most"):
        engine.add_request("b", [1] * native.max_context, params)
    with pytest.raises(ValueError, match="max_kv_tokens"):
        engine.add_request("b", [1] * 63, params)
    with pytest.raises(ValueError, match="cannot draft token trees"):
        engine.add_request("b", [1, 2], params, tree_builder=make_tree_builder("static:tree-8"))
    with pytest.raises(ValueError, match=">= 0"):
        engine.add_request("b", [1, 2], params, num_speculative_tokens=-1)
    for bad in (dict(max_num_seqs=0), dict(max_kv_tokens=True), dict(prefill_chunk=8000)):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    # a request's length is capped so that it always fits the KV limit alone
    seq = engine.add_request(
        "c", [1, 2, 3], SamplingParams(max_new_tokens=10**6), num_speculative_tokens=5
    )
    assert seq.max_total <= 64 - 6


# ---------------------------------------------------------------- the LLM API


def test_llm_generate_batch_equals_one_by_one(target, near_draft):
    from specdec import LLM, SpeculativeConfig

    llm = LLM(NativeModel(target), draft=near_draft, speculative=SpeculativeConfig("draft-model"))
    prompts = [_prompt(i, 5 + 7 * i) for i in range(4)]
    params = [
        SamplingParams(max_new_tokens=12, ignore_eos=True),
        SamplingParams(max_new_tokens=20, temperature=0.9, seed=4, ignore_eos=True),
        SamplingParams(max_new_tokens=16, stop=[llm.tokenizer.decode(prompts[2][3:5])]),
        SamplingParams(max_new_tokens=8, ignore_eos=True),
    ]
    batch = llm.generate(prompts, params)
    assert isinstance(batch, list) and len(batch) == 4
    for prompt, p, out in zip(prompts, params, batch, strict=True):
        alone = llm.generate(prompt, p)
        assert (out.token_ids, out.text, out.finish_reason) == (
            alone.token_ids, alone.text, alone.finish_reason,
        )  # fmt: skip
        assert out.prompt_token_ids == prompt
    # one SamplingParams for every prompt
    same = llm.generate(prompts[:2], params[0])
    assert [o.token_ids for o in same] == [
        llm.generate(p, params[0]).token_ids for p in prompts[:2]
    ]
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match=r"^prompt 1 of the batch: prompt token ids outside"):
        llm.generate([prompts[0], [10**6]])  # which prompt of a batch is refused
    with pytest.raises(ValueError, match="2 sampling parameters for 3 prompts"):
        llm.generate(prompts[:3], params[:2])
    with pytest.raises(ValueError, match="needs a list of prompts"):
        llm.generate(prompts[0], params)
    # per-prompt speculative settings: each prompt as it runs alone with its own settings
    configs = [
        SpeculativeConfig("none"),
        SpeculativeConfig("ngram", num_speculative_tokens=3),
        SpeculativeConfig("draft-model", num_speculative_tokens=2, tree="static:tree-8"),
        None,  # the LLM's default
    ]
    mixed = llm.generate(prompts, params, speculative=configs)
    for prompt, p, config, out in zip(prompts, params, configs, mixed, strict=True):
        alone = llm.generate(prompt, p, speculative=config)
        assert out.token_ids == alone.token_ids
    assert mixed[0].metrics.num_draft_tokens == 0 and mixed[2].metrics.num_draft_tokens > 0
    with pytest.raises(ValueError, match="1 speculative settings for 4 prompts"):
        llm.generate(prompts, params, speculative=configs[:1])


def test_llm_is_safe_from_several_threads(target, near_draft):
    from concurrent.futures import ThreadPoolExecutor

    from specdec import LLM, SpeculativeConfig

    llm = LLM(target, draft=near_draft, speculative=SpeculativeConfig("draft-model"))
    jobs = [
        (_prompt(i, 6 + i), SamplingParams(max_new_tokens=14, seed=i, temperature=0.5 * (i % 2)))
        for i in range(6)
    ]
    expected = [llm.generate(p, s).token_ids for p, s in jobs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda job: llm.generate(*job).token_ids, jobs))
        streamed = list(
            pool.map(lambda job: [t for c in llm.stream(*job) for t in c.token_ids], jobs)
        )
    assert got == expected and streamed == expected


def test_transformers_forward_batch_is_one_forward_per_sequence(target):
    """The ragged batch is part of the backend protocol: transformers runs it as a loop, so
    each item's logits are what its own forward gives (causal and tree items alike)."""
    from specdec.models.base import BatchItem
    from specdec.trees import ROOT, TokenTree

    prompts = [_prompt(1, 9), _prompt(2, 5)]
    tree = TokenTree.build([ROOT, ROOT, 0], [5, 6, 7])
    caches, alone = [], []
    for prompt in prompts:
        cache = target.new_cache(32)
        target.forward(prompt, cache)
        caches.append(cache)
        solo = target.new_cache(32)
        target.forward(prompt, solo)
        alone.append(solo)
    positions = caches[1].num_tokens + tree.position_offsets()
    items = [
        BatchItem([3, 4, 5], caches[0], num_logits=2),
        BatchItem([8, *tree.token_ids], caches[1], positions, tree.attention_mask()),
    ]
    out = target.forward_batch(items)
    torch.testing.assert_close(out[0], target.forward([3, 4, 5], alone[0], num_logits=2))
    torch.testing.assert_close(out[1], target.forward_tree(8, tree, alone[1]))
    assert [c.num_tokens for c in caches] == [c.num_tokens for c in alone]
