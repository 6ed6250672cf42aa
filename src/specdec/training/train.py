"""Training a draft head: features from the target, a trimmed vocabulary, the training
loop with EAGLE-3's training-time test, and held-out acceptance per position.

* **Features** (:func:`extract_features`): the target runs every conversation (prompt +
  its own answer) in ragged batches on its backend, capturing the hidden states the head
  reads (:attr:`specdec.models.base.ForwardOutput.captured`) and the target's greedy
  next token at every row (the label: on self-distilled answers it is the answer's next
  token).
* **Vocabulary** (:func:`choose_vocabulary`): FR-Spec (Zhao et al. 2025,
  arXiv:2502.14856): the most frequent labels of the training answers; the size is the
  smallest of the candidate sizes whose coverage reaches the target, reported with its
  cost.
* **EAGLE** (:func:`eagle_loss`): row ``j`` reads ``(f_j, t_{j+1})`` and learns the
  target's label of row ``j + 1``. The training-time test (EAGLE-3, Li et al. 2025,
  arXiv:2503.01840, Sec. 3.1 and Fig. 5; HASS, Zhang et al. 2024, arXiv:2408.15766) then
  unrolls the head on its own outputs: at step ``s`` row ``j`` reads the head's step
  ``s - 1`` output of row ``j - 1`` and the true token, and attends to the target rows up
  to ``j - s`` plus its own chain's rows of steps ``1 .. s`` -- exactly what drafting the
  ``s``-th token after context ``j - s`` sees when the earlier drafts were right. Step
  ``s``'s loss is weighted ``0.8 ** s``.
* **Medusa** (:func:`medusa_loss`): head ``k`` at row ``j`` learns the label of row
  ``j + k + 1`` (Medusa, Cai et al. 2024, Sec. 2.2), weights ``0.8 ** k``.
* **Hydra** (:func:`hydra_loss`): head ``k`` at row ``j`` reads ``f_j`` and the true
  tokens ``j + 1 .. j + 1 + k`` (teacher forcing, Hydra Sec. 3.2) and learns the label of
  row ``j + k + 1``, weights ``0.8 ** k``.
* **Parallel** (:func:`parallel_loss`): row ``j`` reads ``(f_j, t_{j+1})`` and learns
  the label of row ``j + 1`` as in EAGLE; for every anchor ``a``, mask row ``i`` (``i = 1
  .. block_size - 1``) reads ``(f_a, mask_i)`` at position ``a + i``, sees the target rows
  ``<= a`` and the anchor's mask rows ``<= i``, and learns the label of row ``a + 1 + i``
  -- what drafting after context ``a`` computes in one forward. Every anchor of every
  conversation trains in one pass (PARD's parallel-draft training, An et al. 2025,
  arXiv:2504.18583, Sec. 3.2, without its token dropping); position ``i``'s weight is
  ``0.8 ** i``.
* **Harmonized objective distillation** (HASS, Zhang et al. 2024, arXiv:2408.15766,
  Sec. 3.2, Eq. 4), opt-in (``TrainConfig.distill_top_k``): the features stage also keeps
  the target's ``K`` most probable next tokens at every row with their probabilities
  ``p``, and each position's loss gains ``distill_weight * -sum_{x in top-K} p(x) log
  q(x)`` (``q``: the head's distribution over its draft vocabulary; top-K tokens outside
  it carry no term). The hard label is the top-1 token, so the term adds what the target
  ranks next, the tokens a tree drafts and a near-tie flips between.
* **Acceptance per position** (:func:`evaluate`): on held-out conversations, the rate at
  which draft position ``s`` equals the target's greedy token given that positions
  ``< s`` did -- what a greedy chain's verification accepts -- and the implied mean
  acceptance length ``1 + sum_k prod_{s<k} alpha_s``.

Training uses AdamW with a linear warm-up and cosine decay, bfloat16 autocast on CPU, and
checkpoints that resume where they stopped.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdec.heads.modules import EagleHead, HydraHead, MedusaHead, ParallelHead

#: Loss weight decay per training-time-test step (EAGLE-3) or Medusa head.
STEP_DECAY = 0.8


@dataclass
class Features:
    """The target's view of the training conversations.

    Attributes:
        token_ids: per conversation, ``[T]`` int64 (prompt + answer).
        captured: per conversation, ``[T, C * D]`` (bfloat16) captured hidden states.
        labels: per conversation, ``[T]`` int64: the target's greedy next token at each row.
        answer_start: per conversation, the first answer token's index (``len(prompt)``).
        top_ids: per conversation, ``[T, K]`` int32: the target's ``K`` most probable
            next tokens at each row, most probable first (``None``: not kept, ``K = 0``).
        top_probs: per conversation, ``[T, K]`` float16: their probabilities (``None``
            with ``top_ids``).
    """

    token_ids: list[torch.Tensor] = field(default_factory=list)
    captured: list[torch.Tensor] = field(default_factory=list)
    labels: list[torch.Tensor] = field(default_factory=list)
    answer_start: list[int] = field(default_factory=list)
    top_ids: list[torch.Tensor] | None = None
    top_probs: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def top_k(self) -> int:
        """``K`` of :attr:`top_ids` (0: none kept)."""
        return int(self.top_ids[0].shape[-1]) if self.top_ids else 0

    def subset(self, indices: Sequence[int]) -> Features:
        return Features(
            [self.token_ids[i] for i in indices],
            [self.captured[i] for i in indices],
            [self.labels[i] for i in indices],
            [self.answer_start[i] for i in indices],
            None if self.top_ids is None else [self.top_ids[i] for i in indices],
            None if self.top_probs is None else [self.top_probs[i] for i in indices],
        )

    def answer_labels(self) -> torch.Tensor:
        """Every label that predicts an answer token (rows ``answer_start - 1 .. T - 2``)."""
        pairs = zip(self.labels, self.answer_start, strict=True)
        return torch.cat([lab[s - 1 : len(lab) - 1] for lab, s in pairs])


def extract_features(
    target,
    conversations: Sequence[tuple[Sequence[int], Sequence[int]]],
    capture: Sequence[int],
    batch_tokens: int = 2048,
    progress: Callable[[int], None] | None = None,
    top_k: int = 0,
) -> Features:
    """Run the target over ``(prompt_ids, answer_ids)`` conversations, capturing.

    Args:
        target: a backend (the native one batches the conversations in one pass).
        conversations: token ids of each prompt (after the chat template) and answer.
        capture: hidden-state indices to keep.
        batch_tokens: most tokens per forward.
        progress: called with the number of conversations done after each batch.
        top_k: also keep the target's ``top_k`` most probable next tokens per row and
            their probabilities (softmax of the float32 logits), for HASS's distillation
            (0: not kept).

    Returns:
        :class:`Features` (conversations whose answer is empty are skipped).

    Raises:
        ValueError: ``top_k`` negative or above the target's vocabulary.
    """
    from specdec.models.base import BatchItem

    if not 0 <= top_k <= target.vocab_size:
        raise ValueError(f"top_k must be in [0, {target.vocab_size}] (got {top_k})")
    out = Features(top_ids=[] if top_k else None, top_probs=[] if top_k else None)
    batch: list[tuple[list[int], int]] = []

    def flush() -> None:
        if not batch:
            return
        items = [BatchItem(ids, target.new_cache(len(ids))) for ids, _ in batch]
        with torch.inference_mode():
            results = target.forward_batch_full(items, capture=capture)
        for (ids, start), res in zip(batch, results, strict=True):
            out.token_ids.append(torch.tensor(ids, dtype=torch.long))
            out.captured.append(res.captured.to(torch.bfloat16).clone())
            out.labels.append(res.logits.argmax(-1).long())
            out.answer_start.append(start)
            if top_k:
                probs, ids = torch.softmax(res.logits.float(), dim=-1).topk(top_k, dim=-1)
                out.top_ids.append(ids.to(torch.int32))
                out.top_probs.append(probs.to(torch.float16))
        if progress is not None:
            progress(len(batch))
        batch.clear()

    for prompt, answer in conversations:
        if not answer or len(prompt) < 1:
            continue
        ids = [*prompt, *answer][: target.max_context]
        if len(prompt) >= len(ids) - 1:
            continue
        if batch and sum(len(b[0]) for b in batch) + len(ids) > batch_tokens:
            flush()
        batch.append((ids, len(prompt)))
    flush()
    return out


def choose_vocabulary(
    labels: torch.Tensor, vocab_size: int, sizes: Sequence[int], coverage: float = 0.97
) -> tuple[torch.Tensor, dict]:
    """FR-Spec's frequency-ranked draft vocabulary.

    Args:
        labels: ``[N]`` target tokens the head must predict (answer rows).
        vocab_size: the target's vocabulary size.
        sizes: candidate sizes, increasing; the smallest reaching ``coverage`` is taken
            (the largest if none does).
        coverage: share of ``labels`` the vocabulary must contain.

    Returns:
        ``(vocab_map [V'] int64 target ids, most frequent first; a report dict with every
        candidate's coverage)``.

    Example:
        >>> labels = torch.tensor([5, 5, 5, 2, 2, 7])
        >>> ids, report = choose_vocabulary(labels, 10, [1, 2, 3], coverage=0.8)
        >>> ids.tolist(), report["size"], round(report["coverage"], 3)
        ([5, 2], 2, 0.833)
    """
    counts = torch.bincount(labels, minlength=vocab_size)
    order = torch.argsort(counts, descending=True, stable=True)
    total = max(1, int(counts.sum()))
    cumulative = counts[order].cumsum(0)
    table = {int(s): float(cumulative[min(s, vocab_size) - 1]) / total for s in sizes}
    chosen = next((s for s in sizes if table[int(s)] >= coverage), sizes[-1])
    chosen = min(int(chosen), vocab_size)
    report = {
        "size": chosen,
        "coverage": table.get(chosen, 1.0),
        "candidates": table,
        "distinct_labels": int((counts > 0).sum()),
        "num_labels": total,
    }
    return order[:chosen].clone(), report


def draft_index(vocab_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[V]`` int64: each target id's draft-vocabulary index, ``-100`` (ignored) outside."""
    index = torch.full((vocab_size,), -100, dtype=torch.long)
    index[vocab_map] = torch.arange(len(vocab_map))
    return index


@dataclass
class Batch:
    """Padded conversations for one optimizer step.

    Attributes:
        tokens: ``[B, T]`` int64 (padding: 0).
        captured: ``[B, T, C * D]``.
        targets: ``[B, T]`` int64 draft-vocabulary index of the label of each row (its
            next token's prediction; ``-100`` where not trained: prompt, padding, or a
            label outside the draft vocabulary).
        valid: ``[B, T]`` bool: answer rows (for accuracy, whatever the vocabulary).
        labels: ``[B, T]`` int64 target labels (-1 where not valid).
        soft_targets: ``[B, T, K]`` int64 draft-vocabulary index of each row's top-K
            target tokens (0 where ``soft_probs`` is 0), or ``None`` (no distillation).
        soft_probs: ``[B, T, K]`` float32 their target probabilities times the
            distillation weight; 0 for tokens outside the draft vocabulary and rows not
            trained.
    """

    tokens: torch.Tensor
    captured: torch.Tensor
    targets: torch.Tensor
    valid: torch.Tensor
    labels: torch.Tensor
    soft_targets: torch.Tensor | None = None
    soft_probs: torch.Tensor | None = None


def make_batch(
    features: Features,
    indices: Sequence[int],
    index: torch.Tensor,
    distill_top_k: int = 0,
    distill_weight: float = 1.0,
) -> Batch:
    """Pad conversations ``indices`` of ``features`` into a :class:`Batch`; with
    ``distill_top_k > 0`` (at most ``features.top_k``) and ``distill_weight > 0``, the
    soft targets of each row's first ``distill_top_k`` kept tokens too (see
    :class:`Batch`)."""
    lengths = [len(features.token_ids[i]) for i in indices]
    b, t = len(indices), max(lengths)
    width = features.captured[indices[0]].shape[-1]
    tokens = torch.zeros(b, t, dtype=torch.long)
    captured = torch.zeros(b, t, width, dtype=features.captured[indices[0]].dtype)
    labels = torch.full((b, t), -1, dtype=torch.long)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for row, i in enumerate(indices):
        n = lengths[row]
        tokens[row, :n] = features.token_ids[i]
        captured[row, :n] = features.captured[i]
        labels[row, :n] = features.labels[i]
        valid[row, features.answer_start[i] - 1 : n - 1] = True
    labels = torch.where(valid, labels, torch.full_like(labels, -1))
    targets = torch.where(valid, index[labels.clamp(min=0)], torch.full_like(labels, -100))
    if not (distill_weight > 0 and distill_top_k):
        return Batch(tokens, captured, targets, valid, labels)
    k = distill_top_k
    if k > features.top_k:
        raise ValueError(f"distill_top_k {k} exceeds the {features.top_k} tokens kept per row")
    soft_targets = torch.zeros(b, t, k, dtype=torch.long)
    soft_probs = torch.zeros(b, t, k, dtype=torch.float32)
    for row, i in enumerate(indices):
        n = lengths[row]
        drafted = index[features.top_ids[i][:, :k].long()]  # -100 outside the draft vocabulary
        inside = drafted >= 0
        soft_targets[row, :n] = torch.where(inside, drafted, torch.zeros_like(drafted))
        soft_probs[row, :n] = torch.where(inside, features.top_probs[i][:, :k].float(), 0.0)
    soft_probs *= valid[..., None] * distill_weight
    return Batch(tokens, captured, targets, valid, labels, soft_targets, soft_probs)


def _position_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    soft: tuple[torch.Tensor, torch.Tensor, int] | None,
) -> torch.Tensor:
    """One draft position's loss: cross-entropy on ``targets`` (``[B, T']``, -100
    ignored) plus, with ``soft`` (:func:`_soft`: top-K draft indices ``[B, T', K]``, their
    probabilities already weighted and zero where not trained, and the number of trained
    rows), HASS's top-K distillation ``-sum p log q`` averaged over the trained rows
    (Zhang et al. 2024, Eq. 4)."""
    flat = logits.float().flatten(0, 1)
    loss = F.cross_entropy(flat, targets.flatten(), ignore_index=-100)
    if soft is None or not soft[2]:
        return loss
    soft_targets, soft_probs, rows = soft
    logq = torch.log_softmax(flat, dim=-1).gather(-1, soft_targets.flatten(0, 1))
    return loss - (soft_probs.flatten(0, 1) * logq).sum() / rows


def _soft(batch: Batch, shift: int, skip: int = 0):
    """``batch``'s soft targets of rows ``shift ..`` with the first ``skip`` of them
    zeroed, and how many of those rows are trained (answer rows); ``None`` without."""
    if batch.soft_targets is None:
        return None
    probs = batch.soft_probs[:, shift:].clone()
    probs[:, :skip] = 0.0
    rows = batch.valid[:, shift:].clone()
    rows[:, :skip] = False
    return batch.soft_targets[:, shift:], probs, int(rows.sum())


def ttt_mask(n: int, step: int) -> torch.Tensor:
    """``[n, (step + 1) * n]`` bool attention of training-time-test step ``step``: row
    ``j`` sees target rows ``<= j - step`` and, for ``u = 1 .. step``, row ``j - step + u``
    of step ``u`` (its own chain).

    Example:
        >>> ttt_mask(3, 1).int().tolist()
        [[0, 0, 0, 1, 0, 0], [1, 0, 0, 0, 1, 0], [1, 1, 0, 0, 0, 1]]
    """
    j = torch.arange(n)[:, None]
    i = torch.arange(n)[None, :]
    parts = [i <= j - step]
    for u in range(1, step + 1):
        parts.append(i == j - step + u)
    return torch.cat(parts, dim=1)


def eagle_forward(head: EagleHead, batch: Batch, steps: int) -> list[torch.Tensor]:
    """The training-time test's logits: per step ``s``, ``[B, T - 1, V']`` for rows
    ``j = 0 .. T - 2`` (row ``j`` reads token ``j + 1``; see the module docstring)."""
    tokens, n = batch.tokens, batch.tokens.shape[1] - 1
    features = head.fuse(batch.captured[:, :n].to(head.lm_head.weight.dtype))
    positions = torch.arange(n)
    ids = tokens[:, 1:]
    keys, values, outputs = None, None, []
    h = features
    for s in range(steps):
        if s:
            h = torch.cat([features[:, :1], h[:, :-1]], dim=1)  # row j reads row j-1's
        mask = ttt_mask(n, s)
        h, k, v = head.step(h, ids, positions, keys, values, mask)
        keys = k if keys is None else torch.cat([keys, k], dim=-3)
        values = v if values is None else torch.cat([values, v], dim=-3)
        outputs.append(head.logits(h))
    return outputs


def eagle_loss(head: EagleHead, batch: Batch, steps: int) -> tuple[torch.Tensor, list[dict]]:
    """Weighted cross-entropy over the training-time test's steps.

    Returns:
        ``(loss, per step {"loss", "correct", "counted"})``: ``correct`` / ``counted``
        count rows whose argmax equals the target's label among valid rows whose chain
        was right so far (the conditional acceptance; see :func:`evaluate`).
    """
    targets = batch.targets[:, 1:]  # row j learns the label of row j + 1
    labels = batch.labels[:, 1:]
    valid = batch.valid[:, 1:]
    total = 0.0
    stats = []
    chain_ok = torch.ones_like(valid)
    for s, logits in enumerate(eagle_forward(head, batch, steps)):
        rows = targets.clone()
        rows[:, :s] = -100  # a chain needs s rows of context before it
        loss = _position_loss(logits, rows, _soft(batch, 1, skip=s))
        if torch.isfinite(loss):
            total = total + (STEP_DECAY**s) * loss
        with torch.no_grad():
            guess = head.vocab_map[logits.argmax(-1)]
            hit = (guess == labels) & valid
            ok = valid.clone()
            ok[:, :s] = False
            ok &= chain_ok
            stats.append({
                "loss": float(loss) if torch.isfinite(loss) else float("nan"),
                "correct": int((hit & ok).sum()),
                "counted": int(ok.sum()),
            })  # fmt: skip
            # chain through row j at step s continues as row j + 1 at step s + 1
            nxt = torch.zeros_like(chain_ok)
            nxt[:, 1:] = (chain_ok & hit)[:, :-1]
            chain_ok = nxt
    return total, stats


def _position_stats(head, logits, labels, valid, chain_ok, loss):
    """One draft position's statistics for heads whose positions are separate outputs
    (Medusa, Hydra, parallel): ``({"loss", "correct", "counted"}, chain_ok)``, a row
    counted where it is valid and every earlier position of its chain was right
    (``chain_ok``: the previous position's ``[B, T']`` rows still right, ``None`` at the
    first position, cut to this position's length)."""
    with torch.no_grad():
        hit = (head.vocab_map[logits.argmax(-1)] == labels) & valid
        ok = valid if chain_ok is None else valid & chain_ok[:, : valid.shape[1]]
        entry = {
            "loss": float(loss) if torch.isfinite(loss) else float("nan"),
            "correct": int((hit & ok).sum()),
            "counted": int(ok.sum()),
        }
    return entry, hit & ok


def _positions_loss(head, batch: Batch, positions) -> tuple[torch.Tensor, list[dict]]:
    """The weighted loss and statistics of heads whose draft positions are separate
    outputs (Medusa, Hydra, parallel): ``positions`` yields, per position ``k``, the
    ``[B, T - k - 1, V']`` logits whose row ``j`` predicts the label of row ``j + k + 1``;
    weights ``0.8 ** k``, statistics of :func:`_position_stats`."""
    total = 0.0
    stats = []
    chain_ok = None
    for k, lg in enumerate(positions):
        shift = k + 1
        loss = _position_loss(lg, batch.targets[:, shift:], _soft(batch, shift))
        if torch.isfinite(loss):
            total = total + (STEP_DECAY**k) * loss
        labels, valid = batch.labels[:, shift:], batch.valid[:, shift:]
        entry, chain_ok = _position_stats(head, lg, labels, valid, chain_ok, loss)
        stats.append(entry)
    return total, stats


def medusa_loss(head: MedusaHead, batch: Batch, steps: int | None = None):
    """Weighted cross-entropy of every Medusa head (head ``k`` at row ``j`` learns the
    label of row ``j + k + 1``); the same statistics as :func:`eagle_loss`, head ``k``
    counted where heads ``< k`` were right."""
    n = batch.tokens.shape[1]
    logits = head(batch.captured.to(head.lm_head.weight.dtype))  # [B, T, K, V']
    heads = range(min(head.config.medusa_heads, n - 1))
    return _positions_loss(head, batch, (logits[:, : n - k - 1, k] for k in heads))


def hydra_loss(head: HydraHead, batch: Batch, steps: int | None = None):
    """Weighted loss of every Hydra head (head ``k`` at row ``j`` reads the true tokens
    ``j + 1 .. j + 1 + k`` and learns the label of row ``j + k + 1``); the statistics of
    :func:`medusa_loss` (head ``k`` counted where heads ``< k`` were right, which is when
    the tokens it read are the ones a chain would have drafted)."""
    features = batch.captured.to(head.lm_head.weight.dtype)
    return _positions_loss(head, batch, head(features, batch.tokens))


def parallel_mask(n: int, block: int) -> torch.Tensor:
    """``[block * n, block * n]`` bool attention of :func:`parallel_forward`: rows
    ``0 .. n-1`` are the target rows (causal); rows ``i * n + a`` are mask row ``i`` of
    anchor ``a`` (sees target rows ``<= a`` and the anchor's mask rows ``1 .. i``).

    Example:
        >>> parallel_mask(2, 2).int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    """
    j = torch.arange(n)[:, None]
    i = torch.arange(n)[None, :]
    causal, same = i <= j, i == j
    rows = [torch.cat([causal] + [torch.zeros_like(same)] * (block - 1), dim=1)]
    for offset in range(1, block):
        parts = [causal] + [same if u <= offset else torch.zeros_like(same)
                            for u in range(1, block)]  # fmt: skip
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0)


