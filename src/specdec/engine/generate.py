"""Single-sequence speculative decoding: a loop over the batched engine with one sequence
(the reference a batched run must match, request by request).

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

from collections.abc import Iterator, Sequence

import torch

from specdec.config import SamplingParams
from specdec.control.base import SpeculationController
from specdec.control.cost import CostModel
from specdec.drafters.base import Drafter
from specdec.engine.commit import StepOutput, verify
from specdec.engine.engine import Engine, EngineConfig
from specdec.engine.stops import StopChecker
from specdec.models.base import Backend
from specdec.trees.builders import TreeBuilder

__all__ = ["StepOutput", "generate_steps", "verify"]


def generate_steps(
    target: Backend,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    num_speculative_tokens: int,
    stop_checker: StopChecker,
    generator: torch.Generator,
    tree_builder: TreeBuilder | None = None,
    engine_config: EngineConfig | None = None,
    *,
    controller: SpeculationController | None = None,
    cost_model: CostModel | None = None,
    verifier: str = "rejection",
    grammar=None,
    prefix_cache=None,
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
        tree_builder: draft a token tree per step (the drafter must support trees);
            ``num_speculative_tokens`` is then unused and the tree's depth is capped by the
            remaining token budget.
        engine_config: the engine's limits (defaults of :class:`EngineConfig`; a batched
            run must use the same ``prefill_chunk`` to give the same bits).
        controller: chooses each step's draft length within ``num_speculative_tokens``
            (default: fixed).
        cost_model: the online cost model to read and feed (default: a new one).
        verifier: ``"rejection"`` or ``"block"`` (see :meth:`Engine.add_request`).
        grammar: the grammar state of ``params.structured_outputs`` (see
            :meth:`Engine.add_request`).
        prefix_cache: with ``engine_config.enable_prefix_caching``, the
            :class:`~specdec.engine.prefix_cache.PrefixCache` to read and fill (default: a
            new one).

    Yields:
        :class:`StepOutput` per step; the last one has a ``finish_reason``.

    Raises:
        ValueError: empty prompt, a prompt that fills the context, or a tree with a
            drafter that cannot draft trees (see :meth:`Engine.add_request`).
    """
    engine = Engine(target, engine_config, cost_model, prefix_cache)
    seq = engine.add_request(
        "0", prompt_ids, params, drafter=drafter, num_speculative_tokens=num_speculative_tokens,
        tree_builder=tree_builder, stop_checker=stop_checker, generator=generator,
        controller=controller, verifier=verifier, grammar=grammar,
    )  # fmt: skip
    try:
        while not seq.is_finished:
            for _, step in engine.step():
                yield step
    finally:
        engine.abort("0")  # closed early: release the drafter state (no-op when finished)
