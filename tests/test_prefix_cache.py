"""Automatic prefix caching: a hit changes no bit (outputs, logprobs, prompt logprobs,
seeded samples, speculation, preemption), blocks are found only under the same tokens
from position 0, eviction keeps no unreachable block, and what cannot share is refused
or runs cold."""

from __future__ import annotations

import pytest
import torch
from test_runtime import tiny_hf

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.base import NoDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine, EngineConfig, PrefixCache, StopChecker
from specdec.engine.engine import PREFIX_CACHE_CHUNK
from specdec.models.native import NativeModel
from specdec.runtime.cache import NativeKVCache
from specdec.sampling import make_generator

CHUNK = 8
SHARED = [1, *(5 + 7 * i % 26 for i in range(20))]  # 21 tokens: two full chunks of 8
PROMPTS = [
    SHARED + [30, 31, 29, 28],
    SHARED + [27, 26],
    SHARED[:17] + [10, 11, 12, 13, 14, 15, 16, 17, 18, 19],  # shares two blocks exactly
    SHARED[:9],  # one full block before the pending token
    [2, *SHARED[1:], 6, 7, 8],  # differs at position 0: shares nothing
]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request):
    return NativeModel(tiny_hf("llama", dtype=request.param), exact=True)


def _config(cache: bool, **kwargs) -> EngineConfig:
    return EngineConfig(prefill_chunk=CHUNK, enable_prefix_caching=cache, **kwargs)


def _run(model, prompts, config, *, drafter=None, k=0, params=None, prefix_cache=None):
    """Each prompt in turn through its own engine (one shared prefix cache): the finished
    sequences."""
    cache = prefix_cache
    if config.enable_prefix_caching and cache is None:
        cache = PrefixCache(config.prefill_chunk, config.prefix_cache_bytes)
    finished = []
    for i, prompt in enumerate(prompts):
        engine = Engine(model, config, prefix_cache=cache)
        p = params or SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3)
        seq = engine.add_request(
            str(i), prompt, p, drafter=drafter or NoDrafter(), num_speculative_tokens=k,
            stop_checker=StopChecker(()), generator=make_generator(p.seed or 0),
        )  # fmt: skip
        while engine.has_unfinished():
            engine.step()
        finished.append(seq)
    return finished, cache


def _same(a, b) -> None:
    assert a.output_ids == b.output_ids
    assert [(x.token_id, x.logprob, x.top) for x in a.logprobs] == [
        (y.token_id, y.logprob, y.top) for y in b.logprobs
    ]


@pytest.mark.parametrize(
    "drafter,k,temperature",
    [("none", 0, 0.0), ("ngram", 4, 0.0), ("ngram", 3, 0.9)],
    ids=["plain", "ngram-greedy", "ngram-sampled"],
)
def test_hits_change_no_bit(model, drafter, k, temperature):
    params = SamplingParams(
        max_new_tokens=12, ignore_eos=True, logprobs=3, temperature=temperature, seed=7
    )
    draft = NgramDrafter() if drafter == "ngram" else None
    cold, _ = _run(model, PROMPTS, _config(False), drafter=draft, k=k, params=params)
    warm, cache = _run(model, PROMPTS, _config(True), drafter=draft, k=k, params=params)
    for a, b in zip(cold, warm, strict=True):
        _same(a, b)
    assert [s.stats.num_cached_tokens for s in warm] == [0, 16, 16, 8, 0]
    assert cache.num_hit_tokens == 40
    assert cache.num_queried_tokens == sum(len(p) for p in PROMPTS)


def test_the_same_prompt_again_hits_every_full_block_and_only_those(model):
    prompt = SHARED + [30, 31, 29]  # 24 tokens: chunks [0, 8), [8, 16) full, [16, 23) not
    runs, cache = _run(model, [prompt, prompt, prompt + [28]], _config(True))
    assert [s.stats.num_cached_tokens for s in runs] == [0, 16, 16]
    assert len(cache) == 3  # the third prompt's chunk [16, 24) is full
    runs, cache = _run(model, [prompt + [28, 27], prompt + [28, 27]], _config(True))
    assert [s.stats.num_cached_tokens for s in runs] == [0, 24]  # 26 tokens: 3 full chunks


