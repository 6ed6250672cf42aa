"""Hydra: Medusa's heads made sequentially dependent on the tokens drafted before them.

Source: Hydra (Ankner et al. 2024, arXiv:2402.05109, Sec. 3). Like Medusa, ``K`` heads
read the target's final-normed hidden state ``f`` of the last verified token (the state
whose logits gave the pending token), and head ``k`` predicts the token ``k + 1`` places
after the pending one. Unlike Medusa, head ``k`` also reads the embeddings of the pending
token and of the ``k`` draft tokens before its position, so each guess follows the
guesses before it. The head is :class:`specdec.heads.modules.HydraHead`.

* A chain of ``k <= K`` tokens runs head 0 on ``(f, pending)``, head 1 on ``(f, pending,
  draft 1)``, and so on: ``k`` small head calls, no target forward and no cache.
* Trees: any tree builder; a node at depth ``d`` is expanded by head ``d`` on its own
  path (the pending token and the node's ancestors), which Medusa cannot do; ``dynamic``
  keeps the most probable paths within a budget (EAGLE-2's rule on Hydra's scores, as
  Hydra's own tree search ranks paths by the heads' probabilities). Depth is at most ``K``.
* Sampling draws from ``logits_to_probs`` of a head's logits spread over the target
  vocabulary (0 outside the draft vocabulary) and returns them as ``draft_probs``, so
  rejection sampling and tree verification stay lossless.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import DraftProposal
from specdec.drafters.draft_model import expansions_from_logits
from specdec.drafters.head import LastStateDrafter, LastStateSequence
from specdec.sampling import logits_to_probs, sample
from specdec.trees.builders import Expansion
from specdec.trees.tree import ROOT


class HydraDrafter(LastStateDrafter):
    """Drafts with trained Hydra heads (see the module docstring).

    Args:
        target: the target backend.
        head: a loaded :class:`~specdec.heads.modules.HydraHead` for this target.
        options: :class:`~specdec.drafters.options.HydraOptions`.
    """

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> HydraSequence:
        return HydraSequence(self, params)


class HydraSequence(LastStateSequence):
    """One sequence: the target's last verified state (paths are passed per call)."""

    @torch.inference_mode()
    def position_logits(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """``[N, V']`` float32 draft-vocabulary logits of the next token after each path
        (:meth:`HydraDrafter.full_logits` spreads them over the target's vocabulary).

        Args:
            paths: per row, the pending token and the draft tokens after it (all rows of
                one length ``P``, ``1 <= P <= K``): head ``P - 1`` runs on them.
        """
        head = self.drafter.head
        ids = torch.tensor([list(p) for p in paths], dtype=torch.long)
        state = self._state.to(head.dtype).expand(len(paths), -1)
        return head.position_logits(state, ids).float()

    def propose(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        generator: torch.Generator,
        *,
        stop_drafting: Callable[[int, float], bool] | None = None,
    ) -> DraftProposal:
        """Up to ``min(num_tokens, K)`` tokens, head ``i`` choosing position ``i`` after
        the pending token and the ``i`` tokens drafted before it.

        Returns:
            the chain; ``draft_probs`` ``[k', V]`` float32 when sampling, else ``None``;
            ``confidence``: each position's top draft probability.
        """
        num_tokens = min(num_tokens, self.drafter.num_heads)
        if num_tokens <= 0 or self._state is None or not token_ids:
            return DraftProposal([])  # a one-token prompt: a plain step
        path = [int(token_ids[-1])]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        confidence: list[float] = []
        drafter = self.drafter
        threshold = drafter.options.confidence
        for i in range(num_tokens):
            logits = self.position_logits([path])
            if self.params.greedy:  # the softmax over the draft vocabulary: 0 elsewhere
                top, index = torch.softmax(logits[0], -1).max(-1)
                top, token, row = float(top), int(drafter.vocab_map[int(index)]), None
            else:
                row = logits_to_probs(drafter.full_logits(logits), self.params)[0]
                top = float(row.max())
            if top < threshold or (stop_drafting is not None and stop_drafting(i, top)):
                break
            if row is not None:
                token = int(sample(row[None], generator))
                rows.append(row)
            tokens.append(token)
            confidence.append(top)
            path.append(token)
        return DraftProposal(tokens, torch.stack(rows) if rows else None, confidence)

    def tree_session(self, token_ids: Sequence[int], params: SamplingParams) -> HydraTreeSession:
        self.params = params
        return HydraTreeSession(self, int(token_ids[-1]) if token_ids else None, params)


class HydraTreeSession:
    """Hydra's tree: a node at depth ``d`` (``ROOT``: depth 0) is expanded by head ``d``
    on its own path; nodes as deep as the heads get no children."""

    def __init__(self, sequence: HydraSequence, pending: int | None, params) -> None:
        self.sequence, self.params = sequence, params
        self.paths: list[list[int]] = []
        self.root = [] if pending is None else [pending]

    def add(self, parent: int, token: int) -> int:
        self.paths.append([*(self.root if parent == ROOT else self.paths[parent]), token])
        return len(self.paths) - 1

    def expand(self, nodes: Sequence[int], width: int) -> list[Expansion]:
        out = [Expansion([], [], None) for _ in nodes]
        if self.sequence._state is None or not self.root:  # no target state yet
            return out
        paths = [self.root if n == ROOT else self.paths[n] for n in nodes]
        by_length: dict[int, list[int]] = {}
        for i, path in enumerate(paths):
            if len(path) <= self.sequence.drafter.num_heads:  # else no head guesses this far
                by_length.setdefault(len(path), []).append(i)
        for members in by_length.values():
            draft = self.sequence.position_logits([paths[i] for i in members])
            logits = self.sequence.drafter.full_logits(draft)
            for i, expansion in zip(members, expansions_from_logits(logits, self.params, width),
                                    strict=True):  # fmt: skip
                out[i] = expansion
        return out

    def close(self) -> None:
        pass
