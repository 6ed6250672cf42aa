"""The drafter conformance suite: the oracles every drafter must pass.

A drafter's test module subclasses :class:`DrafterConformance` and sets ``spec`` (its
``SpeculativeConfig.method`` string), optionally ``trees`` and ``draft_fixture``, and
overrides ``wrap_target`` when the drafter needs another backend than the tests' targets
(transformers models):

    class TestSuffixConformance(DrafterConformance):
        spec = "suffix"

Oracles (see the architecture guide): greedy equivalence with plain decoding in float32
(chains and every tree builder), bit identity in bf16 on the native backend's exact mode,
a batch equal to one-by-one generation, the statistical check of sampled output against
the exact target distribution, budgets and stops, repeated requests (drafters with
cross-request state), preemption (drafter state dropped and rebuilt), declared
capabilities, and that the drafter really drafts (equivalence is not vacuous).
"""

from __future__ import annotations

import pytest
import torch
from test_statistical import PARAMS, chi_square_pvalue, empirical_joint, exact_joint

from conftest import make_model, make_tokenizer
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.base import check_drafter
from specdec.engine import EngineConfig
from specdec.models.hf import HFModel
from specdec.models.native import NativeModel
from specdec.registry import needs_draft_model, parse_spec

#: Repetitive prompts (copying drafters get accepted) and a plain one.
PROMPTS = [
    [1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [1, 20, 21, 22, 23, 24, 20, 21, 22, 9, 10, 20, 21],
    [1, 9],
]
TREES = (
    "dynamic:top_k=2,depth=4,budget=8",
    "static:tree-8",
    "sequoia:budget=8,depth=4",
    "dynamic:top_k=2,depth=4,budget=8,adaptive=true",
)


def hf_greedy(model: HFModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Independent oracle: transformers' own greedy generate (no EOS stop)."""
    ids = torch.tensor([prompt], device=model.model.device)
    out = model.model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


class DrafterConformance:
    """Subclass with ``spec = "NAME[:options]"``; see the module docstring."""

    spec: str = ""
    #: tree specs to check (when the drafter supports trees)
    trees: tuple[str, ...] = TREES
    #: fixture giving a draft model (drafters that need one)
    draft_fixture: str | None = None
    #: k values checked for chains
    ks: tuple[int, ...] = (1, 3, 8)

    # ---------------------------------------------------------------- helpers
    @property
    def name(self) -> str:
        return parse_spec(self.spec)[0]

    def wrap_target(self, target):
        """The backend the drafter runs on, built from a test's target (identity here).

        A drafter that needs another backend (layer-skip: the native one) overrides it,
        caching the result per target object. Oracles stay on the original: transformers'
        ``generate`` (:func:`hf_greedy`) and the exact joint law of the sampling test.
        """
        return target

    def llm(self, request, target, k: int = 4, tree: str | None = None) -> LLM:
        draft = request.getfixturevalue(self.draft_fixture) if self.draft_fixture else None
        config = SpeculativeConfig(method=self.spec, num_speculative_tokens=k, tree=tree)
        return LLM(self.wrap_target(target), draft=draft, speculative=config)

    def supports_trees(self, request, target) -> bool:
        llm = self.llm(request, target)
        return llm.drafter(llm.speculative).supports_trees

    # ---------------------------------------------------------------- oracles
    def test_declared_capabilities(self, request, target):
        llm = self.llm(request, target)
        drafter = llm.drafter(llm.speculative)
        check_drafter(drafter)
        assert isinstance(getattr(drafter, "supports_trees", False), bool)
        assert isinstance(getattr(drafter, "observes", False), bool)
        state = drafter.start([1, 5, 6], _greedy(4))
        assert callable(state.propose) and callable(state.close)
        if drafter.supports_trees:
            assert callable(state.tree_session)
        if getattr(drafter, "observes", False):
            assert callable(state.observe)
        state.close()
        if not drafter.supports_trees:
            with pytest.raises(ValueError, match="cannot draft token trees"):
                self.llm(request, target, tree=TREES[0]).generate([1, 5], _greedy(4))

    @pytest.mark.parametrize("prompt", PROMPTS, ids=["p0", "p1", "p2"])
    def test_greedy_chain_equals_plain_decoding(self, request, target, prompt):
        expected = hf_greedy(target, prompt, 40)
        for k in self.ks:
            out = self.llm(request, target, k=k).generate(prompt, _greedy(40))
            assert out.token_ids == expected, f"k={k}"
            assert out.metrics.num_output_tokens == 40

    @pytest.mark.parametrize("tree", TREES)
    def test_greedy_tree_equals_plain_decoding(self, request, target, tree):
        if tree not in self.trees or not self.supports_trees(request, target):
            pytest.skip("the drafter does not draft this tree")
        llm = self.llm(request, target, tree=tree)
        for prompt in PROMPTS:
            assert llm.generate(prompt, _greedy(40)).token_ids == hf_greedy(target, prompt, 40)

    def test_drafts_are_made_and_accepted(self, request, target):
        """Equivalence is not vacuous: on repetitive text the drafter proposes tokens and
        the target accepts some of them."""
        llm = self.llm(request, target, k=4)
        stats = [llm.generate(p, _greedy(60)).metrics for p in PROMPTS[:2] * 2]
        assert sum(s.num_draft_tokens for s in stats) > 0
        assert sum(s.num_accepted_tokens for s in stats) > 0

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    def test_native_exact_identity(self, request, dtype):
        tokenizer = make_tokenizer()
        hf = make_model(tokenizer, seed=0)
        hf.model.to(dtype)
        target = self.wrap_target(NativeModel(hf, exact=True))
        if self.draft_fixture:
            draft_hf = make_model(tokenizer, seed=1, hidden_size=16, num_layers=1)
            draft_hf.model.to(dtype)
            draft = NativeModel(draft_hf, exact=True)
        else:
            draft = None
        plain = LLM(target, speculative=SpeculativeConfig(method="none"))
        trees = [None]
        probe = LLM(target, draft=draft, speculative=SpeculativeConfig(method=self.spec))
        if probe.drafter(probe.speculative).supports_trees:
            trees.append(self.trees[0])
        for tree in trees:
            config = SpeculativeConfig(method=self.spec, num_speculative_tokens=4, tree=tree)
            llm = LLM(target, draft=draft, speculative=config)
            for prompt in PROMPTS:
                expected = plain.generate(prompt, _greedy(40)).token_ids
                assert llm.generate(prompt, _greedy(40)).token_ids == expected, tree

    def test_batch_equals_one_by_one(self, request, target):
        prompts = [*PROMPTS, PROMPTS[0][:5]]
        params = [_greedy(30), _greedy(12), _greedy(25), SamplingParams(max_new_tokens=20)]
        batch = self.llm(request, target).generate(prompts, params)
        for prompt, p, out in zip(prompts, params, batch, strict=True):
            alone = self.llm(request, target).generate(prompt, p)
            assert out.token_ids == alone.token_ids

    def test_preemption_rebuilds_drafter_state(self, request, target):
        llm = self.llm(request, target)
        llm.engine_config = EngineConfig(max_kv_tokens=96, max_num_batched_tokens=32)
        prompts = [PROMPTS[0], PROMPTS[1], [1, 7, 8, 7, 8]]
        outs = llm.generate(prompts, _greedy(40))
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == hf_greedy(target, prompt, 40)

    def test_repeated_requests_are_unchanged(self, request, target):
        """Cross-request state (caches, tables) speeds later requests up; it never
        changes them."""
        llm = self.llm(request, target)
        first = [llm.generate(p, _greedy(30)).token_ids for p in PROMPTS]
        again = [llm.generate(p, _greedy(30)).token_ids for p in PROMPTS]
        assert first == again == [hf_greedy(target, p, 30) for p in PROMPTS]

    def test_seeded_sampling_ignores_what_ran_before(self, request, target):
        """Same prompt, parameters and seed: same output on a fresh LLM and on one whose
        drafter has learned from other requests (greedy and unseeded ones)."""
        params = SamplingParams(max_new_tokens=30, temperature=0.8, seed=7, ignore_eos=True)
        fresh = self.llm(request, target).generate(PROMPTS[1], params).token_ids
        used = self.llm(request, target)
        for prompt in PROMPTS:
            used.generate(prompt, _greedy(30))
            used.generate(prompt, SamplingParams(max_new_tokens=30, temperature=0.8))
        assert used.generate(PROMPTS[1], params).token_ids == fresh

    @pytest.mark.parametrize("k, budget", [(8, 1), (8, 3), (3, 7)])
    def test_budget_is_never_exceeded(self, request, target, k, budget):
        out = self.llm(request, target, k=k).generate(PROMPTS[0], _greedy(budget))
        assert len(out.token_ids) == budget
        assert out.token_ids == hf_greedy(target, PROMPTS[0], budget)

    def test_stop_token_inside_an_accepted_block(self, request, target):
        expected = hf_greedy(target, PROMPTS[0], 30)
        stop = expected[7]
        params = SamplingParams(max_new_tokens=30, stop_token_ids=(stop,), ignore_eos=True)
        out = self.llm(request, target, k=8).generate(PROMPTS[0], params)
        assert out.token_ids == expected[: expected.index(stop) + 1]
        assert out.finish_reason == "stop"

    @pytest.mark.parametrize("max_new_tokens", [2, 3])
    def test_sampling_follows_the_target_distribution(self, request, small, max_new_tokens):
        target, draft = small
        config = SpeculativeConfig(method=self.spec, num_speculative_tokens=3)
        llm = LLM(
            self.wrap_target(target),
            draft=draft if needs_draft_model(config.method, config.options) else None,
            speculative=config,
        )
        joint = exact_joint(target, SamplingParams(**PARAMS))
        counts = empirical_joint(llm, PARAMS, 1500, max_new_tokens)
        assert chi_square_pvalue(counts, joint) > 1e-3