def test_a_prompt_wholly_cached_starts_verifying_at_once(model):
    prompt = SHARED[:17]  # 16 cached tokens + the pending one
    cold, _ = _run(model, [prompt], _config(False))
    warm, _ = _run(model, [prompt, prompt], _config(True))
    assert warm[1].stats.num_cached_tokens == 16
    _same(cold[0], warm[1])


def test_a_tiny_budget_evicts_and_changes_nothing(model):
    one_block = NativeKVCache(2, 2, 16, CHUNK, torch.float32, "cpu").bytes_per_token * CHUNK
    cold, _ = _run(model, PROMPTS, _config(False))
    for budget in (0, one_block, 3 * one_block):
        warm, cache = _run(model, PROMPTS, _config(True, prefix_cache_bytes=budget))
        for a, b in zip(cold, warm, strict=True):
            _same(a, b)
        assert cache.num_bytes <= budget


def test_prompt_logprobs_requests_run_cold_and_match(model):
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, prompt_logprobs=2)
    cold, _ = _run(model, PROMPTS[:2], _config(False), params=params)
    warm, cache = _run(model, PROMPTS[:2], _config(True), params=params)
    assert [s.stats.num_cached_tokens for s in warm] == [0, 0]
    assert len(cache) == 3  # they still fill it
    for a, b in zip(cold, warm, strict=True):
        assert a.output_ids == b.output_ids
        assert [(x.token_id, x.logprob) for x in a.prompt_logprobs[1:]] == [
            (y.token_id, y.logprob) for y in b.prompt_logprobs[1:]
        ]


class _HeadLike(NgramDrafter):
    """An n-gram drafter that says it reads the target's last hidden state, as a draft
    head does (the engine then hands it the prompt's hidden states), and keeps them."""

    def __init__(self, layer: int):
        super().__init__()
        self.captures = (layer,)
        self.prompt_states: list[list[tuple[int, torch.Tensor]]] = []

    def start(self, prompt_ids, params):
        state = super().start(prompt_ids, params)
        seen = []
        self.prompt_states.append(seen)
        state.observe_prefill = lambda start, hidden: seen.append((start, hidden.clone()))
        state.observe = lambda feedback: None
        return state


def test_draft_heads_get_the_prompts_hidden_states_from_the_cache(model):
    """A request that reads hidden states shares only blocks that hold those of its
    layers, and then gets them bit for bit as a cold prefill computes them."""
    layer = model.num_layers - 1
    cold_head, warm_head = _HeadLike(layer), _HeadLike(layer)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    cold, _ = _run(model, prompts, _config(False), drafter=cold_head, k=2)
    cache = PrefixCache(CHUNK, 1 << 20)
    _run(model, [PROMPTS[0]], _config(True), prefix_cache=cache)  # KV only, no states
    warm, _ = _run(model, prompts, _config(True), drafter=warm_head, k=2, prefix_cache=cache)
    assert [s.stats.num_cached_tokens for s in warm] == [0, 16, 16]
    for a, b in zip(cold, warm, strict=True):
        _same(a, b)
    for seen_cold, seen_warm in zip(cold_head.prompt_states, warm_head.prompt_states, strict=True):
        assert [start for start, _ in seen_warm] == [start for start, _ in seen_cold]
        assert torch.equal(
            torch.cat([h for _, h in seen_cold]), torch.cat([h for _, h in seen_warm])
        )


