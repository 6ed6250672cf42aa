"""The public entry point: ``LLM(model, draft=..., speculative=...).generate(prompt, params)``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.drafters.base import Drafter, NoDrafter
from specdec.drafters.draft_model import DraftModelDrafter, check_vocab_compatible
from specdec.drafters.ngram import NgramDrafter
from specdec.engine.generate import generate_steps
from specdec.engine.stops import StopChecker
from specdec.metrics import SpecStats
from specdec.models.base import Backend
from specdec.models.loading import BACKENDS, DEFAULT_BACKEND, DEFAULT_MODEL, INT8_DYNAMIC, load
from specdec.sampling import make_generator
from specdec.tokenizer import Tokenizer
from specdec.trees.builders import TreeBuilder, make_tree_builder

Prompt = str | list[dict] | list[int]


@dataclass
class GenerationOutput:
    """Result of one generation.

    Attributes:
        text: generated text (special tokens and anything from a stop on removed).
        token_ids: generated token ids (a stop token, e.g. EOS, is kept as the last id).
        prompt_token_ids: the prompt as the target saw it (after the chat template).
        finish_reason: ``"stop"`` (EOS / end-of-turn / stop token / stop string) or
            ``"length"`` (max_new_tokens or the model's context).
        metrics: :class:`SpecStats` of this generation.
    """

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    metrics: SpecStats = field(repr=False)

    def to_dict(self) -> dict:
        """JSON-ready dict: ``text``, ``token_ids``, ``finish_reason``, ``metrics``."""
        return {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "metrics": self.metrics.to_dict(),
        }


@dataclass
class GenerationChunk:
    """A streamed piece: new text and ids; the last chunk also carries the full output."""

    text: str
    token_ids: list[int]
    output: GenerationOutput | None = None


class LLM:
    """A target model with a drafter: speculative generation with unchanged output.

    Args:
        model: target model name/path (see :func:`specdec.models.load`) or a loaded
            backend (:class:`~specdec.models.HFModel`, :class:`~specdec.models.NativeModel`).
            Default: the embedded SmolLM2-135M-Instruct.
        draft: draft model (name/path or loaded) for ``method="draft-model"``.
        speculative: drafter settings; default ``ngram`` (or ``draft-model`` when
            ``draft`` is given).
        dtype, device: for models loaded by name.
        backend: ``"hf"`` (transformers), ``"native"`` (specdec's runtime) or ``"auto"``
            for models loaded by name (see :func:`specdec.models.load`); it applies to the
            draft too, except that an ``int8-dynamic`` draft always runs on transformers.
        exact: native backend: batch-invariant forwards (default on).
        draft_dtype: dtype of a draft loaded by name (default: ``dtype``); e.g.
            ``"int8-dynamic"`` for a cheaper quantized copy of the target as draft.

    Raises:
        ValueError: invalid configuration, or a draft whose vocabulary differs from the
            target's.

    Example:
        >>> llm = LLM(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=8))
        >>> out = llm.generate("Repeat: the cat sat on the mat.", SamplingParams(max_new_tokens=32))
        >>> out.text, out.metrics.mean_acceptance_length  # doctest: +SKIP
    """

    def __init__(
        self,
        model: str | Backend = DEFAULT_MODEL,
        draft: str | Backend | None = None,
        speculative: SpeculativeConfig | None = None,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        draft_dtype: str | None = None,
        backend: str = DEFAULT_BACKEND,
        exact: bool = True,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if speculative is None:
            speculative = SpeculativeConfig(method="draft-model" if draft is not None else "ngram")
        self.speculative = speculative
        self._dtype, self._device = dtype, device
        self._draft_dtype = draft_dtype or dtype
        self._backend, self._exact = backend, exact
        self.target: Backend = (
            load(model, dtype, device, backend, exact) if isinstance(model, str) else model
        )
        self.tokenizer: Tokenizer = self.target.tokenizer
        self._draft_source = draft
        self._draft: Backend | None = None
        self._drafters: dict[SpeculativeConfig, Drafter] = {}
        self._tree_builders: dict[SpeculativeConfig, TreeBuilder] = {}
        self.drafter(speculative)  # load and check the draft now, not mid-generation

    def drafter(self, config: SpeculativeConfig) -> Drafter:
        """The drafter for ``config`` (built once per config; a draft model loads once)."""
        if config not in self._drafters:
            self._drafters[config] = self._build_drafter(config)
        return self._drafters[config]

    def tree_builder(
        self, config: SpeculativeConfig, seed: int | None = None
    ) -> TreeBuilder | None:
        """The tree builder for a generation with ``config`` (``None`` for chains).

        Unseeded generations share one builder per config, so what a learning builder
        measures (Sequoia's per-rank acceptance) carries over from one generation to the
        next. A seeded generation gets a fresh builder that starts from the prior and
        learns only from its own steps: its output then depends on its prompt, parameters
        and seed alone, never on what ran before it.
        """
        if config.tree is None:
            return None
        if seed is not None:
            return make_tree_builder(config.tree)
        if config not in self._tree_builders:
            self._tree_builders[config] = make_tree_builder(config.tree)
        return self._tree_builders[config]

    def _build_drafter(self, config: SpeculativeConfig) -> Drafter:
        if config.method == "none":
            return NoDrafter()
        if config.method == "ngram":
            return NgramDrafter(config.ngram_min, config.ngram_max)
        draft = self._load_draft(config)
        return DraftModelDrafter(draft, self.target.vocab_size, len(self.tokenizer))

    def _load_draft(self, config: SpeculativeConfig) -> Backend:
        source = config.draft_model or self._draft_source
        if source is None:
            raise ValueError(
                "method 'draft-model' needs a draft model (--draft-model on the command "
                "line; draft=... or draft_model=... in Python)"
            )
        if not isinstance(source, str):
            draft = source
        elif self._draft is not None and self._draft.name == source:
            draft = self._draft
        else:
            backend = self._backend
            if backend == "native" and str(self._draft_dtype).lower() == INT8_DYNAMIC:
                backend = "auto"  # an int8 draft runs on transformers; the log says so
            draft = load(source, self._draft_dtype, self._device, backend, self._exact)
        check_vocab_compatible(self.target, draft)
        self._draft = draft
        return draft

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Prompt -> token ids (chat template for strings when the model has one).

        Raises:
            ValueError: empty prompt or token ids outside the vocabulary.
        """
        if not isinstance(prompt, (str, list, tuple)):
            raise ValueError(
                "prompt must be a string, a list of chat messages or a list of token ids, "
                f"got {type(prompt).__name__}"
            )
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt is empty")
            return self.tokenizer.encode(prompt, chat)
        if not prompt:
            raise ValueError("prompt is empty")
        if all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids outside the vocabulary: {bad[:5]}")
            return list(prompt)
        if all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.encode(prompt, chat)
        raise ValueError("prompt must be a string, a list of chat messages or a list of token ids")

    def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        speculative: SpeculativeConfig | None = None,
        chat: bool | None = None,
    ) -> GenerationOutput:
        """Generate a completion.

        Args:
            prompt: a user message (str; chat template applied when the model has one and
                ``chat`` is not False), a list of chat messages, or prompt token ids.
            sampling_params: defaults to greedy with 256 new tokens.
            speculative: override the LLM's drafter settings for this call
                (e.g. ``SpeculativeConfig(method="none")`` for the plain baseline).
            chat: force the chat template on/off for string prompts.

        Returns:
            :class:`GenerationOutput`.

        Raises:
            ValueError: empty prompt, a prompt that fills the model's context, bad ids.
        """
        params = sampling_params or SamplingParams()
        prompt_ids, steps = self._steps(prompt, params, speculative, chat)
        ids: list[int] = []
        for step in steps:  # no per-step detokenization: the text is built once at the end
            ids.extend(step.new_token_ids)
        text = _final_text(self.tokenizer, ids, step)
        return GenerationOutput(text, ids, prompt_ids, step.finish_reason, step.stats)

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        speculative: SpeculativeConfig | None = None,
        chat: bool | None = None,
    ) -> Iterator[GenerationChunk]:
        """Like :meth:`generate`, yielding text as it is produced (one chunk per step).

        Text that could still become part of a stop string, or an incomplete UTF-8
        character, is held back until it is settled, so nothing after a stop is ever
        yielded.
        """
        params = sampling_params or SamplingParams()
        prompt_ids, steps = self._steps(prompt, params, speculative, chat)
        yield from _stream_text(self.tokenizer, prompt_ids, steps, params)

    def _steps(self, prompt: Prompt, params: SamplingParams, speculative, chat):
        """Encode the prompt and start the engine's step iterator."""
        config = speculative or self.speculative
        prompt_ids = self.encode(prompt, chat)
        steps = generate_steps(
            self.target,
            self.drafter(config),
            prompt_ids,
            params,
            0 if config.method == "none" else config.num_speculative_tokens,
            self._stop_checker(params),
            make_generator(params.seed, self.target.device),
            self.tree_builder(config, params.seed),
        )
        return prompt_ids, steps

    def _stop_checker(self, params: SamplingParams) -> StopChecker:
        outside = [t for t in params.stop_token_ids if t >= self.target.vocab_size]
        if outside:
            raise ValueError(
                f"stop_token_ids outside the vocabulary ({self.target.vocab_size} tokens): "
                f"{outside[:5]}"
            )
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.tokenizer.eos_token_ids
        return StopChecker(stop_ids, params.stop, self.tokenizer.decode)


