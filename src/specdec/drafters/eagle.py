"""EAGLE: a trained one-layer head drafts from the target's own hidden states.

Sources: EAGLE (Li et al. 2024, arXiv:2401.15077), EAGLE-2's dynamic draft trees (Li et
al. 2024, arXiv:2406.16858) and EAGLE-3's multi-layer features and training-time test
(Li et al. 2025, arXiv:2503.01840). The head is :class:`specdec.heads.modules.EagleHead`.

How a sequence drafts (rows of the head's own KV cache, see :mod:`specdec.heads.modules`):

* The engine captures the target's hidden states in every forward of the sequence
  (``captures``): the prompt's arrive through ``observe_prefill``, each verification's
  accepted rows through ``observe``. So before each step the drafter knows the target's
  feature ``f_j`` of every token but the pending one.
* ``propose`` first runs the head over the rows it has not run yet, row ``j`` reading
  ``(f_j, t_{j+1})`` (one head forward; these rows stay in the head's cache, since they
  read only verified tokens and target features). The last row reads the pending token;
  its output predicts the first draft token. Each further draft row reads the head's own
  previous output and the previous draft token. The draft rows are dropped from the head's
  cache afterwards.
* Draft tokens come from the head's *draft vocabulary* (see
  :mod:`specdec.heads.modules`): greedy decoding takes the argmax; sampling draws from
  ``logits_to_probs`` of the head's logits spread over the target vocabulary (0 outside
  the draft vocabulary) and returns those distributions as ``draft_probs``, so rejection
  sampling, SpecInfer and RSD verify them losslessly.
* Token trees: any tree builder; ``dynamic`` is EAGLE-2's (expand the nodes of highest
  path confidence, keep the best ``budget``), with node ``n``'s row reading its parent's
  output and its own token, attending to the verified rows and its ancestors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import DrafterBase, DraftProposal, VerificationFeedback
from specdec.drafters.draft_model import CachedTreeSession
from specdec.drafters.head import HeadDrafterBase
from specdec.sampling import logits_to_probs, sample
from specdec.trees.builders import Expansion


class HeadCache:
    """Keys and values of a head's rows for one sequence, with a cursor, in the native
    runtime's cache layout (``kv`` ``[1, 2, G, C, d]``: one layer, keys then values), so
    that :class:`~specdec.heads.modules.FusedEagleLayer` writes and reads it directly.

    Args:
        num_kv_heads, head_dim: the head's attention shape.
        dtype, device: of the tensors.
        capacity: initial rows (grows by doubling).
    """

    def __init__(self, num_kv_heads: int, head_dim: int, dtype, device, capacity: int = 256):
        self.kv = torch.empty(1, 2, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.num_rows = 0

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows (the first ``num_rows`` kept)."""
        if rows > self.kv.shape[3]:
            old = self.kv
            self.kv = old.new_empty(*old.shape[:3], max(rows, 2 * old.shape[3]), old.shape[4])
            self.kv[:, :, :, : self.num_rows] = old[:, :, :, : self.num_rows]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add ``[n, G, d]`` keys and values after the cursor."""
        need = self.num_rows + k.shape[0]
        self.reserve(need)
        self.kv[0, 0, :, self.num_rows : need] = k.transpose(0, 1)
        self.kv[0, 1, :, self.num_rows : need] = v.transpose(0, 1)
        self.num_rows = need

    def past(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([P, G, d], [P, G, d])`` views of the rows' keys and values."""
        n = self.num_rows
        return self.kv[0, 0, :, :n].transpose(0, 1), self.kv[0, 1, :, :n].transpose(0, 1)

    def truncate(self, num_rows: int) -> None:
        self.num_rows = min(self.num_rows, num_rows)

    def run_fused(self, fused, features, ids, positions=None, visible=None, keep=None):
        """Rows after the cursor on a head's fused layer
        (:meth:`~specdec.heads.modules.FusedEagleLayer.run`, which writes their keys and
        values here); the cursor then moves past the first ``keep`` of them (default all).
        Returns their ``[N, D]`` outputs."""
        start, n = self.num_rows, features.shape[0]
        self.reserve(start + n)
        h = fused.run(self.kv, features, ids, start, positions, visible)
        self.num_rows = start + (n if keep is None else keep)
        return h