def test_hidden_states_under_invariant_prefill_are_cut_to_their_blocks(model):
    """Chunks of 10 rows, blocks of 4: each block keeps its own rows of the chunk's
    hidden states, and a later request gets them bit for bit."""
    layer = model.num_layers - 1
    cold_head, warm_head = _HeadLike(layer), _HeadLike(layer)
    prompts = [PROMPTS[0], PROMPTS[1]]
    cold, _ = _run(model, prompts, _invariant(False, 10), drafter=cold_head, k=2)
    cache = PrefixCache(4, 1 << 20)
    warm, _ = _run(model, prompts, _invariant(True, 10), drafter=warm_head, k=2, prefix_cache=cache)
    assert warm[1].stats.num_cached_tokens == 20  # PROMPTS[1] shares 21 tokens: 5 blocks
    for a, b in zip(cold, warm, strict=True):
        _same(a, b)
    for seen_cold, seen_warm in zip(cold_head.prompt_states, warm_head.prompt_states, strict=True):
        assert torch.equal(
            torch.cat([h for _, h in seen_cold]), torch.cat([h for _, h in seen_warm])
        )


def test_an_eagle_head_drafts_the_same_with_the_cache(tmp_path):
    """A trained EAGLE head's drafts read the prompt's hidden states: with the cache its
    outputs, logprobs and accepted drafts are those of the cold run."""
    from test_heads import tiny_head

    from specdec.heads.format import save_head

    model = NativeModel(tiny_hf("llama"), exact=True)
    head, _, _ = tiny_head(model, "eagle", steps=40)
    spec = SpeculativeConfig(method=f"eagle:head={save_head(head, tmp_path / 'eagle')}")
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=1)
    runs = {}
    for caching in (False, True):
        llm = LLM(model, speculative=spec, engine_config=_config(caching))
        runs[caching] = [llm.generate(p, params) for p in PROMPTS[:3]]
    for a, b in zip(runs[False], runs[True], strict=True):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]
        assert (a.metrics.num_draft_tokens, a.metrics.num_accepted_tokens) == (
            b.metrics.num_draft_tokens, b.metrics.num_accepted_tokens,
        )  # fmt: skip
    assert [o.metrics.num_cached_tokens for o in runs[True]] == [0, 16, 16]


def test_blocks_are_keyed_by_every_token_before_them():
    cache = PrefixCache(2, 1 << 20)
    kv = {}

    def reader(prompt):
        def read(start, end):
            kv[(tuple(prompt[:end]))] = torch.full((1, 2, 1, 2, 1), float(end))
            return kv[tuple(prompt[:end])]

        return read

    a, b = [1, 2, 3, 4, 5], [9, 2, 3, 4, 5]  # same second block, other first block
    cache.insert(a, 4, reader(a))
    assert [kv[0, 0, 0, 0, 0].item() for kv, _ in cache.lookup(a)] == [2.0, 4.0]
    assert cache.lookup(b) == []
    assert len(cache.lookup([1, 2, 3, 9, 9])) == 1
    assert cache.lookup([1, 2, 3]) != [] and cache.lookup([1, 2]) == []  # pending token
    cache.insert(b, 4, reader(b))
    assert len(cache) == 4
    cache.insert(a, 2, lambda *_: pytest.fail("block 0 is cached already"))


def test_eviction_takes_least_recent_leaves_and_never_strands_a_block():
    block = torch.zeros(1, 2, 1, 2, 1)  # 16 bytes
    cache = PrefixCache(2, 3 * 16)
    a, b = [1, 2, 3, 4, 5, 6, 7], [7, 8, 9]
    cache.insert(a, 6, lambda s, e: block.clone())  # 3 blocks: full
    cache.insert(b, 2, lambda s, e: block.clone())  # 4th: the oldest leaf goes
    assert cache.num_bytes == 48 and len(cache) == 3
    assert len(cache.lookup(a)) == 2 and len(cache.lookup(b)) == 1
    cache.max_bytes = 16
    cache._evict()
    # b's block was used last: a's chain goes, its second block before its first
    assert len(cache) == 1 and cache.lookup(a) == [] and len(cache.lookup(b)) == 1
    for block_id in list(cache._blocks):  # every block left is reachable from the root
        parent = cache._blocks[block_id].parent
        assert parent == -1 or parent in cache._blocks
    cache.clear()
    assert len(cache) == 0 and cache.num_bytes == 0


