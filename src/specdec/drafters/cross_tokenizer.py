"""A draft model with another tokenizer: drafts travel as text.

Sources:

* Universal Assisted Generation (Mamou et al. 2024, Hugging Face blog "Universal Assisted
  Generation: Faster Decoding with Any Assistant Model"; transformers'
  ``assistant_tokenizer``): the target's tokens are decoded to text and re-encoded with
  the draft's tokenizer; the draft's tokens are decoded to text and re-encoded with the
  target's tokenizer, then verified as usual.
* String-Level Exact Match, SLEM (Timor et al. 2025, "Accelerating LLM Inference with
  Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies",
  arXiv:2502.05202, section 3): the same text-level translation, verified by exact
  match of the target's tokens, lossless for any pair of tokenizers.

What this module implements (:class:`CrossTokenizerDrafter`):

* **Target -> draft.** The sequence so far (every target token, the target's leading BOS
  dropped, special tokens kept as their text, so chat markers that both tokenizers know
  stay single tokens) is decoded with the target's tokenizer and re-encoded with the
  draft's (its own BOS added when it uses one). The draft's KV cache keeps the longest
  prefix it shares with that encoding; the rest is fed in one forward.
* **Draft.** The draft model decodes its own tokens until their text spells
  ``num_tokens + 1`` target tokens, it ends with its end-of-sequence token, or it has
  decoded :data:`DRAFT_TOKENS_PER_TARGET_TOKEN` per target token asked for: greedily
  (argmax) for greedy decoding, else sampled from its distribution after temperature,
  ``min_p``, top-k and top-p (the target's history transforms and logit bias name
  target ids and are not applied to the draft).
* **Draft -> target** (:meth:`TextAligner.target_ids`). The drafted text is appended to
  the text of the last few target tokens and encoded with the target's tokenizer; when
  that encoding starts with exactly those target tokens, the tokens after them are the
  proposal. Otherwise the drafted text merged with the last target token (e.g. the
  target ends in ``hel`` and the draft continues ``lo``) and nothing is proposed.
* **Drafts that end inside a target token.** The last target token of the proposal may
  be a piece of a longer token (the draft stopped in the middle of a word the target
  spells as one token), so it is dropped, unless the draft ended with its end-of-sequence
  token. The proposal is cut to ``num_tokens``.
* **Verification.** The proposal holds target ids, verified like any draft. Greedy
  output is the target's own: identical to plain decoding. Sampled drafts carry no draft
  probabilities in the target's vocabulary (the draft's distribution is over other
  tokens), so they are verified as point masses, SLEM's exact-match rule: a proposed
  token x is kept with probability p(x) and otherwise replaced by a sample of the residual
  ``p`` without x, renormalized. Conditioned on any proposal this emits exactly ``p``; the
  draft's randomness comes before the verifier's draws and never depends on them, so the
  output follows the target's distribution exactly (acceptance is lower than with a
  shared vocabulary, where rejection sampling can use the draft's probabilities).

Not implemented: SLEM's and TLI's vocabulary-intersection schemes that keep draft
probabilities for tokens both vocabularies share; token trees.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import DrafterBase, DraftProposal
from specdec.models.base import Backend
from specdec.sampling import greedy_ids, logits_to_probs, sample

#: Target tokens of context re-encoded with each draft (see :meth:`TextAligner.target_ids`).
TAIL_TOKENS = 8
#: Most draft tokens decoded per target token asked for (a draft tokenizer may spell one
#: target token with several of its own).
DRAFT_TOKENS_PER_TARGET_TOKEN = 4


class TextAligner:
    """Text-level translation between a target's and a draft's tokenizers.

    Args:
        target_tokenizer, draft_tokenizer: :class:`~specdec.tokenizer.Tokenizer` s (their
            ``hf`` tokenizers encode and decode).
        tail: target tokens of context re-encoded with each draft (>= 1).
    """

    def __init__(self, target_tokenizer, draft_tokenizer, tail: int = TAIL_TOKENS) -> None:
        self.target = target_tokenizer.hf
        self.draft = draft_tokenizer.hf
        self.tail = tail
        self.target_bos = getattr(self.target, "bos_token_id", None)

    def text(self, target_ids: Sequence[int]) -> str:
        """The text of target tokens (special tokens kept as text; a leading BOS dropped)."""
        ids = list(target_ids)
        if ids and self.target_bos is not None and ids[0] == self.target_bos:
            ids = ids[1:]
        return self.target.decode(ids, skip_special_tokens=False)

    def draft_ids(self, target_ids: Sequence[int]) -> list[int]:
        """The draft tokenizer's encoding of the target tokens' text (its BOS added when
        it adds one)."""
        return list(self.draft(self.text(target_ids), add_special_tokens=True)["input_ids"])

    def drafted_text(self, context_ids: Sequence[int], new_ids: Sequence[int]) -> str | None:
        """The text ``new_ids`` add after ``context_ids`` (draft tokens); ``None`` when the
        decodings do not line up (a character split across the boundary)."""
        context = list(context_ids[-self.tail :])
        before = self.draft.decode(context, skip_special_tokens=False)
        after = self.draft.decode(context + list(new_ids), skip_special_tokens=False)
        return after[len(before) :] if after.startswith(before) else None

    def target_ids(self, target_ids: Sequence[int], text: str) -> list[int]:
        """Target tokens that spell ``text`` after the sequence ``target_ids``.

        The text is appended to the text of the last :attr:`tail` target tokens and
        encoded; the tokens after an exact re-encoding of those tail tokens are returned.
        ``[]`` when the re-encoding changes the tail (the text merges with the last target
        token, or the tail does not survive a decode-encode round trip).
        """
        if not text:
            return []
        tail = list(target_ids[-self.tail :])
        if tail and self.target_bos is not None and tail[0] == self.target_bos:
            tail = tail[1:]
        context = self.target.decode(tail, skip_special_tokens=False)
        ids = list(self.target(context + text, add_special_tokens=False)["input_ids"])
        if ids[: len(tail)] != tail:
            return []
        return ids[len(tail) :]


class CrossTokenizerDrafter(DrafterBase):
    """A draft model whose tokenizer differs from the target's (see the module
    docstring); chains only.

    Args:
        draft: the draft model (its ``tokenizer`` is the draft's).
        target_tokenizer: the target's :class:`~specdec.tokenizer.Tokenizer`.
        target_vocab_size: width of the target's logits (proposals are checked against it).

    Raises:
        ValueError: the draft scores fewer tokens than its tokenizer has.
    """

    #: why the engine refuses token trees with it (chains only)
    tree_refusal = (
        "draft-model with a draft of another tokenizer cannot draft token trees: they need "
        "a draft sharing the target's vocabulary (drop the tree to draft chains)"
    )

    def __init__(self, draft: Backend, target_tokenizer, target_vocab_size: int) -> None:
        if draft.vocab_size < len(draft.tokenizer):
            raise ValueError(
                f"{draft.name!r} scores {draft.vocab_size} tokens but its tokenizer has "
                f"{len(draft.tokenizer)}; it cannot be used for speculative decoding"
            )
        self.draft = draft
        self.aligner = TextAligner(target_tokenizer, draft.tokenizer)
        self.target_vocab_size = target_vocab_size
        self.num_draft_tokens = len(draft.tokenizer)
        self.draft_eos = frozenset(draft.tokenizer.eos_token_ids)

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> CrossTokenizerSequence:
        """A new sequence's drafter (its draft cache is filled by its first draft)."""
        return CrossTokenizerSequence(self, prompt_ids, params)


class CrossTokenizerSequence(DrafterBase):
    """One sequence's draft state: the draft's KV cache and the draft tokens in it."""

    def __init__(
        self, drafter: CrossTokenizerDrafter, prompt_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.drafter = drafter
        self.draft = drafter.draft
        self.params = params
        capacity = min(2 * (len(prompt_ids) + params.max_new_tokens), self.draft.max_context)
        self._cache = self.draft.new_cache(capacity + 16)
        self._cached: list[int] = []  # draft tokens whose keys and values are in the cache

    def propose(
        self, token_ids: Sequence[int], num_tokens: int, generator: torch.Generator
    ) -> DraftProposal:
        """Up to ``num_tokens`` target tokens translated from the draft's own tokens (see
        the module docstring); ``draft_probs`` is ``None`` (point masses)."""
        if num_tokens <= 0:
            return DraftProposal([])
        d = self.drafter
        context = d.aligner.draft_ids(token_ids)
        if not context or len(context) + num_tokens + 1 > self.draft.max_context:
            return DraftProposal([])
        limit = min(
            DRAFT_TOKENS_PER_TARGET_TOKEN * (num_tokens + 1),
            self.draft.max_context - len(context),
        )
        pending = self._sync(context)
        new: list[int] = []
        proposal: list[int] = []
        for _ in range(limit):
            logits = self.draft.forward(pending, self._cache, num_logits=1)[-1:]
            self._cached.extend(pending)
            token = self._pick(logits, generator)
            new.append(token)
            pending = [token]
            text = d.aligner.drafted_text(context, new)
            if text is None:
                continue
            ids = d.aligner.target_ids(token_ids, text)
            if token in d.draft_eos:  # the draft ended: its last token is complete
                proposal = ids[:num_tokens]
                break
            proposal = ids[:-1]  # the last one may be the start of a longer target token
            if len(proposal) >= num_tokens:
                proposal = proposal[:num_tokens]
                break
        if any(not 0 <= t < d.target_vocab_size for t in proposal):
            return DraftProposal([])
        return DraftProposal(proposal)

    def _pick(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        """The next draft token from ``[1, V_draft]`` logits (padding columns excluded)."""
        logits = logits.float()
        real = self.drafter.num_draft_tokens
        if logits.shape[-1] > real:
            logits = logits.clone()
            logits[:, real:] = float("-inf")
        if self.params.greedy:
            return int(greedy_ids(logits[0]))
        return int(sample(logits_to_probs(logits, self.params), generator))

    def _sync(self, context: list[int]) -> list[int]:
        """Keep the cached draft tokens ``context`` starts with; return the rest (at
        least the last token, whose logits the first draft step needs)."""
        n, limit = 0, min(len(self._cached), len(context) - 1)
        while n < limit and self._cached[n] == context[n]:
            n += 1
        self._cache.truncate(n)
        del self._cached[n:]
        return context[n:]

    def close(self) -> None:
        """Free the draft cache."""
        self._cache = None
        self._cached = []
