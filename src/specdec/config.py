"""User-facing configuration: sampling parameters and the speculative-decoding setup.

Both dataclasses validate themselves in ``__post_init__`` and raise ``ValueError`` with the
reason, so a bad combination fails at configuration time instead of mid-generation.
They are frozen: specdec never writes tuned state back into a user's config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdec.structured import StructuredOutputsParams
from specdec.trees.spec import TreeSpec, TreeSpecError
from specdec.unicode import check_text

#: ``SpeculativeConfig.method`` for the drafter object given to ``LLM(drafter=...)``.
CUSTOM = "custom"
#: Most stop strings per request, and most characters in one.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
#: Most extra stop token ids per request.
MAX_STOP_TOKEN_IDS = 1024
#: Most top log-probabilities per output token (OpenAI's ``top_logprobs`` bound).
MAX_LOGPROBS = 20
#: Most choices (``n``, ``best_of``) per request.
MAX_CHOICES = 16
#: Lossless chain verifiers (:attr:`SpeculativeConfig.verifier`).
VERIFIERS = ("rejection", "block")
#: Lossy chain verifiers: they change the output's law, and run only with
#: ``SpeculativeConfig(allow_lossy=True)`` (see :mod:`specdec.verify.typical`).
LOSSY_VERIFIERS = ("typical",)


@dataclass(frozen=True)
class TypicalOptions:
    """Options of ``verifier="typical:epsilon=..,delta=.."`` (Medusa-2's typical acceptance,
    :mod:`specdec.verify.typical`; LOSSY).

    Args:
        epsilon: the hard probability threshold (float in (0, 1]; default 0.09, Medusa's
            ``posterior_threshold``).
        delta: the entropy-scaled threshold's factor (float > 0; default 0.3, Medusa's
            ``posterior_alpha``).

    Raises:
        ValueError: a value out of range.
    """

    epsilon: float = 0.09
    delta: float = 0.3

    def __post_init__(self) -> None:
        if not 0.0 < self.epsilon <= 1.0:
            raise ValueError(f"typical: epsilon must be in (0, 1], got {self.epsilon}")
        if not self.delta > 0.0:
            raise ValueError(f"typical: delta must be > 0, got {self.delta}")


def parse_verifier(spec: str):
    """``"rejection"``, ``"block"`` or ``"typical[:epsilon=E,delta=D]"`` as ``(name,
    options)``: ``options`` is ``None``, or a :class:`TypicalOptions`.

    Raises:
        ValueError: an unknown verifier, options for one that takes none, or a bad option.
    """
    if not isinstance(spec, str):
        raise ValueError(f"verifier must be a string, got {spec!r}")
    name, _, written = spec.partition(":")
    if name not in VERIFIERS + LOSSY_VERIFIERS:
        known = ", ".join(VERIFIERS + LOSSY_VERIFIERS)
        raise ValueError(f"unknown verifier {spec!r}; choose one of {known}")
    if name in VERIFIERS:
        if written:
            raise ValueError(f"verifier {name!r} takes no options, got {written!r}")
        return name, None
    values = {}
    for item in filter(None, written.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in ("epsilon", "delta"):
            raise ValueError(f"typical takes epsilon=E and delta=D, got {item!r}")
        try:
            values[key] = float(value)
        except ValueError:
            raise ValueError(f"typical: {key} must be a number, got {value!r}") from None
    return name, TypicalOptions(**values)


#: Most ``logit_bias`` entries per request, and the range of a bias (OpenAI's).
MAX_LOGIT_BIAS = 1024
#: Most ``bad_words`` (and token sequences in ``bad_words_token_ids``) per request.
MAX_BAD_WORDS = 256
LOGIT_BIAS_RANGE = 100.0


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded ``seed`` (``n`` / ``best_of``):
    ``seed + index``, wrapped into the 64-bit range seeds take (``None`` stays unseeded)."""
    return None if seed is None else (seed + index + 2**63) % 2**64 - 2**63


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is turned into tokens.

    Args:
        temperature: softmax temperature (finite float, >= 0). ``0`` means greedy decoding
            (argmax), which is deterministic and makes speculative output identical to plain
            autoregressive output token for token. Any positive value works: one below
            float32's smallest normal number (~1.2e-38) acts as that number, i.e. greedy in
            effect (uniform over exactly tied maxima).
        top_k: keep only the ``top_k`` most probable tokens (int, >= 0; ``0`` disables, and
            vLLM's ``-1`` is read as ``0``). Tokens tied with the k-th logit are kept too.
        top_p: nucleus sampling: keep the smallest set of most probable tokens whose
            probability sums to at least ``top_p`` (float in (0, 1]; ``1`` disables).
        max_new_tokens: upper bound on generated tokens (int, >= 1; default 256), never
            exceeded; the model's context caps it further (nothing is allocated beyond the
            context).
        seed: seed of the ``torch.Generator`` used for every random draw (drafts,
            acceptance tests, residual and bonus samples). Same seed, same output. Any
            64-bit integer, as vLLM takes (a negative one is ``2**64 - 1 + seed`` to
            ``torch.Generator.manual_seed``). ``None`` draws a fresh seed.
        stop: stop strings (a string, a sequence, or ``None`` for none; at most 64, each 1
            to 1024 characters). The text ends right
            before the first occurrence (the stop string is dropped); the token ids end
            with the token that completed it, so nothing generated after the stop appears
            in either.
        stop_token_ids: extra token ids that end generation (kept as the last output id,
            like EOS); at most 1024, each in the target's vocabulary; ``None``: none.
        ignore_eos: keep generating past EOS / end-of-turn tokens (for benchmarks).
        max_tokens: vLLM's and OpenAI's name for ``max_new_tokens``, accepted on
            construction; the value is then read from ``max_new_tokens`` (this attribute is
            ``None`` after construction, and does not take part in equality).
        min_p: drop tokens whose probability (after temperature) is below ``min_p`` times
            the most probable one's (float in [0, 1]; ``0`` disables; Nguyen et al. 2024,
            "Turning Up the Heat: Min-p Sampling").
        repetition_penalty: CTRL's penalty (Keskar et al. 2019, eq. 2, as transformers
            and vLLM apply it) on every token of the prompt or the output so far: a
            positive logit is divided by it, a negative one multiplied (float > 0; ``1``
            disables; > 1 discourages repeats).
        presence_penalty: OpenAI's: subtracted once from the logit of every token the
            output already holds (float in [-2, 2]; ``0`` disables).
        frequency_penalty: OpenAI's: subtracted from each token's logit once per time the
            output already holds it (float in [-2, 2]; ``0`` disables).
        logit_bias: ``{token id: bias}`` added to the logits (OpenAI's; each bias in
            [-100, 100], at most 1024 entries, ids checked against the vocabulary when
            the request starts). Stored as sorted ``(id, bias)`` pairs.
        min_tokens: no stop token (EOS, end-of-turn, ``stop_token_ids``) before this many
            output tokens: their logits are -inf until then (int >= 0; vLLM's field).
            A stop string counts only where it ends after the text of the first
            ``min_tokens`` tokens (as vLLM's detokenizer does).
        n: how many outputs (choices) to return per prompt (int 1 to 16; vLLM's and
            OpenAI's field): each is its own sequence with its own drafter state and, when
            ``seed`` is set, the seed ``seed + i`` (choice i); with ``n > 1``
            :meth:`specdec.LLM.generate` returns a list of outputs per prompt.
        best_of: sample this many candidates (int, ``n`` to 16) and return the ``n`` with
            the highest mean log-probability per token under the target (OpenAI's rule;
            ``None``: ``n``).
        logprobs: return, for every output token, its log-probability and the ``logprobs``
            most probable tokens' (int 0 to 20: 0 = the chosen token's only; ``None``, the
            default, returns none). They are the target's *raw* distribution at that
            position, ``log_softmax`` of its logits before any transform (vLLM's default
            ``raw_logprobs``): the same under speculation as in plain decoding, whichever
            verification row computed them (bit-equal in exact mode).
        bad_words: words that must not be generated (vLLM's field, at most 256): each is
            tokenized as written and with a leading space (see
            :meth:`specdec.LLM.resolve_params`), and the last token of such a sequence is
            -inf wherever the output (the row's own history) ends with the tokens before
            it; a one-token word is banned everywhere.
        bad_words_token_ids: the same as token id sequences (transformers'
            ``bad_words_ids``), used as given; ``bad_words`` add theirs when the request
            starts.
        structured_outputs: a :class:`~specdec.structured.StructuredOutputsParams` (or a
            dict of its fields; JSON
            schema, regex, choice, Lark grammar or any JSON object) the output must match:
            every verified row's logits outside the grammar become ``-inf`` before the
            other transforms, each row with the grammar state of its own history; the
            output ends (``"stop"``) when the grammar is complete (see
            :mod:`specdec.structured`).
        prompt_logprobs: return, for every prompt token after the first, its
            log-probability given the tokens before it and the ``prompt_logprobs`` most
            probable tokens' (int 0 to 20; ``None``, the default, returns none; vLLM's
            field), from the raw target distribution like ``logprobs``. Computed in the
            prompt's prefill (every row's logits), so it costs the LM head over the prompt.
        logits_processors: callables ``f(output_ids: list[int], logits: Tensor[V]) ->
            Tensor[V]`` (vLLM's classic form), applied in order to each row after the
            penalties; ``output_ids`` is that row's own history (the accepted draft tokens
            before it included). A processor must be a pure function of its arguments,
            or speculation would not be lossless.

    Raises:
        ValueError: on any out-of-range value, both ``max_new_tokens`` and ``max_tokens``
            given, or a stop string that is not valid Unicode.

    Every transform is applied to each verified row with that row's own history (the
    output so far plus the draft tokens accepted before it in the block or tree path),
    in this order (vLLM's): the grammar of ``structured_outputs``, ``logit_bias``,
    ``min_tokens``, bad words, ``repetition_penalty``, ``frequency_penalty`` and
    ``presence_penalty``, ``logits_processors``; greedy decoding takes the argmax of the
    result; sampling then applies temperature, ``min_p``, ``top_k`` and ``top_p`` (see
    :func:`specdec.sampling.process_logits` and :func:`specdec.sampling.logits_to_probs`).
    Rejection sampling is lossless with respect to this *processed* target distribution:
    what plain sampling would draw from.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = None  # type: ignore[assignment]  # None: max_tokens, else 256
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    max_tokens: int | None = field(default=None, compare=False, repr=False)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    logits_processors: tuple = field(default_factory=tuple)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        self._resolve_max_tokens()
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))  # None: none (vLLM's default)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1 and _is_int(self.top_k):  # vLLM's spelling of "disabled"
            object.__setattr__(self, "top_k", 0)
        number = (int, float)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, number):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(
                f"top_k must be an integer >= 0 (0 or -1 disables), got {self.top_k!r}"
            )
        if isinstance(self.top_p, bool) or not (
            isinstance(self.top_p, number) and 0.0 < self.top_p <= 1.0
        ):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise ValueError(
                f"seed must be a 64-bit integer, in [-2**63, 2**63) (or unset), got {self.seed!r}"
            )
        self._check_stops()
        self._check_transforms()

    def _resolve_max_tokens(self) -> None:
        """``max_tokens`` (vLLM's name) into ``max_new_tokens``; both given is refused."""
        if self.max_tokens is not None and self.max_new_tokens is not None:
            raise ValueError(
                "give max_new_tokens or max_tokens (its vLLM / OpenAI name), not both: got "
                f"{self.max_new_tokens!r} and {self.max_tokens!r}"
            )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        value = self.max_new_tokens if self.max_new_tokens is not None else self.max_tokens
        object.__setattr__(self, "max_new_tokens", 256 if value is None else value)
        object.__setattr__(self, "max_tokens", None)

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
            check_text(s, f"stop string {i}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"a stop string has at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}"
            )
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers >= 0, got {self.stop_token_ids!r}")

    def _check_transforms(self) -> None:
        number = (int, float)

        def real(name: str, low: float, high: float, low_open: bool = False) -> None:
            value = getattr(self, name)
            ok = (
                not isinstance(value, bool)
                and isinstance(value, number)
                and math.isfinite(value)
                and (value > low if low_open else value >= low)
                and value <= high
            )
            if not ok:
                bound = (
                    f"a finite number > {low}"
                    if high == math.inf
                    else f"a number in {'(' if low_open else '['}{low}, {high}]"
                )
                raise ValueError(f"{name} must be {bound}, got {value!r}")

        real("min_p", 0.0, 1.0)
        real("repetition_penalty", 0.0, math.inf, low_open=True)
        real("presence_penalty", -2.0, 2.0)
        real("frequency_penalty", -2.0, 2.0)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_new_tokens / max_tokens "
                f"({self.max_new_tokens})"
            )
        bias = self.logit_bias
        if bias is None:
            bias = ()
        items = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = [(k, v) for k, v in items]
        except (TypeError, ValueError):
            raise ValueError(
                f"logit_bias must map token ids to biases, got {self.logit_bias!r}"
            ) from None
        if len(pairs) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(pairs)}")
        for token, value in pairs:
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if (
                isinstance(value, bool)
                or not isinstance(value, number)
                or not math.isfinite(value)
                or abs(value) > LOGIT_BIAS_RANGE
            ):
                raise ValueError(
                    f"a logit_bias value must be a number in [-100, 100], got {value!r} "
                    f"for token {token}"
                )
        if len({t for t, _ in pairs}) != len(pairs):
            raise ValueError("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(v)) for t, v in pairs)))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}"
                )
        spec = self.structured_outputs
        if isinstance(spec, dict):  # vLLM's field names
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**spec))
        elif spec is not None and not isinstance(spec, StructuredOutputsParams):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams (or a dict of its "
                f"fields), got {type(spec).__name__}"
            )
        self._check_bad_words()
        if not _is_int(self.n) or not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {self.n!r}")
        if self.best_of is not None and (
            not _is_int(self.best_of) or not self.n <= self.best_of <= MAX_CHOICES
        ):
            raise ValueError(
                f"best_of must be an integer in [n, {MAX_CHOICES}] (n = {self.n}), got "
                f"{self.best_of!r}"
            )
        if self.best_of is not None and self.best_of > 1 and self.temperature == 0:
            raise ValueError(
                "best_of > 1 needs sampling (temperature > 0): greedy candidates are all the "
                "same output"
            )
        procs = self.logits_processors
        procs = (procs,) if callable(procs) else tuple(procs or ())
        if not all(callable(p) for p in procs):
            raise ValueError("logits_processors must be callables f(output_ids, logits)")
        object.__setattr__(self, "logits_processors", procs)

    def _check_bad_words(self) -> None:
        words = self.bad_words
        words = (words,) if isinstance(words, str) else tuple(words or ())
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(f"at most {MAX_BAD_WORDS} bad_words, got {len(words)}")
        for i, word in enumerate(words):
            if not isinstance(word, str) or not word:
                raise ValueError(f"bad_words must be non-empty strings, got {word!r}")
            check_text(word, f"bad word {i}")
        object.__setattr__(self, "bad_words", words)
        try:
            seqs = tuple(tuple(s) for s in (self.bad_words_token_ids or ()))
        except TypeError:
            raise ValueError("bad_words_token_ids must be a list of token id lists") from None
        if len(seqs) > MAX_BAD_WORDS:
            raise ValueError(f"at most {MAX_BAD_WORDS} bad_words_token_ids, got {len(seqs)}")
        for seq in seqs:
            if not seq or not all(_is_int(t) and t >= 0 for t in seq):
                raise ValueError(
                    f"bad_words_token_ids entries must be non-empty lists of token ids, got {seq!r}"
                )
        object.__setattr__(self, "bad_words_token_ids", tuple(dict.fromkeys(seqs)))

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """Whether a row's logits depend on the tokens before it (penalties,
        ``min_tokens``, user processors, a grammar): verification then hands each row its
        history."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_tokens > 0
            or bool(self.logits_processors)
            or self.structured_outputs is not None
            or bool(self.bad_words_token_ids)
        )

    @property
    def transforms_logits(self) -> bool:
        """Whether :func:`specdec.sampling.process_logits` changes anything (before
        temperature): a bias, a penalty, ``min_tokens`` or a processor."""
        return self.needs_history or bool(self.logit_bias)


#: ``SpeculativeConfig.num_speculative_tokens`` when not given (the draft length k).
DEFAULT_NUM_SPECULATIVE_TOKENS = 5
#: The most ``SpeculativeConfig.num_speculative_tokens`` may be (the server's limit too):
#: a verification forward of that many rows already costs several plain steps on a CPU,
#: and a larger value is a typo (such as ``100000``) more often than a draft length.
MAX_NUM_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which drafter proposes tokens, with which options, and how many per step.

    Args:
        method: a registered drafter (see :mod:`specdec.registry`), optionally with its
            options: ``"none"`` (plain autoregressive decoding through the same loop),
            ``"ngram"`` (prompt lookup), ``"draft-model"`` (a smaller causal LM),
            ``"suffix"`` (SuffixDecoding), ``"recycling"`` (Token Recycling), ... or
            ``"suffix:max_depth=32,global_cache=false"``. ``"custom"`` means the drafter
            object given to :class:`specdec.LLM` as ``drafter=``.
        num_speculative_tokens: most draft tokens per verification step (γ, an integer
            from 1 to :data:`MAX_NUM_SPECULATIVE_TOKENS`, 64).
            Ignored for ``"none"``. Each step drafts at most the remaining token budget
            minus one, so a large value allocates nothing it cannot use.
        options: the drafter's options: its options dataclass (e.g.
            :class:`~specdec.drafters.options.NgramOptions`), a mapping, or ``None`` for
            the defaults (or those written in ``method``). Stored as the dataclass.
        draft_model: name or path of the draft model for ``"draft-model"`` (see
            :func:`specdec.models.load`); may instead be given to :class:`specdec.LLM` as
            an already loaded model.
        tree: draft a token tree per step instead of a chain: a :class:`TreeSpec` or its
            string form, e.g. ``"dynamic:top_k=4,depth=5,budget=16"``,
            ``"static:tree-16"``, ``"best-first:budget=16,depth=6"``,
            ``"sequoia:budget=16,depth=6"`` (see :mod:`specdec.trees.spec`). The tree's
            own depth then replaces ``num_speculative_tokens``.
        controller: how many tokens each step drafts (see :mod:`specdec.control`): a
            registered controller, optionally with options: ``"fixed"`` (always
            ``num_speculative_tokens``, the default), ``"heuristic"``, ``"confidence"``,
            ``"cost"``, ``"bandit"``, e.g. ``"cost:decay=0.9"``. ``num_speculative_tokens``
            (or the tree's depth) is then the most a step drafts. Stored as the name;
            the options go to ``controller_options``.
        controller_options: the controller's options dataclass or a mapping (``None``:
            defaults, or those written in ``controller``).
        verifier: how a sampled chain is verified (see :data:`VERIFIERS`): ``"rejection"``
            (token-wise rejection sampling, Leviathan et al. 2023; the default) or
            ``"block"`` (block verification, Sun et al. 2024: the same law, at least as
            many tokens kept per step; chains only); or the LOSSY
            ``"typical[:epsilon=E,delta=D]"`` (Medusa-2's typical acceptance, see
            :mod:`specdec.verify.typical`; chains only, needs ``allow_lossy``). Greedy
            decoding matches the argmax either way (lossless); token trees use their
            multi-draft verifiers.
        allow_lossy: opt in to a lossy verifier: sampled output then no longer follows the
            target's distribution (default False: refused).

    Raises:
        ValueError: unknown drafter or option, a bad option value, options both in
            ``method`` and ``options``, num_speculative_tokens < 1, a bad tree spec, an
            unknown controller or controller option, a
            tree with method ``"none"``, or sampled children (``draw=iid`` / ``wor``) with
            a drafter that has no distribution.
    """

    method: str = "ngram"
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    options: object = None
    draft_model: str | None = None
    tree: TreeSpec | str | None = None
    controller: str = "fixed"
    controller_options: object = None
    verifier: str = "rejection"
    allow_lossy: bool = False

    def __post_init__(self) -> None:
        from specdec import registry  # the registry's drafters import this module

        vname, _ = parse_verifier(self.verifier)
        if vname in LOSSY_VERIFIERS and not self.allow_lossy:
            raise ValueError(
                f"verifier {vname!r} is lossy: sampled output no longer follows the target's "
                "distribution; opt in with allow_lossy=True"
            )

        if not isinstance(self.controller, str):
            raise ValueError(f"controller must be a string, got {self.controller!r}")
        cname, cwritten = registry.parse_spec(self.controller)
        if cwritten and self.controller_options is not None:
            raise ValueError("give controller options in controller or controller_options")
        object.__setattr__(self, "controller", cname)
        object.__setattr__(
            self,
            "controller_options",
            registry.make_controller_options(cname, cwritten or self.controller_options),
        )

        if not isinstance(self.method, str):
            raise ValueError(f"method must be a string, got {self.method!r}")
        name, written = registry.parse_spec(self.method)
        if written and self.options is not None:
            raise ValueError("give drafter options in method or in options, not both")
        object.__setattr__(self, "method", name)
        if name == CUSTOM:
            if written or self.options is not None:
                raise ValueError("a custom drafter takes no options here (configure the object)")
            samples = True  # unknown: the drafter object decides
        else:
            entry = registry.drafter_entry(name)
            object.__setattr__(
                self, "options", registry.make_options(name, written or self.options)
            )
            registry.check_ready(name, self.options)  # needs without a model
            samples = entry.samples
        if self.tree is not None:
            try:
                object.__setattr__(self, "tree", TreeSpec.parse(self.tree))
            except ValueError as error:
                raise TreeSpecError(f"tree {self.tree!r}: {error}") from None
            if name == "none":
                raise ValueError("a token tree needs a drafter (method 'none' has none)")
            if self.tree.draw != "top" and not samples:
                raise ValueError(
                    f"draw={self.tree.draw} samples children from a draft distribution; "
                    f"drafter {name!r} has none (use draw=top)"
                )
        if vname != "rejection" and self.tree is not None:
            raise ValueError(
                f"verifier {vname!r} verifies chains; a token tree is verified by its "
                "multi-draft rule (use verifier 'rejection' with a tree)"
            )
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an integer from 1 to "
                f"{MAX_NUM_SPECULATIVE_TOKENS}, got {k!r}"
            )

    @property
    def lossy(self) -> bool:
        """Whether the verifier is lossy (sampled output does not follow the target)."""
        return parse_verifier(self.verifier)[0] in LOSSY_VERIFIERS

    @property
    def spec(self) -> str:
        """The drafter as a spec string: ``method`` plus non-default options."""
        if self.options is None:
            return self.method
        from specdec.registry import options_string

        extra = options_string(self.options)
        return f"{self.method}:{extra}" if extra else self.method

    @property
    def controller_spec(self) -> str:
        """The controller as a spec string: its name plus non-default options."""
        from specdec.registry import options_string

        extra = options_string(self.controller_options)
        return f"{self.controller}:{extra}" if extra else self.controller