def parallel_forward(head: ParallelHead, batch: Batch) -> list[torch.Tensor]:
    """Per draft position ``s`` (``0 .. block_size - 1``), ``[B, T - 1, V']`` logits of
    drafting after each anchor ``a`` (row ``a`` reads token ``a + 1``; position ``s``
    predicts the label of row ``a + 1 + s``), all in one forward (see the module
    docstring)."""
    tokens, n = batch.tokens, batch.tokens.shape[1] - 1
    block = head.config.block_size
    features = head.fuse(batch.captured[:, :n].to(head.lm_head.weight.dtype))
    ids = [tokens[:, 1:]] + [torch.full_like(tokens[:, 1:], -i) for i in range(1, block)]
    positions = torch.cat([torch.arange(n) + i for i in range(block)])
    h, _, _ = head.step(
        features.repeat(1, block, 1), torch.cat(ids, dim=1), positions, None, None,
        parallel_mask(n, block),
    )  # fmt: skip
    return list(head.logits(h).split(n, dim=1))


def parallel_loss(head: ParallelHead, batch: Batch, steps: int | None = None):
    """Weighted cross-entropy of every draft position of every anchor; the statistics of
    :func:`eagle_loss` (position ``s`` counted where positions ``< s`` of the same anchor
    were right)."""
    n = batch.tokens.shape[1] - 1
    positions = parallel_forward(head, batch)[:n]
    return _positions_loss(head, batch, (lg[:, : n - s] for s, lg in enumerate(positions)))


