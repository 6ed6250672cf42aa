"""Single-sequence speculative decoding loop (the reference every faster engine must match).

One step: the drafter proposes up to k tokens; the target runs the pending token plus the
drafts in one forward pass at explicit positions; the verifier keeps the accepted prefix
and adds one recovered or bonus token; the target cache is truncated so that it holds every
token except the new last one (cursor rule).

With a tree builder the drafter proposes a token tree instead: the target runs the pending
token plus every node in one forward with tree attention (depth-based positions, ancestor
mask), the tree verifier keeps the accepted root-to-node path, and the cache is compacted
to that path (gather), which again leaves every token but the pending one cached.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import Drafter, DraftProposal, SequenceDrafter
from specdec.engine.stops import StopChecker
from specdec.metrics import SpecStats
from specdec.models.base import Backend, KVCacheLike
from specdec.sampling import logits_to_probs
from specdec.trees.builders import TreeBuilder, TreeProposal
from specdec.trees.tree import TokenTree
from specdec.verify.greedy import verify_greedy
from specdec.verify.rejection import rejection_sample
from specdec.verify.result import VerifyResult
from specdec.verify.tree import verify_tree


@dataclass
class StepOutput:
    """What one verification step added.

    Attributes:
        new_token_ids: tokens appended to the output (after stop truncation).
        finish_reason: ``"stop"`` (stop token or string), ``"length"`` (max_new_tokens or
            the context limit), or ``None`` while generation goes on.
        text_end: for a stop string, where the output text ends (character offset).
        stats: the generation's running :class:`SpecStats` (same object every step).
    """

    new_token_ids: list[int]
    finish_reason: str | None
    stats: SpecStats
    text_end: int | None = None


def verify(
    proposal: DraftProposal,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
) -> VerifyResult:
    """Greedy match for temperature 0, lossless rejection sampling otherwise.

    Args:
        proposal: the step's draft tokens (k) and draft probabilities (or ``None``).
        target_logits: ``[k + 1, V]`` float32 target logits.
    """
    draft_ids = torch.tensor(proposal.token_ids, dtype=torch.long, device=target_logits.device)
    if params.greedy:
        return verify_greedy(draft_ids, target_logits)
    target_probs = logits_to_probs(target_logits, params)
    return rejection_sample(draft_ids, proposal.draft_probs, target_probs, generator)


def generate_steps(
    target: Backend,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    num_speculative_tokens: int,
    stop_checker: StopChecker,
    generator: torch.Generator,
    tree_builder: TreeBuilder | None = None,
) -> Iterator[StepOutput]:
    """Run speculative decoding for one sequence, yielding after every step.

    Args:
        target: the target model.
        drafter: proposes draft tokens (``NoDrafter`` gives plain autoregressive decoding);
            its per-sequence state (``drafter.start``) is closed when the generation ends,
            is stopped, or the iterator is closed.
        prompt_ids: ``[L]`` prompt token ids, 1 <= L < ``target.max_context``.
        params: sampling parameters (greedy when temperature is 0).
        num_speculative_tokens: most draft tokens per step (k >= 0); capped by the
            remaining token budget so ``max_new_tokens`` is never exceeded and nothing is
            allocated for drafts that could not be used.
        stop_checker: stop tokens / strings.
        generator: source of every random draw.
        tree_builder: draft a token tree per step (the sequence drafter must offer
            ``tree_session``); ``num_speculative_tokens`` is then unused and the tree's
            depth is capped by the remaining token budget.

    Yields:
        :class:`StepOutput` per step; the last one has a ``finish_reason``.

    Raises:
        ValueError: empty prompt or a prompt that fills the context.
    """
    if not prompt_ids:
        raise ValueError("prompt is empty")
    if len(prompt_ids) >= target.max_context:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens; {target.name} holds at most "
            f"{target.max_context} tokens in total, so nothing could be generated"
        )
    stats = SpecStats()
    max_total = min(len(prompt_ids) + params.max_new_tokens, target.max_context)
    tokens = list(prompt_ids)
    t0 = time.perf_counter()
    # The cache holds the sequence plus the largest verification: a chain verifies at most
    # the remaining budget, so max_total; a tree may hold more nodes than remain (its depth
    # is capped, not its breadth), so max_total + its node limit.
    largest_tree = tree_builder.max_nodes if tree_builder is not None else 0
    cache = target.new_cache(max_total + largest_tree)
    if len(tokens) > 1:
        target.forward(tokens[:-1], cache, num_logits=1)
    stats.prefill_s = time.perf_counter() - t0
    sequence = drafter.start(prompt_ids, params)
    try:
        if tree_builder is not None and not hasattr(sequence, "tree_session"):
            raise ValueError(f"{type(drafter).__name__} cannot draft token trees")
        stats.draft_s += time.perf_counter() - t0 - stats.prefill_s
        stats.elapsed_s = time.perf_counter() - t0
        run = _Run(
            target, sequence, cache, tokens, len(prompt_ids), max_total, params,
            num_speculative_tokens, stop_checker, generator, tree_builder, stats,
        )  # fmt: skip
        while True:
            step = _step(run)
            yield step
            if step.finish_reason is not None:
                return
    finally:
        sequence.close()


@dataclass
class _Run:
    """Everything one sequence's generation carries from step to step."""

    target: Backend
    sequence: SequenceDrafter
    cache: KVCacheLike
    tokens: list[int]  # prompt + output so far; the last one is pending (not cached)
    num_prompt: int
    max_total: int
    params: SamplingParams
    num_speculative_tokens: int
    stop_checker: StopChecker
    generator: torch.Generator
    tree_builder: TreeBuilder | None
    stats: SpecStats


