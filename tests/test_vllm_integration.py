"""specdec.integrations.vllm without vLLM: the proposer against a simulated persistent
batch (rows that continue, finish, are condensed into holes, prefill in chunks), checked
against specdec's own per-request drafting. ``make test-vllm`` runs it inside vLLM."""

from __future__ import annotations

import random
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from specdec.drafters.options import SuffixOptions
from specdec.drafters.suffix import SuffixDrafter
from specdec.integrations import vllm as integ

MAX_LEN = 256
K = 5


def vllm_config(k=K, max_len=MAX_LEN, **spec_fields):
    return NS(
        speculative_config=NS(num_speculative_tokens=k, **spec_fields),
        model_config=NS(max_model_len=max_len, model="tiny", tokenizer="tiny",
                        get_vocab_size=lambda: 64),
    )  # fmt: skip


class Batch:
    """vLLM's persistent batch as the hook sees it: rows of token ids, condensed when a
    request leaves (the last row moves into the hole)."""

    def __init__(self, rows=8):
        self.tokens = np.zeros((rows, MAX_LEN), dtype=np.int32)
        self.requests: list[dict] = []  # row i -> {"id", "ids", "sampled"}

    def add(self, rid, prompt):
        self.requests.append({"id": rid, "ids": list(prompt), "sampled": []})

    def remove(self, rid):
        i = next(i for i, r in enumerate(self.requests) if r["id"] == rid)
        last = self.requests.pop()
        if i < len(self.requests):
            self.requests[i] = last

    def arrays(self):
        n = np.zeros(len(self.tokens), dtype=np.int32)
        for i, r in enumerate(self.requests):
            self.tokens[i, : len(r["ids"])] = r["ids"]
            n[i] = len(r["ids"])
        return [list(r["sampled"]) for r in self.requests], n, self.tokens


def reference_drafts(reference, request, options):
    """What specdec's own drafter proposes for this request's history."""
    if request["id"] not in reference:
        prompt = request["ids"][: len(request["ids"]) - len(request["sampled"])]
        reference[request["id"]] = SuffixDrafter(options).start(prompt, integ.RowStates(
            None, 1, 1).params)  # fmt: skip
    seq = reference[request["id"]]
    return seq.propose(request["ids"], K, torch.Generator()).token_ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_drafts_follow_each_request_through_moves_and_new_requests(seed, monkeypatch):
    monkeypatch.setenv(integ.DRAFTER_ENV, "suffix:global_cache=false,min_token_prob=0")
    proposer = integ.SpecdecProposer(vllm_config())
    options = SuffixOptions(global_cache=False, min_token_prob=0.0)
    rng = random.Random(seed)
    batch, reference, next_id = Batch(), {}, 0
    drafted = 0
    for _step in range(60):
        while len(batch.requests) < 6 and rng.random() < 0.5:  # arrivals
            motif = [rng.randrange(3, 12) for _ in range(rng.randrange(2, 5))]
            batch.add(next_id, (motif * 6)[: rng.randrange(4, 20)])
            next_id += 1
        for r in batch.requests:  # each request samples 1-3 tokens (accepted + bonus)
            if rng.random() < 0.15:
                r["sampled"] = []  # a prompt chunk: nothing sampled this step
                continue
            r["sampled"] = [rng.randrange(3, 12) for _ in range(rng.randrange(1, 4))]
            r["ids"] += r["sampled"]
        sampled, n, tokens = batch.arrays()
        drafts = proposer.propose(sampled, n, tokens)
        assert len(drafts) == len(batch.requests)
        for r, draft in zip(batch.requests, drafts, strict=True):
            if not r["sampled"]:
                assert draft == []
                continue
            assert draft == reference_drafts(reference, r, options), (r["id"], _step)
            drafted += len(draft)
        for r in list(batch.requests):  # departures, condensing the batch
            if len(r["ids"]) > 60 or rng.random() < 0.05:
                batch.remove(r["id"])
    assert drafted > 100
    # one state per request that sampled: none restarted, though rows moved
    assert proposer.states.num_started == len(reference)