def loss_function(head) -> tuple[Callable, int]:
    """``(loss function, draft positions it reports)`` of a head."""
    if isinstance(head, ParallelHead):
        return parallel_loss, head.config.block_size
    if isinstance(head, EagleHead):
        return eagle_loss, 0
    if isinstance(head, HydraHead):
        return hydra_loss, head.config.medusa_heads
    return medusa_loss, head.config.medusa_heads


def acceptance_length(rates: Sequence[float]) -> float:
    """Mean accepted tokens per verification of a greedy chain as long as ``rates``
    (conditional acceptance per position), the bonus token included.

    Example:
        >>> acceptance_length([0.5, 0.5])
        1.75
    """
    total, alive = 1.0, 1.0
    for r in rates:
        alive *= r
        total += alive
    return total


@torch.no_grad()
def evaluate(head, features: Features, index: torch.Tensor, steps: int, batch_size: int = 8):
    """Held-out conditional acceptance per draft position and the implied mean
    acceptance length (see the module docstring).

    Returns:
        ``{"acceptance": [alpha_0, ...], "tau": float, "loss": float}``.
    """
    head.eval()
    correct = [0] * steps
    counted = [0] * steps
    losses = []
    loss_fn, _ = loss_function(head)
    order = sorted(range(len(features)), key=lambda i: len(features.token_ids[i]))
    for start in range(0, len(order), batch_size):
        batch = make_batch(features, order[start : start + batch_size], index)
        loss, stats = loss_fn(head, batch, steps)
        losses.append(float(loss))
        for s, st in enumerate(stats[:steps]):
            correct[s] += st["correct"]
            counted[s] += st["counted"]
        del loss, batch
        release_freed_memory()
    head.train()
    rates = [c / n if n else 0.0 for c, n in zip(correct, counted, strict=False)]
    return {
        "acceptance": rates,
        "tau": acceptance_length(rates),
        "loss": sum(losses) / max(1, len(losses)),
    }