def test_bad_settings_are_clear_errors(model):
    hf = tiny_hf("llama")
    with pytest.raises(ValueError, match="native backend"):
        Engine(hf, EngineConfig(enable_prefix_caching=True))
    with pytest.raises(ValueError, match="native backend"):
        LLM(hf, engine_config=EngineConfig(enable_prefix_caching=True))
    with pytest.raises(ValueError, match="one prefill chunk"):
        Engine(model, _config(True), prefix_cache=PrefixCache(16, 1 << 20))
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        EngineConfig(enable_prefix_caching=True, prefix_cache_bytes=-1)
    for fast in (hf, NativeModel(tiny_hf("llama"), exact=False)):
        with pytest.raises(ValueError, match="invariant_prefill needs the native backend"):
            Engine(fast, EngineConfig(invariant_prefill=True))
        with pytest.raises(ValueError, match="invariant_prefill needs the native backend"):
            LLM(fast, engine_config=EngineConfig(invariant_prefill=True))
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(enable_prefix_caching="yes")
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(0, 10)
    assert EngineConfig(enable_prefix_caching=True).prefill_chunk == PREFIX_CACHE_CHUNK
    assert EngineConfig(enable_prefix_caching=True, max_num_batched_tokens=100).prefill_chunk == 100
    assert EngineConfig().prefill_chunk == 2048
    cache = model.new_cache(16)
    with pytest.raises(ValueError, match="does not fit"):
        cache.append_slots(torch.zeros(1, 2, 1, 4, 1))
    with pytest.raises(ValueError, match="outside"):
        cache.read_slots(0, 1)


def test_llm_generations_share_the_cache_and_report_it(model):
    prompts = [PROMPTS[0], PROMPTS[1]]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    plain = LLM(model, speculative=spec, engine_config=_config(False))
    cached = LLM(model, speculative=spec, engine_config=_config(True))
    want = [plain.generate(p, params).token_ids for p in prompts]
    first = cached.generate(prompts[0], params)
    streamed = list(cached.stream(prompts[1], params))[-1].output
    assert [first.token_ids, streamed.token_ids] == want
    assert (first.metrics.num_cached_tokens, streamed.metrics.num_cached_tokens) == (0, 16)
    batch = cached.generate(prompts, params)
    assert [o.token_ids for o in batch] == want
    assert [o.metrics.num_cached_tokens for o in batch] == [24, 16]  # 25 tokens: 3 blocks
    assert cached.prefix_cache().num_hit_tokens == 56


