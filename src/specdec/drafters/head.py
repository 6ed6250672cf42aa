"""What the draft-head drafters (:mod:`.eagle`, :mod:`.medusa`, :mod:`.hydra`,
:mod:`.parallel`) share: the loaded head, the hidden-state indices it reads and the map
from its draft vocabulary back to the target's."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import DrafterBase, DraftProposal, VerificationFeedback
from specdec.heads.modules import spread_logits
from specdec.sampling import greedy_ids, logits_to_probs, sample


class HeadDrafterBase(DrafterBase):
    """A drafter around a trained head (shared by every sequence).

    Args:
        target: the target backend.
        head: a loaded head for this target (:func:`specdec.heads.format.load_head`).
        options: the drafter's options.

    Attributes:
        captures: the hidden-state indices the head reads (the engine captures them).
    """

    supports_trees = True
    observes = True
    confidence_stop = True

    def __init__(self, target, head, options) -> None:
        self.target = target
        self.head = head
        self.options = options
        self.captures = tuple(head.config.capture)
        self.vocab_size = target.vocab_size
        self.vocab_map = head.vocab_map.to(torch.long)

    def full_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """``[N, V']`` draft-vocabulary logits -> ``[N, V]`` float32 target-vocabulary
        logits, ``-inf`` outside the draft vocabulary (:func:`spread_logits`)."""
        return spread_logits(draft_logits, self.vocab_map, self.vocab_size)


class LastStateDrafter(HeadDrafterBase):
    """A head drafter whose heads read only the last verified token's state (Medusa,
    Hydra): one head per draft position, ``num_heads`` (= ``max_draft_tokens``) of them."""

    def __init__(self, target, head, options) -> None:
        super().__init__(target, head, options)
        self.num_heads = self.max_draft_tokens = head.config.medusa_heads


class LastStateSequence(DrafterBase):
    """A sequence of a drafter that reads only the target's state of the last verified
    token (Medusa, Hydra): the prompt's last row after prefill, then the last accepted row
    of each verification (whose logits gave the pending token).

    Args:
        drafter: the head drafter.
        params: the request's sampling parameters.
    """

    observes = True
    confidence_stop = True

    def __init__(self, drafter: HeadDrafterBase, params: SamplingParams) -> None:
        self.drafter = drafter
        self.params = params
        self._state: torch.Tensor | None = None  # [1, D] last verified token's state

    def _set_state(self, state: torch.Tensor) -> None:
        self._state = state

    def observe_prefill(self, start: int, hidden: torch.Tensor) -> None:
        self._set_state(hidden[-1:])

    def observe(self, feedback: VerificationFeedback) -> None:
        if feedback.hidden is None:
            name = type(self.drafter).__name__.removesuffix("Drafter")
            raise ValueError(f"the {name} drafter needs the target's hidden states (captures)")
        self._set_state(feedback.hidden[feedback.accepted_rows[-1]][None])


def chain_from_positions(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    threshold: float,
    stop_drafting: Callable[[int, float], bool] | None = None,
    *,
    vocab_map: torch.Tensor | None = None,
    full_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> DraftProposal:
    """A chain from per-position logits that do not depend on the earlier drafts
    (Medusa's heads, a parallel head's block): position ``i``'s token is its argmax
    (greedy) or a draw from ``logits_to_probs`` of its logits (sampled).

    Args:
        logits: ``[k, V']`` float32 logits of draft positions ``0 .. k - 1``.
        params: the request's sampling parameters.
        generator: the draws' generator.
        threshold: drafting stops before the first position whose top probability is
            below it.
        stop_drafting: the controller's ``(position, top probability) -> stop``.
        vocab_map: ``[V']`` target ids of the columns of ``logits`` (``None``: the
            columns are the target's vocabulary).
        full_logits: spreads ``[k, V']`` logits over the target vocabulary (needed with
            ``vocab_map`` when sampling).

    Returns:
        the chain; ``draft_probs`` ``[k', V]`` float32 when sampling, else ``None``;
        ``confidence``: each kept position's top probability.
    """
    if params.greedy:
        probs, dists = torch.softmax(logits, -1), None
    else:
        spread = logits if full_logits is None else full_logits(logits)
        probs = dists = logits_to_probs(spread, params)
    tokens, rows, confidence = [], [], []
    for i in range(logits.shape[0]):
        top = float(probs[i].max())
        if top < threshold or (stop_drafting is not None and stop_drafting(i, top)):
            break
        if dists is None:
            best = int(greedy_ids(logits[i]))
            tokens.append(best if vocab_map is None else int(vocab_map[best]))
        else:
            tokens.append(int(sample(dists[i : i + 1], generator)))
            rows.append(dists[i])
        confidence.append(top)
    return DraftProposal(tokens, torch.stack(rows) if rows else None, confidence)