@dataclass
class TrainConfig:
    """Optimizer settings (defaults chosen for the embedded 135M target on 2 CPU cores).

    Attributes:
        steps: optimizer steps (>= 1).
        batch_tokens: most tokens per step (conversations padded to the longest).
        lr: peak AdamW learning rate; ``warmup`` linear steps, then cosine decay to 10%.
        weight_decay: AdamW's.
        ttt_steps: EAGLE's training-time-test depth (Medusa, parallel: ignored).
        max_minutes: stop early after this much training time (0: no limit).
        checkpoint_every: steps between checkpoints.
        seed: shuffling and initialization seed.
        bf16: bfloat16 autocast.
        distill_top_k: HASS's harmonized objective distillation over the target's
            ``distill_top_k`` most probable tokens per row (kept by the features stage;
            0: off, cross-entropy on the target's greedy token only; HASS used 10).
        distill_weight: the distillation term's weight (>= 0; HASS's default 1.0).
    """

    steps: int = 2000
    batch_tokens: int = 2048
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.0
    ttt_steps: int = 3
    max_minutes: float = 0.0
    checkpoint_every: int = 100
    seed: int = 0
    bf16: bool = True
    distill_top_k: int = 0
    distill_weight: float = 1.0


def batches_by_length(
    features: Features, batch_tokens: int, generator: torch.Generator
) -> list[list[int]]:
    """Conversations grouped by similar length into batches of at most ``batch_tokens``
    padded tokens, in a random order."""
    perm = torch.randperm(len(features), generator=generator).tolist()
    chunks = [perm[i : i + 256] for i in range(0, len(perm), 256)]
    out = []
    for chunk in chunks:
        chunk.sort(key=lambda i: len(features.token_ids[i]))
        batch: list[int] = []
        for i in chunk:
            longest = max(
                [len(features.token_ids[j]) for j in batch] + [len(features.token_ids[i])]
            )
            if batch and longest * (len(batch) + 1) > batch_tokens:
                out.append(batch)
                batch = []
            batch.append(i)
        if batch:
            out.append(batch)
    order = torch.randperm(len(out), generator=generator).tolist()
    return [out[i] for i in order]