def test_a_chunk_layout_changes_bits_which_is_why_a_block_is_one_chunk(model):
    """The negative control of this file's oracle: prompts prefilled in chunks of 16
    instead of 8 give other logprobs, so a block reused under another chunk layout
    would show in the comparisons above."""
    eight, _ = _run(model, PROMPTS[:3], EngineConfig(prefill_chunk=8))
    sixteen, _ = _run(model, PROMPTS[:3], EngineConfig(prefill_chunk=16))
    pairs = [
        (a, b)
        for x, y in zip(eight, sixteen, strict=True)
        for a, b in zip(x.logprobs, y.logprobs, strict=True)
    ]
    assert any(a.logprob != b.logprob for a, b in pairs)


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_reports_cached_tokens_and_counts_hits(stream):
    """``--enable-prefix-caching`` on the server: the second request with the same
    beginning reports ``prompt_tokens_details.cached_tokens``, its text equals a server
    without the cache, and /metrics counts queried and hit tokens under vLLM's names."""

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from conftest import make_server_llm, sse_events, uvicorn_thread
    from specdec.server import create_app

    prompt = " ".join(f"w{1 + 5 * i % 27}" for i in range(30))
    texts, cached = {}, []
    for caching in (False, True):
        llm = make_server_llm()
        llm.engine_config = EngineConfig(
            max_num_seqs=16, max_num_batched_tokens=256, prefill_chunk=8,
            enable_prefix_caching=caching,
        )  # fmt: skip
        app = create_app(llm, "tiny")
        with uvicorn_thread(app, log_level="error") as (url, _):
            for n in range(2):
                body = {"model": "tiny", "prompt": prompt + f" w{n + 2}", "max_tokens": 8,
                        "temperature": 0, "stream": stream,
                        "stream_options": {"include_usage": True} if stream else None}  # fmt: skip
                response = httpx.post(f"{url}/v1/completions", json=body)
                assert response.status_code == 200, response.text
                if stream:
                    chunks = sse_events(response.text)
                    usage = chunks[-1]["usage"]
                    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
                else:
                    usage, text = response.json()["usage"], response.json()["choices"][0]["text"]
                texts.setdefault(n, []).append(text)
                if caching:
                    cached.append(usage["prompt_tokens_details"]["cached_tokens"])
                else:
                    assert "prompt_tokens_details" not in usage
            metrics = httpx.get(f"{url}/metrics").text
            reset = httpx.post(f"{url}/reset_prefix_cache")
            if caching:
                assert reset.status_code == 200 and len(llm.prefix_cache()) == 0
            else:
                assert reset.status_code == 400
                assert "--enable-prefix-caching" in reset.json()["error"]["message"]
        families = {f.name: f for f in text_string_to_metric_families(metrics)}
        if caching:
            hits = families["vllm:prefix_cache_hits"].samples[0]
            queries = families["vllm:prefix_cache_queries"].samples[0]
            assert hits.labels["model_name"] == "tiny"
            assert hits.value == sum(cached) and queries.value > hits.value
    assert all(a == b for a, b in texts.values())
    assert cached[0] == 0 and cached[1] > 0 and cached[1] % 8 == 0