class EagleDrafter(HeadDrafterBase):
    """Drafts with a trained EAGLE head (see the module docstring).

    Args:
        target: the target backend (either backend; its :meth:`head_view` gives the
            embedding the head reads).
        head: a loaded :class:`~specdec.heads.modules.EagleHead` for this target.
        options: :class:`~specdec.drafters.options.EagleOptions`.

    Attributes:
        captures: the hidden-state indices the head reads (the engine captures them).
    """

    supports_trees = True
    observes = True
    confidence_stop = True

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> EagleSequence:
        return EagleSequence(self, params)


class EagleSequence(DrafterBase):
    """One sequence's head cache and the target features not yet read (see the module
    docstring)."""

    observes = True
    confidence_stop = True

    def __init__(self, drafter: EagleDrafter, params: SamplingParams) -> None:
        self.drafter = drafter
        self.head = drafter.head
        self.params = params
        c = self.head.config
        dtype = self.head.dtype
        device = self.head.norm.weight.device
        self.cache = HeadCache(c.num_kv_heads, c.head_dim, dtype, device)
        self._features: list[torch.Tensor] = []  # captured states of rows not yet run
        self._known = 0  # tokens whose target features arrived

    # ------------------------------------------------------------------ feedback
    def observe_prefill(self, start: int, hidden: torch.Tensor) -> None:
        """Captured states of prompt tokens ``start ..`` (a new prefill starts afresh)."""
        if start == 0:
            self.cache.truncate(0)
            self._features, self._known = [], 0
        if start != self._known:
            raise ValueError(f"prefill chunk starts at {start}; the head knows {self._known}")
        self._features.append(hidden)
        self._known += hidden.shape[0]

    def observe(self, feedback: VerificationFeedback) -> None:
        """The target's states of the pending token and the accepted draft tokens."""
        if feedback.hidden is None:
            raise ValueError("the EAGLE drafter needs the target's hidden states (captures)")
        rows = torch.as_tensor(feedback.accepted_rows, device=feedback.hidden.device)
        self._features.append(feedback.hidden.index_select(0, rows))
        self._known += len(feedback.accepted_rows)

    # ------------------------------------------------------------------ drafting
    def ready(self, token_ids: Sequence[int]) -> bool:
        """Whether the head can draft: a one-token prompt has no target state yet (its
        first step is a plain one)."""
        return len(token_ids) > 1

    @torch.inference_mode()
    def _catch_up(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Run the head over the rows not yet run (every verified token's feature with
        the next token); ``[1, D]`` output of the last row (the pending token's)."""
        n = len(token_ids)
        if self._known != n - 1:
            raise ValueError(
                f"the head knows the target's states of {self._known} tokens; the sequence "
                f"has {n} (every token but the pending one is needed)"
            )
        start = self.cache.num_rows
        if not self._features:
            return self._last
        captured = torch.cat(self._features) if len(self._features) > 1 else self._features[0]
        self._features = []
        dtype = self.head.dtype
        features = self.head.fuse(captured.to(dtype))
        ids = torch.as_tensor(token_ids[start + 1 : n], dtype=torch.long)
        h = self._rows(features, ids)
        self._last = h[-1:]
        return self._last

    def _rows(self, features: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Run the head over causal rows after the cache's (each seeing the cached rows and
        the new ones before it), keep them in the cache; ``[N, D]`` outputs. On the
        runtime's fused layer where the head runs there
        (:meth:`~specdec.heads.modules.EagleHead.fused_layer`), else the PyTorch layer."""
        start = self.cache.num_rows
        fused = self.head.fused_layer()
        if fused is not None and features.dim() == 2 and features.device.type == "cpu":
            return self.cache.run_fused(fused, features, ids)
        positions = torch.arange(start, start + features.shape[0])
        past_k, past_v = self.cache.past() if start else (None, None)
        h, k, v = self.head.step(features, ids, positions, past_k, past_v, None)
        self.cache.append(k, v)
        return h

    def _pick(self, h: torch.Tensor, generator, position: int, stop):
        """Draft token, its target-vocabulary distribution (``None`` when greedy) and
        its confidence from the head's output ``h`` ``[1, D]``; ``None`` to stop."""
        drafter = self.drafter
        logits = self.head.logits(h).float()
        threshold = drafter.options.confidence
        if self.params.greedy:
            probs = torch.softmax(logits[0], -1)
            top, index = probs.max(-1)
            top = float(top)
            if top < threshold or (stop is not None and stop(position, top)):
                return None
            return int(drafter.vocab_map[int(index)]), None, top
        full = logits_to_probs(drafter.full_logits(logits), self.params)
        top = float(full[0].max())
        if top < threshold or (stop is not None and stop(position, top)):
            return None
        return int(sample(full, generator)), full[0], top

    @torch.inference_mode()
    def propose(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        generator: torch.Generator,
        *,
        stop_drafting: Callable[[int, float], bool] | None = None,
    ) -> DraftProposal:
        """Up to ``num_tokens`` draft tokens after ``token_ids`` (a chain).

        Returns:
            the chain; ``draft_probs`` ``[k', V]`` float32 when sampling, else ``None``;
            ``confidence``: each position's top draft probability.

        Raises:
            ValueError: the target's states of some verified token never arrived.
        """
        if num_tokens <= 0 or not self.ready(token_ids):
            return DraftProposal([])
        h = self._catch_up(token_ids)
        committed = self.cache.num_rows
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        confidence: list[float] = []
        try:
            for i in range(num_tokens):
                picked = self._pick(h, generator, i, stop_drafting)
                if picked is None:
                    break
                token, row, top = picked
                tokens.append(token)
                confidence.append(top)
                if row is not None:
                    rows.append(row)
                if i + 1 == num_tokens:
                    break
                h = self._rows(h, torch.tensor([token]))
        finally:
            self.cache.truncate(committed)
        return DraftProposal(tokens, torch.stack(rows) if rows else None, confidence)

    def tree_session(self, token_ids: Sequence[int], params: SamplingParams) -> EagleTreeSession:
        """A :class:`~specdec.trees.builders.TreeSession` over the head's cache."""
        self.params = params
        return EagleTreeSession(self, token_ids, params)

    def close(self) -> None:
        self._features = []


class EagleTreeSession(CachedTreeSession):
    """EAGLE-2 tree drafting: node ``n`` at depth ``d`` is a head row reading its parent's
    output and its own token, at position ``len(sequence) - 2 + d``, seeing the verified
    rows, its ancestors and itself. Candidate scores are the head's probabilities (softmax
    of its logits when greedy, the processed sampling distribution otherwise, which
    sampled children are drawn from). ``close`` drops the tree rows."""

    def __init__(self, sequence: EagleSequence, token_ids: Sequence[int], params) -> None:
        self.sequence = sequence
        self.head = sequence.head
        self.cache = sequence.cache
        self.params = params
        self.empty = not sequence.ready(token_ids)
        if self.empty:  # nothing to draft from: every node gets no candidates
            self.committed = self.cache.num_rows
            return
        with torch.inference_mode():
            root = sequence._catch_up(token_ids)
            self.base = self.cache.num_rows + 1  # CachedTreeSession: depth d at base - 1 + d
            self.committed = self.cache.num_rows
            self.outputs: dict[int, torch.Tensor] = {}
            self._root = root
            self._init_tree(self._full(root)[0])

    def _full(self, h: torch.Tensor) -> torch.Tensor:
        return self.sequence.drafter.full_logits(self.head.logits(h))

    @torch.inference_mode()
    def _run_nodes(self, nodes: list[int], positions: list[int], mask: torch.Tensor):
        parents = [
            self._root[0] if self.parents[n] < 0 else self.outputs[self.parents[n]] for n in nodes
        ]
        features = torch.stack(parents)
        ids = torch.tensor([self.tokens[n] for n in nodes])
        pos = torch.tensor(positions) - 1  # rows sit one before their token
        full_mask = torch.cat(
            [torch.ones(len(nodes), self.committed, dtype=torch.bool), mask.to(torch.bool)], 1
        )
        fused = self.head.fused_layer()
        if fused is not None and features.device.type == "cpu":
            h = self.cache.run_fused(fused, features, ids, pos, full_mask)
        else:
            h, k, v = self.head.step(features, ids, pos, *self.cache.past(), full_mask)
            self.cache.append(k, v)
        for row, node in enumerate(nodes):
            self.outputs[node] = h[row]
        return self._full(h)

    def expand(self, nodes, width):
        if self.empty:
            return [Expansion([], [], None) for _ in nodes]
        return super().expand(nodes, width)

    def close(self) -> None:
        self.cache.truncate(self.committed)
