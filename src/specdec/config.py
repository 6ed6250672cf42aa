"""User-facing configuration: sampling parameters and the speculative-decoding setup.

Both dataclasses validate themselves in ``__post_init__`` and raise ``ValueError`` with the
reason, so a bad combination fails at configuration time instead of mid-generation.
They are frozen: specdec never writes tuned state back into a user's config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdec.trees.spec import TreeSpec

#: Drafter names accepted by :class:`SpeculativeConfig`.
DRAFTER_METHODS = ("none", "ngram", "draft-model")


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is turned into tokens.

    Args:
        temperature: softmax temperature (float, >= 0). ``0`` means greedy decoding
            (argmax), which is deterministic and makes speculative output identical to plain
            autoregressive output token for token.
        top_k: keep only the ``top_k`` most probable tokens (int, >= 0; ``0`` disables).
            Tokens tied with the k-th logit are kept too.
        top_p: nucleus sampling: keep the smallest set of most probable tokens whose
            probability sums to at least ``top_p`` (float in (0, 1]; ``1`` disables).
        max_new_tokens: upper bound on generated tokens (int, >= 1), never exceeded.
        seed: seed of the ``torch.Generator`` used for every random draw (drafts,
            acceptance tests, residual and bonus samples). Same seed, same output.
            ``None`` draws a fresh seed.
        stop: stop strings. The text ends right before the first occurrence (the stop
            string is dropped); the token ids end with the token that completed it, so
            nothing generated after the stop appears in either.
        stop_token_ids: extra token ids that end generation (kept as the last output id,
            like EOS).
        ignore_eos: keep generating past EOS / end-of-turn tokens (for benchmarks).

    Raises:
        ValueError: on any out-of-range value.

    Temperature, top-k and top-p are applied identically to the target and to a draft
    model, so rejection sampling stays lossless with respect to the *processed* target
    distribution.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {self.seed!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which drafter proposes tokens and how many per step.

    Args:
        method: ``"none"`` (plain autoregressive decoding through the same loop),
            ``"ngram"`` (prompt lookup) or ``"draft-model"`` (a smaller causal LM).
        num_speculative_tokens: draft tokens proposed per verification step (γ, int >= 1).
            Ignored for ``"none"``.
        ngram_min / ngram_max: n-gram sizes tried by the ``ngram`` drafter, longest first
            (ints, 1 <= ngram_min <= ngram_max).
        draft_model: name or path of the draft model for ``"draft-model"`` (see
            :func:`specdec.models.load`); may instead be given to :class:`specdec.LLM` as
            an already loaded model.
        tree: draft a token tree per step instead of a chain: a :class:`TreeSpec` or its
            string form, e.g. ``"dynamic:top_k=4,depth=5,budget=16"``,
            ``"static:tree-16"``, ``"best-first:budget=16,depth=6"``,
            ``"sequoia:budget=16,depth=6"`` (see :mod:`specdec.trees.spec`). The tree's
            own depth then replaces ``num_speculative_tokens``.

    Raises:
        ValueError: unknown method, num_speculative_tokens < 1, bad n-gram sizes, a bad
            tree spec, a tree with method ``"none"``, or sampled children (``draw=iid`` /
            ``wor``) with a drafter that has no distribution (``ngram``).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 5
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str | None = None
    tree: TreeSpec | str | None = None

    def __post_init__(self) -> None:
        if self.tree is not None:
            object.__setattr__(self, "tree", TreeSpec.parse(self.tree))
            if self.method == "none":
                raise ValueError("a token tree needs a drafter (method 'ngram' or 'draft-model')")
            if self.tree.draw != "top" and self.method != "draft-model":
                raise ValueError(
                    f"draw={self.tree.draw} samples children from a draft distribution; "
                    "only method 'draft-model' has one (use draw=top)"
                )
        if self.method not in DRAFTER_METHODS:
            raise ValueError(
                f"unknown drafter {self.method!r}; choose one of {', '.join(DRAFTER_METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if not (1 <= self.ngram_min <= self.ngram_max):
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}"
            )