def test_serve_options_reach_the_engine():
    import argparse

    from specdec.server.options import add_serve_arguments, check_serve_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    _, config = check_serve_args(
        parser.parse_args(["--enable-prefix-caching", "--prefix-cache-gib", "0.5"])
    )
    assert config.enable_prefix_caching and config.prefix_cache_bytes == 1 << 29
    assert config.prefill_chunk == PREFIX_CACHE_CHUNK
    _, config = check_serve_args(parser.parse_args([]))
    assert not config.enable_prefix_caching and config.prefill_chunk == 2048
    with pytest.raises(ValueError, match="needs the native backend"):
        check_serve_args(parser.parse_args(["--enable-prefix-caching", "--backend", "hf"]))
    for bad, match in (
        (["--enable-prefix-caching", "--prefix-cache-gib", "-1"], "must be a number > 0"),
        (["--enable-prefix-caching", "--prefix-cache-gib", "0"], "must be a number > 0"),
        (["--prefix-cache-gib", "2"], "add --enable-prefix-caching"),
        (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
    ):
        with pytest.raises(ValueError, match=match):
            check_serve_args(parser.parse_args(bad))
    _, config = check_serve_args(
        parser.parse_args(["--enable-prefix-caching", "--prefill-chunk", "64"])
    )
    assert config.prefill_chunk == 64 and config.prefix_cache_bytes == 1 << 30
    _, config = check_serve_args(
        parser.parse_args(["--enable-prefix-caching", "--invariant-prefill"])
    )
    assert config.invariant_prefill and config.prefill_chunk == 2048
    for bad, match in (
        (["--invariant-prefill", "--backend", "hf"], "--invariant-prefill needs the native"),
        (["--invariant-prefill", "--no-exact"], "drop --no-exact"),
    ):
        with pytest.raises(ValueError, match=match):
            check_serve_args(parser.parse_args(bad))


def test_the_stats_line_gives_the_intervals_hit_rate():
    from specdec.server.metrics import StatsLog

    now, lines = [0.0], []
    log = StatsLog(10, write=lines.append, clock=lambda: now[0])
    log.add(prompt=100)
    now[0] = 10
    assert log.tick(1, 0, 0.1, (100, 0)).endswith("prefix cache hit rate 0.0%")
    log.add(prompt=100)
    now[0] = 20
    assert log.tick(1, 0, 0.1, (300, 150)).endswith("prefix cache hit rate 75.0%")
    log.add(prompt=100)
    now[0] = 30
    assert "prefix" not in log.tick(1, 0, 0.1)


def test_a_budget_below_one_block_is_logged(model, caplog):
    with caplog.at_level("WARNING"):
        Engine(model, _config(True, prefix_cache_bytes=100))
    assert "holds no block" in caplog.text


def test_a_conversation_reuses_each_earlier_turns_prompt(model):
    """Turn n + 1's prompt is turn n's prompt, its answer and a new message: it shares the
    full chunks of turn n's prompt (computed as prompt chunks), not the answer's KV
    (computed while decoding), and every turn equals its cold run."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1)
    cache = PrefixCache(CHUNK, 1 << 20)
    prompt, turns = SHARED[:12], []
    for turn in range(3):
        (warm,), _ = _run(model, [prompt], _config(True), params=params, prefix_cache=cache)
        (cold,), _ = _run(model, [prompt], _config(False), params=params)
        _same(cold, warm)
        turns.append((len(prompt), warm.stats.num_cached_tokens))
        prompt = prompt + warm.output_ids + [7 + turn, 8 + turn, 9 + turn]
    lengths = [n for n, _ in turns]
    assert [c for _, c in turns] == [0] + [(n - 1) // CHUNK * CHUNK for n in lengths[:-1]]


def test_reset_prefix_cache(model):
    llm = LLM(model, engine_config=_config(True))
    params = SamplingParams(max_new_tokens=2)
    llm.generate(PROMPTS[0], params)
    assert llm.generate(PROMPTS[0], params).metrics.num_cached_tokens == 24
    assert llm.reset_prefix_cache() and len(llm.prefix_cache()) == 0
    assert llm.generate(PROMPTS[0], params).metrics.num_cached_tokens == 0
    assert not LLM(model, engine_config=_config(False)).reset_prefix_cache()
    llm = LLM(model, engine_config=_invariant(True))  # blocks of 16, kept across calls
    llm.generate(PROMPTS[0], params)
    assert llm.generate(PROMPTS[0], params).metrics.num_cached_tokens == 16
    assert llm.prefix_cache() is llm.prefix_cache()


# ---------------------------------------------------------------- invariant prefill


def _invariant(cache: bool, chunk: int = CHUNK, **kwargs) -> EngineConfig:
    return EngineConfig(
        prefill_chunk=chunk, enable_prefix_caching=cache, invariant_prefill=True, **kwargs
    )


@pytest.mark.parametrize("drafter,k,tree", [("none", 0, None), ("ngram", 3, None),
                                            ("ngram", 0, "static:tree-8")])  # fmt: skip
def test_invariant_prefill_makes_a_tokens_kv_the_same_whoever_computed_it(model, drafter, k, tree):
    """With ``invariant_prefill`` the KV a generation leaves (prompt chunks, verified
    chains or tree paths) is bit for bit the KV of prefilling the same tokens in any
    chunks, and the outputs do not depend on the chunk size."""
    from specdec.models.base import BatchItem
    from specdec.trees.builders import make_tree_builder

    outputs = {}
    for chunk in (3, 8, 64):
        engine = Engine(model, _invariant(False, chunk))
        seq = engine.add_request(
            "a", PROMPTS[0], SamplingParams(max_new_tokens=14, ignore_eos=True, logprobs=2),
            drafter=NgramDrafter() if drafter == "ngram" else NoDrafter(),
            num_speculative_tokens=k, tree_builder=make_tree_builder(tree) if tree else None,
        )  # fmt: skip
        kept = {}
        original = engine._release

        def keep(s, original=original, kept=kept):
            if s.cache is not None:
                kept["kv"] = s.cache.read_slots(0, s.cache.num_tokens)
            original(s)

        engine._release = keep
        while engine.has_unfinished():
            engine.step()
        outputs[chunk] = (seq.output_ids, [x.logprob for x in seq.logprobs])
        n = kept["kv"].shape[3]
        fresh = model.new_cache(n + 8)
        for start in range(0, n, 5):  # chunks of 5, computed as decoding rows
            ids = seq.tokens[start : min(start + 5, n)]
            model.forward_batch([BatchItem(ids, fresh, num_logits=1, prefill=False)])
        assert torch.equal(fresh.read_slots(0, n), kept["kv"]), chunk
    assert outputs[3] == outputs[8] == outputs[64]


def test_invariant_prefill_shares_blocks_of_answers_and_small_prefixes(model):
    """A conversation's next turn reuses the previous turn's prompt *and* answer in blocks
    of 16 tokens, and every turn equals its cold run."""
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=1)
    cache = PrefixCache(16, 1 << 20)
    prompt, turns, expected = SHARED[:12], [], [0]
    for turn in range(3):
        (warm,), _ = _run(model, [prompt], _invariant(True), params=params, prefix_cache=cache)
        (cold,), _ = _run(model, [prompt], _invariant(False), params=params)
        _same(cold, warm)
        turns.append(warm.stats.num_cached_tokens)
        history = prompt + warm.output_ids  # the KV of all but the last token is cached
        expected.append((len(history) - 1) // 16 * 16)
        prompt = history + [7 + turn, 8 + turn]
    assert turns == expected[:3] and turns[1] > 12  # turn 2 reused part of turn 1's answer


@pytest.mark.parametrize("invariant", [False, True], ids=["chunks", "invariant"])
def test_batched_with_preemption_and_hits_equals_cold(model, invariant):
    """A tight KV budget preempts; with invariant prefill a preempted sequence is
    readmitted from its own blocks. Every output equals the cold batch's."""
    make = _invariant if invariant else _config
    limits = dict(max_num_batched_tokens=24, max_kv_tokens=96)
    cache = PrefixCache(4 if invariant else CHUNK, 1 << 20)
    if not invariant:
        _run(model, [PROMPTS[0]], make(True, **limits), prefix_cache=cache)  # warm it
    engine = Engine(model, make(True, **limits), prefix_cache=cache)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=2)
    seqs = [
        engine.add_request(str(i), p, params, drafter=NgramDrafter(), num_speculative_tokens=3)
        for i, p in enumerate(PROMPTS)
    ]
    while engine.has_unfinished():
        engine.step()
    assert engine.num_preemptions > 0
    cold, _ = _run(
        model, PROMPTS, make(False, **limits), drafter=NgramDrafter(), k=3, params=params
    )
    for a, b in zip(cold, seqs, strict=True):
        _same(a, b)
    assert cache.num_hit_tokens > 0


def test_llm_chat_is_generate_on_conversations():
    """vLLM's ``LLM.chat``: one conversation or a batch, as ``generate`` gives them."""
    from conftest import SERVER_CHAT_TEMPLATE

    llm = LLM(NativeModel(tiny_hf("llama"), exact=True))
    llm.tokenizer.hf.chat_template = SERVER_CHAT_TEMPLATE
    params = SamplingParams(max_new_tokens=5)
    talk = [{"role": "user", "content": "w1 w2 w3"}]
    other = [*talk, {"role": "assistant", "content": "w4"}, {"role": "user", "content": "w5"}]
    assert llm.chat(talk, params).token_ids == llm.generate(talk, params).token_ids
    both = llm.chat([talk, other], params)
    assert [o.token_ids for o in both] == [llm.generate(c, params).token_ids for c in (talk, other)]
    for bad in ([], [[]], ["w1"], [talk, "w1"]):
        with pytest.raises(ValueError, match="conversation"):
            llm.chat(bad, params)