def _stream_text(tokenizer: Tokenizer, prompt_ids: list[int], steps, params: SamplingParams):
    """Turn engine steps into text chunks (incremental detokenization)."""
    holdback = max((len(s) for s in params.stop), default=1) - 1
    ids: list[int] = []
    sent = 0
    for step in steps:
        ids.extend(step.new_token_ids)
        if step.finish_reason is None:
            text = complete_text(tokenizer.decode(ids))
            end = max(sent, len(text) - holdback)
            yield GenerationChunk(text[sent:end], list(step.new_token_ids))
            sent = end
            continue
        text = _final_text(tokenizer, ids, step)
        output = GenerationOutput(text, ids, prompt_ids, step.finish_reason, step.stats)
        yield GenerationChunk(text[sent:], list(step.new_token_ids), output)


def _final_text(tokenizer: Tokenizer, ids: Sequence[int], step) -> str:
    """The output text: up to a stop string, without a stop token, and without the
    incomplete character a generation may end inside (see :func:`complete_text`)."""
    if step.text_end is not None:
        return complete_text(tokenizer.decode(ids)[: step.text_end])
    if step.finish_reason == "stop":  # ended by a stop token: it is not part of the text
        return complete_text(tokenizer.decode(ids[:-1]))
    return complete_text(tokenizer.decode(ids))


def complete_text(text: str) -> str:
    """Drop a trailing incomplete character.

    A byte-level tokenizer can stop inside a multi-byte UTF-8 character (a token may carry
    only its first bytes); decoding then ends in U+FFFD, the replacement character. As in
    the incremental detokenizers of vLLM and text-generation-inference, trailing U+FFFD is
    taken as such an incomplete tail: it is held back while streaming and dropped from the
    final text (the token ids keep every token).

    Example:
        >>> complete_text("apples and bananas \ufffd")
        'apples and bananas '
    """
    return text.rstrip("\ufffd")