def _step(run: _Run) -> StepOutput:
    """One verification step: draft, one target forward, verify, commit (cursor rule)."""
    t_step = time.perf_counter()
    tokens, cache, params, generator = run.tokens, run.cache, run.params, run.generator
    budget = run.max_total - len(tokens)
    if run.tree_builder is None:
        k = min(run.num_speculative_tokens, budget - 1)
        proposal = run.sequence.propose(tokens, k, generator)
        t_drafted = time.perf_counter()
        past = cache.num_tokens
        logits = run.target.forward([tokens[-1], *proposal.token_ids], cache)
        result = verify(proposal, logits, params, generator)
        cache.truncate(past + 1 + result.num_accepted)  # the emitted last token is pending
        num_drafted, max_depth = len(proposal), len(proposal)
    else:
        tree_proposal = _draft_tree(
            run.sequence, run.tree_builder, tokens, budget - 1, params, generator
        )
        tree = tree_proposal.tree
        t_drafted = time.perf_counter()
        past = cache.num_tokens
        logits = run.target.forward_tree(tokens[-1], tree, cache)
        result = verify_tree(tree, logits, params, generator)
        # keep the root and the accepted path; the emitted last token is pending
        cache.compact([past + 1 + n for n in result.accepted_nodes], start=past + 1)
        run.tree_builder.observe(tree_proposal, result.accepted_nodes, result.output_token_ids)
        num_drafted, max_depth = len(tree), tree.max_depth
    tokens.extend(result.output_token_ids)
    stats = run.stats
    stats.draft_s += t_drafted - t_step
    stats.verify_s += time.perf_counter() - t_drafted
    step = _finish_step(
        tokens, run.num_prompt, len(result.output_token_ids), run.max_total,
        run.stop_checker, stats,
    )  # fmt: skip
    # Draft tokens dropped by a stop are not counted as accepted.
    num_accepted = min(result.num_accepted, len(step.new_token_ids))
    stats.record_step(num_drafted, num_accepted, len(step.new_token_ids), max_depth)
    stats.elapsed_s += time.perf_counter() - t_step
    return step


def _draft_tree(
    sequence: SequenceDrafter,
    builder: TreeBuilder,
    tokens: list[int],
    max_depth: int,
    params,
    generator,
) -> TreeProposal:
    """One step's tree (empty when no token may be drafted)."""
    if max_depth < 1:
        return TreeProposal(TokenTree((), ()))
    session = sequence.tree_session(tokens, params)
    try:
        return builder.build(session, max_depth, not params.greedy, generator)
    finally:
        session.close()


def _finish_step(
    tokens: list[int],
    num_prompt: int,
    num_new: int,
    max_total: int,
    stop_checker: StopChecker,
    stats: SpecStats,
) -> StepOutput:
    """Apply stops and the length limit to the tokens this step appended (in place)."""
    output = tokens[num_prompt:]
    match = stop_checker.check(output, num_new)
    if match is not None:
        del tokens[num_prompt + match.num_tokens :]
        new = output[len(output) - num_new : match.num_tokens]
        return StepOutput(new, "stop", stats, match.text_end)
    new = output[len(output) - num_new :]
    return StepOutput(new, "length" if len(tokens) >= max_total else None, stats)
