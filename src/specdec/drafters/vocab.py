"""A self-draft's vocabulary: its LM head over a subset of the target's tokens.

Source: FR-Spec (Zhao et al. 2025, arXiv:2502.14856), which restricts a draft's LM head
to the most frequent tokens: for a small model the LM head is the largest single product
of a draft step (SmolLM2-135M: 49152 x 576, about a fifth of the weights), and a draft
that proposes only common tokens loses little acceptance. VocabTrim (Goel et al. 2025,
arXiv:2506.22694) does the same for draft models.

What this module implements: :class:`DraftVocabulary`, one sequence's draft vocabulary
for the self-drafts (``layer-skip``, ``quantized``, ``sparse-kv``): the ``size`` lowest
token ids, and every token the sequence has held (its prompt and output so far, which a
long-context answer copies from). The low ids stand in for FR-Spec's frequency ranking:
a BPE tokenizer (GPT-2's, SmolLM2's, Llama 3's, Qwen's) numbers its tokens in merge
order, most frequent pairs first, so the low ids are the tokens its corpus used most
(measured on the embedded model's tokenizer: the 8192 lowest ids cover 82-87% of the
tokens of the long documents of ``benchmarks/long_context_cpu`` and of Spec-Bench's
prompts; with the documents' own tokens added, all of them). The first part's head is
built once per drafter and shared by its sequences; the second is a small head of its
own per sequence, grown as new tokens appear.

Losslessness never depends on the subset: a token outside it simply has draft
probability 0 (greedy: it is never proposed; sampled: rejection sampling's residual
distribution gives it its full target probability).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specdec.heads.modules import spread_logits


class SharedVocabulary:
    """A drafter's part of its sequences' vocabularies: the ``size`` lowest token ids (at
    most the vocabulary; a multiple of 8 reads fastest on the ``q8`` kernel) and their
    head, built on first use.

    Args:
        model: the native model that runs the draft forwards (its ``vocab_head``).
        size: tokens (>= 1).
        vocab_size: the target's vocabulary size.
    """

    def __init__(self, model, size: int, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.size = min(vocab_size, size)
        self._head = None

    @property
    def head(self):
        """The LM head over ids ``0 .. size - 1``."""
        if self._head is None:
            self._head = self.model.vocab_head(torch.arange(self.size))
        return self._head


class DraftVocabulary:
    """One sequence's draft vocabulary (see the module docstring): the shared low ids and
    the tokens the sequence held outside them.

    Call :meth:`update` with the sequence before each draft; call the object as the
    draft forward's LM head (``forward_full(..., lm_head=vocabulary)``).

    Attributes:
        columns: ``[m]`` int64: the target id of each logit column.
    """

    def __init__(self, shared: SharedVocabulary) -> None:
        self.shared = shared
        self._extra: list[int] = []
        self._known: set[int] = set()
        self._head = None
        self._seen = 0
        self.columns = torch.arange(shared.size)

    def update(self, token_ids: Sequence[int]) -> None:
        """Add the tokens of ``token_ids`` not seen before: those past the part of the
        sequence already shown (a sequence's tokens only grow), or all of them when it is
        shorter than that (another sequence; what the vocabulary held stays in it)."""
        if len(token_ids) < self._seen:
            self._seen = 0
        new = np.asarray(token_ids[self._seen :], dtype=np.int64)
        self._seen = len(token_ids)
        if new.size == 0:
            return
        added = [
            int(t) for t in np.unique(new[new >= self.shared.size]) if int(t) not in self._known
        ]
        if not added:
            return
        self._known.update(added)
        self._extra.extend(added)
        extra = torch.tensor(self._extra, dtype=torch.long)
        self._head = self.shared.model.vocab_head(extra)
        self.columns = torch.cat([torch.arange(self.shared.size), extra])

    def __call__(self, hidden: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """``[n, m]`` logits of ``hidden`` ``[n, hidden_size]`` over :attr:`columns`."""
        logits = self.shared.head(hidden, exact)
        if self._head is None:
            return logits
        return torch.cat([logits, self._head(hidden, exact)], dim=1)

    def spread(self, logits: torch.Tensor) -> torch.Tensor:
        """``[n, m]`` logits over :attr:`columns` as ``[n, vocab_size]`` float32 logits,
        ``-inf`` for the tokens outside the subset (draft probability 0)."""
        return spread_logits(logits, self.columns.to(logits.device), self.shared.vocab_size)