def test_a_finished_request_feeds_the_cross_request_cache():
    proposer = integ.SuffixProposer(vllm_config())
    batch = Batch()
    answer = [20, 21, 22, 23, 24, 25, 26, 27]
    batch.add(0, [5, 6, 7])
    for t in answer:  # one token per step, nothing to draft from its own history
        batch.requests[0]["sampled"] = [t]
        batch.requests[0]["ids"].append(t)
        proposer.propose(*batch.arrays())
    batch.remove(0)
    assert proposer.states.num_closed == 0
    batch.add(1, [9, 20, 21, 22])  # a new request in the same row
    batch.requests[0]["sampled"] = [23]
    batch.requests[0]["ids"].append(23)
    (draft,) = proposer.propose(*batch.arrays())
    assert proposer.states.num_closed == 1  # the first request's output went to the cache
    assert draft == answer[4:]  # what followed 20 21 22 23 in the finished output


def test_drafts_stop_at_max_model_len():
    proposer = integ.NgramProposer(vllm_config(max_len=12))
    batch = Batch()
    batch.add(0, [1, 2, 3, 1, 2, 3, 1, 2, 3, 1])
    batch.requests[0]["sampled"] = [1]
    assert proposer.propose(*batch.arrays()) == [[2]]  # 10 tokens, room for 1 more draft


def test_vllm_suffix_fields_set_options_and_the_environment_overrides(monkeypatch):
    config = vllm_config(
        suffix_decoding_max_tree_depth=32, suffix_decoding_max_cached_requests=10000,
        suffix_decoding_max_spec_factor=2.0, suffix_decoding_min_token_prob=0.2,
    )  # fmt: skip
    opts = integ.SuffixProposer(config).options
    assert (opts.max_depth, opts.max_cached_requests) == (32, 10000)
    assert (opts.max_spec_factor, opts.min_token_prob) == (2.0, 0.2)
    monkeypatch.setenv(integ.DRAFTER_ENV, "suffix:max_depth=8")
    assert integ.SuffixProposer(config).options.max_depth == 8
    monkeypatch.setenv(integ.DRAFTER_ENV, "ngram:max_n=3")
    assert integ.SuffixProposer(config).name == "ngram"


@pytest.mark.parametrize(
    "spec, need",
    [
        ("recycling", "the target's logits"),
        ("draft-model", "a draft model"),
        ("lookahead", "extra rows"),
        ("eagle", "the target's hidden states"),
        ("medusa", "the target's hidden states"),
        ("parallel", "the target's hidden states"),
        ("layer-skip", "the target's own layers"),
        ("sparse-kv", "the target's own layers"),
        ("quantized", "the target's own layers"),
        ("hybrid", "a model drafter beside its suffix draft"),
    ],
)
def test_drafters_needing_more_than_token_ids_are_refused(monkeypatch, spec, need):
    monkeypatch.setenv(integ.DRAFTER_ENV, spec)
    with pytest.raises(ValueError, match=f"^SPECDEC_VLLM_DRAFTER='{spec}': .*needs {need}.*hook"):
        integ.SpecdecProposer(vllm_config())


def test_bad_configurations_are_refused(monkeypatch):
    monkeypatch.delenv(integ.DRAFTER_ENV, raising=False)
    with pytest.raises(ValueError, match="SPECDEC_VLLM_DRAFTER.*not set"):
        integ.SpecdecProposer(vllm_config())
    monkeypatch.setenv(integ.DRAFTER_ENV, "nope")
    with pytest.raises(ValueError, match="unknown drafter 'nope'") as info:
        integ.SpecdecProposer(vllm_config())
    usable = str(info.value).split("inside vLLM: ")[1].split(", ")
    assert "suffix" in usable and "ngram" in usable
    assert not {"eagle", "draft-model", "layer-skip", "hybrid", "none"} & set(usable)
    monkeypatch.setenv(integ.DRAFTER_ENV, "suffix:depth=3")
    with pytest.raises(ValueError, match="no option 'depth'"):
        integ.SpecdecProposer(vllm_config())
    monkeypatch.setenv(integ.DRAFTER_ENV, "none")
    with pytest.raises(ValueError, match="proposes nothing: leave speculative_config out"):
        integ.SpecdecProposer(vllm_config())
    monkeypatch.setenv(integ.DRAFTER_ENV, "retrieval")
    with pytest.raises(ValueError, match=r"retrieval needs a datastore: retrieval:datastore=PATH"):
        integ.RetrievalProposer(vllm_config())
    monkeypatch.delenv(integ.DRAFTER_ENV)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        integ.NgramProposer(vllm_config(k=0))