def release_freed_memory() -> None:
    """Give the C allocator's free pages back to the system (glibc ``malloc_trim``; a
    no-op elsewhere).

    Training allocates tensors of a new shape at every step (conversations padded to
    the batch's longest); glibc keeps the freed blocks in its heaps, fragmented, and the
    process grew from 3.6 to 9.5 GiB over 716 steps of the EAGLE head's training on this
    project's CPU. Trimming after each step keeps it near its working set (measured: 40
    steps grew 2.2 GiB untrimmed, 0.9 GiB trimmed, at the same speed).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or ``None`` where the C library has none."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def train(
    head,
    train_set: Features,
    held_out: Features,
    config: TrainConfig,
    checkpoint: str | None = None,
    log: Callable[[dict], None] | None = None,
    progress=None,
) -> dict:
    """Train ``head`` in place (float32 weights, bf16 autocast); resumes from
    ``checkpoint`` when it exists and saves it every ``checkpoint_every`` steps.

    Returns:
        ``{"history": [...], "steps": int, "seconds": float, "eval": evaluate(...)}``;
        ``history`` holds per logged step ``{"step", "loss", "acceptance", "lr"}``.
    """
    import os

    head.train()
    index = draft_index(head.vocab_map, head.config.vocab_size)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    gen = torch.Generator().manual_seed(config.seed)
    state = {"step": 0, "history": [], "seconds": 0.0, "epoch": 0, "position": 0}
    if checkpoint and os.path.exists(checkpoint):
        saved = torch.load(checkpoint, weights_only=False)
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["optimizer"])
        state = saved["state"]
        gen.set_state(saved["generator"])
    loss_fn, steps_per_pos = loss_function(head)
    steps_per_pos = steps_per_pos or config.ttt_steps
    if config.distill_top_k and train_set.top_k < config.distill_top_k:
        raise ValueError(
            f"distillation over the target's top {config.distill_top_k} tokens needs features "
            f"that kept them (these kept {train_set.top_k}): extract_features(top_k=...)"
        )

    def lr_at(step: int, elapsed: float = 0.0) -> float:
        """Linear warm-up, then cosine decay to 10% over the run: the run's end is
        ``steps``, or ``max_minutes`` when that comes first (the schedule follows
        whichever is further along, so a time-limited run still anneals)."""
        if step < config.warmup:
            return config.lr * (step + 1) / config.warmup
        t = (step - config.warmup) / max(1, config.steps - config.warmup)
        if config.max_minutes:
            t = max(t, elapsed / (60 * config.max_minutes))
        return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))

    batches = batches_by_length(train_set, config.batch_tokens, gen)
    start_time = time.perf_counter() - state["seconds"]
    window: list[tuple[float, list[dict]]] = []
    while state["step"] < config.steps:
        if state["position"] >= len(batches):
            batches = batches_by_length(train_set, config.batch_tokens, gen)
            state["epoch"] += 1
            state["position"] = 0
        indices = batches[state["position"]]
        state["position"] += 1
        batch = make_batch(train_set, indices, index, config.distill_top_k, config.distill_weight)
        lr = lr_at(state["step"], time.perf_counter() - start_time)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
            loss, stats = loss_fn(head, batch, steps_per_pos)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        value = float(loss.detach())
        del loss, batch
        release_freed_memory()
        state["step"] += 1
        window.append((value, stats))
        if progress is not None:
            progress(1, value)
        elapsed = time.perf_counter() - start_time
        done = state["step"] >= config.steps or (
            config.max_minutes and elapsed > 60 * config.max_minutes
        )
        if state["step"] % 25 == 0 or done:
            rates = []
            for s in range(steps_per_pos):
                c = sum(st[s]["correct"] for _, st in window if s < len(st))
                n = sum(st[s]["counted"] for _, st in window if s < len(st))
                rates.append(c / n if n else 0.0)
            entry = {
                "step": state["step"],
                "loss": sum(w[0] for w in window) / len(window),
                "acceptance": rates,
                "lr": lr,
                "seconds": elapsed,
            }
            state["history"].append(entry)
            window = []
            if log is not None:
                log(entry)
        state["seconds"] = elapsed
        if checkpoint and (state["step"] % config.checkpoint_every == 0 or done):
            tmp = checkpoint + ".tmp"
            torch.save(
                {"head": head.state_dict(), "optimizer": opt.state_dict(), "state": state,
                 "generator": gen.get_state()}, tmp,
            )  # fmt: skip
            os.replace(tmp, checkpoint)
        if done:
            break
    result = evaluate(head, held_out, index, steps_per_pos)
    return {
        "history": state["history"],
        "steps": state["step"],
        "epochs": state["epoch"] + state["position"] / max(1, len(batches)),
        "seconds": state["seconds"],
        "eval": result,
    }
