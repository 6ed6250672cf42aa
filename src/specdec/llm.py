"""The public entry point: ``LLM(model, draft=..., speculative=...).generate(prompt, params)``."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from specdec import registry
from specdec.config import (
    CUSTOM,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    SamplingParams,
    SpeculativeConfig,
    choice_seed,
)
from specdec.control.base import SpeculationController
from specdec.control.cost import CostModel
from specdec.drafters.base import Drafter, check_drafter
from specdec.drafters.prediction import PredictionDrafter
from specdec.engine.engine import (
    Engine,
    EngineConfig,
    check_invariant_prefill,
    check_prompt_fits,
    new_prefix_cache,
    prefix_block_size,
)
from specdec.engine.generate import generate_steps
from specdec.engine.prefix_cache import PrefixCache
from specdec.engine.stops import StopChecker, stop_reason
from specdec.machine import warn_once_if_busy
from specdec.metrics import SpecStats
from specdec.models.base import Backend
from specdec.models.loading import (
    BACKENDS,
    DEFAULT_BACKEND,
    DEFAULT_DTYPE,
    DEFAULT_MODEL,
    DEFAULT_QUANTIZATION,
    INT8_DYNAMIC,
    check_quantization,
    load,
    parse_device,
)
from specdec.sampling import NoAllowedToken, TokenLogprob, make_generator
from specdec.structured import GrammarCompiler, GrammarState
from specdec.text import TextStream, final_text
from specdec.tokenizer import Tokenizer
from specdec.tools import check_tools, template_tool_calls
from specdec.trees.builders import TreeBuilder, make_tree_builder
from specdec.unicode import check_text

Prompt = str | list[dict] | list[int] | dict

#: Fewest draft tokens per step a prediction drafts (the configured k when larger).
PREDICTION_K = 16

logger = logging.getLogger(__name__)


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
        logprobs: with ``SamplingParams.logprobs``, one
            :class:`~specdec.sampling.TokenLogprob` per token id (the target's raw
            log-probabilities; the same with speculation as without), else ``None``.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, one entry per prompt
            token: ``None`` for the first, then a
            :class:`~specdec.sampling.TokenLogprob` (the raw target distribution given the
            tokens before it); else ``None``.
        accepted_prediction_tokens, rejected_prediction_tokens: with a ``prediction``
            (Predicted Outputs), OpenAI's counts: prediction tokens the output holds where
            a draft proposed them, and the rest of the prediction (see
            :meth:`~specdec.drafters.prediction.PredictionDrafter.usage`); else ``None``.
        prompt: the prompt as given when it was text (a string, or vLLM's
            ``{"prompt": text}``), else ``None`` (token ids, chat messages), as vLLM's
            ``RequestOutput.prompt``.
        index: the choice's rank among its prompt's ``n`` outputs (0 without ``n``).
        stop_reason: vLLM's: the stop string or requested stop token id that ended the
            output; ``None`` for EOS / end-of-turn, the length limit or a completed
            grammar (:func:`~specdec.engine.stops.stop_reason`).
        request_id: vLLM's ``RequestOutput.request_id``: the LLM's count of prompts it
            has generated for, as a string (``"0"``, ``"1"``, ...; a prompt's ``n``
            choices share one); ``""`` for an output not from :meth:`LLM.generate`,
            :meth:`LLM.chat` or :meth:`LLM.stream`.

    vLLM's shape reads too: ``out.outputs[0].text`` (:attr:`outputs` is ``[out]``: one
    output is its own only choice), ``out.finished``, ``out.request_id``,
    ``out.num_cached_tokens``, ``out.outputs[0].cumulative_logprob``.
    """

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    metrics: SpecStats = field(repr=False)
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)
    accepted_prediction_tokens: int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = field(default=None, repr=False)
    rejected_prediction_tokens: int | None = None
    prompt: str | None = field(default=None, repr=False)
    index: int = 0
    stop_reason: str | int | None = None
    request_id: str = field(default="", repr=False)

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's ``CompletionOutput.cumulative_logprob``: the sum of the output tokens'
        log-probabilities (the target's raw ones, :attr:`logprobs`) when
        ``SamplingParams.logprobs`` asked for them, else ``None`` (as in vLLM)."""
        return None if self.logprobs is None else sum(t.logprob for t in self.logprobs)

    @property
    def num_cached_tokens(self) -> int:
        """vLLM's ``RequestOutput.num_cached_tokens``: prompt tokens taken from the prefix
        cache (:attr:`SpecStats.num_cached_tokens`; 0 without prefix caching)."""
        return self.metrics.num_cached_tokens

    @property
    def outputs(self) -> list[GenerationOutput]:
        """vLLM's ``RequestOutput.outputs``: ``[self]`` (``.text``, ``.token_ids``,
        ``.finish_reason``, ``.logprobs`` and ``.index`` read as vLLM's
        ``CompletionOutput``'s do; ``logprobs`` holds specdec's
        :class:`~specdec.sampling.TokenLogprob`, not vLLM's dicts)."""
        return [self]

    @property
    def finished(self) -> bool:
        """vLLM's ``RequestOutput.finished``: always ``True`` (``generate`` returns finished
        outputs; :meth:`LLM.stream` streams)."""
        return True

    def to_dict(self) -> dict:
        """JSON-ready dict: ``text``, ``token_ids``, ``finish_reason``, ``prompt_tokens``
        (the prompt's length as the target saw it, chat template included), ``metrics``,
        and ``logprobs`` (``[{"token_id", "logprob", "top": [[id, logprob], ...]}]``) when
        asked for."""
        out = {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_token_ids),
            "metrics": self.metrics.to_dict(),
        }
        if self.logprobs is not None:
            out["logprobs"] = [
                {"token_id": t.token_id, "logprob": t.logprob, "top": [list(p) for p in t.top]}
                for t in self.logprobs
            ]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [
                None
                if t is None
                else {"token_id": t.token_id, "logprob": t.logprob, "top": [list(p) for p in t.top]}
                for t in self.prompt_logprobs
            ]
        if self.accepted_prediction_tokens is not None:
            out["accepted_prediction_tokens"] = self.accepted_prediction_tokens
            out["rejected_prediction_tokens"] = self.rejected_prediction_tokens
        return out

    def _with_prediction(self, drafter: PredictionDrafter | None) -> GenerationOutput:
        if drafter is not None:
            accepted, rejected = drafter.usage(self.token_ids)
            self.accepted_prediction_tokens = accepted
            self.rejected_prediction_tokens = rejected
        return self


class Choices(list):
    """The ``n`` outputs of one prompt (``SamplingParams(n > 1)``): a list of
    :class:`GenerationOutput`, best first with ``best_of``, each with its ``index``. Read
    as vLLM's ``RequestOutput`` too: :attr:`outputs` (the list itself),
    :attr:`prompt`, :attr:`prompt_token_ids`, :attr:`finished`, :attr:`request_id`,
    :attr:`num_cached_tokens`."""

    @property
    def outputs(self) -> list[GenerationOutput]:
        return list(self)

    @property
    def prompt(self) -> str | None:
        return self[0].prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        return self[0].prompt_token_ids

    @property
    def finished(self) -> bool:
        return True

    @property
    def request_id(self) -> str:
        return self[0].request_id

    @property
    def num_cached_tokens(self) -> int:
        return self[0].num_cached_tokens


@dataclass
class GenerationChunk:
    """A streamed piece: new text and ids; the last chunk also carries the full output.

    Attributes:
        text: text settled by this step (may be ``""`` while a stop string or a character
            is incomplete).
        token_ids: the step's new token ids.
        output: the whole :class:`GenerationOutput`, on the last chunk only.
        metrics: the generation's running :class:`SpecStats` (the same object every
            chunk), so a caller that stops early (Ctrl-C) still has the counts so far.
        logprobs: with ``SamplingParams.logprobs``, the step's new tokens'
            :class:`~specdec.sampling.TokenLogprob` (one per id in ``token_ids``).
    """

    text: str
    token_ids: list[int]
    output: GenerationOutput | None = None
    metrics: SpecStats | None = field(default=None, repr=False)
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)


#: Drafters an :class:`LLM` keeps besides its own (the most recently built; one per config).
DRAFTERS = 16
#: Tree builders an :class:`LLM` keeps (the most recently built; each learns per config).
TREE_BUILDERS = 64


def _drafter_key(config: SpeculativeConfig) -> tuple:
    """What a drafter is built from: its method, options and draft model (configs that
    differ in k, tree, controller or verifier get their own drafter object of the same
    drafter, and :meth:`LLM._tell_cap` warns once for all of them)."""
    return (config.method, config.options, config.draft_model)


class LLM:
    """A target model with a drafter: speculative generation with unchanged output.

    Args:
        model: target model name/path (see :func:`specdec.models.load`) or a loaded
            backend (:class:`~specdec.models.HFModel`, :class:`~specdec.models.NativeModel`).
            Default: the embedded SmolLM2-135M-Instruct.
        draft: draft model (name/path or loaded) for ``method="draft-model"``.
        speculative: drafter settings (a :class:`SpeculativeConfig`, or a dict of its
            fields as vLLM's ``speculative_config``); default ``ngram`` (or
            ``draft-model`` when ``draft`` is given, ``custom`` when ``drafter`` is).
        speculative_config: vLLM's name for ``speculative`` (the same values; give one of
            the two).
        drafter: your own :class:`~specdec.drafters.Drafter` object (see
            :class:`~specdec.drafters.DrafterBase`); configs with ``method="custom"`` use
            it. Its output is verified like any drafter's, so it cannot change what is
            generated, only how fast.
        dtype: for models loaded by name; ``"auto"`` (default) is bfloat16 where the
            hardware runs it faster, else float32
            (:func:`specdec.models.loading.resolve_dtype`).
        device: for models loaded by name (``"cpu"``, ``"cuda"``, ...).
        backend: ``"auto"`` (default: specdec's runtime where it supports the model, else
            transformers, logged), ``"native"`` or ``"hf"`` for models loaded by name (see
            :func:`specdec.models.load`); it applies to the draft too, except that an
            ``int8-dynamic`` draft always runs on transformers.
        exact: native backend: batch-invariant forwards (default on).
        draft_dtype: dtype of a draft loaded by name (default: ``dtype``); e.g.
            ``"int8-dynamic"`` (transformers' int8 layers; slow beside a native target,
            and on the embedded model it agreed with the target on only 37% of draft
            tokens: for a cheaper copy of the target use ``method="quantized"``).
        draft_device: device of a draft loaded by name (default: ``device``), e.g.
            ``"cpu"`` beside a ``"cuda"`` target (DuoDecoding's setting; with
            ``draft-model:overlap=true`` the CPU drafts while the GPU verifies). A draft
            passed as a model object stays where it is.
        quantization: native backend, models loaded by name: weight-only quantized
            products (:func:`specdec.models.load`): ``"auto"`` (default: a GGUF model runs
            its own Q4_1 / Q8_0 blocks), ``"none"``, ``"gguf"``, ``"q8_0"`` or ``"q4_1"``.
            Drafts loaded by name stay dense.
        engine_config: batching limits (:class:`~specdec.engine.EngineConfig`); the same
            limits apply to single generations, so a batch gives each prompt the output it
            gets alone.

    Thread safety: any number of threads may call :meth:`generate` and :meth:`stream` on
    one ``LLM``; steps run one at a time.

    Raises:
        ValueError: invalid configuration, or (``draft-model:tokenizers=shared``) a draft
            whose vocabulary differs from the target's.

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
        drafter: Drafter | None = None,
        dtype: str = DEFAULT_DTYPE,
        device: str = "cpu",
        draft_dtype: str | None = None,
        draft_device: str | None = None,
        backend: str = DEFAULT_BACKEND,
        exact: bool = True,
        engine_config: EngineConfig | None = None,
        quantization: str = DEFAULT_QUANTIZATION,
        speculative_config: SpeculativeConfig | dict | None = None,
    ) -> None:
        if speculative_config is not None:  # vLLM's name for the same argument
            if speculative is not None:
                raise ValueError(
                    "give speculative or speculative_config (vLLM's name for it), not both"
                )
            speculative = speculative_config
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if drafter is not None:
            check_drafter(drafter)
        if speculative is None:
            method = CUSTOM if drafter is not None else "ngram"
            speculative = SpeculativeConfig(method="draft-model" if draft is not None else method)
        speculative = _speculative_config(speculative)
        self._custom = drafter
        self.speculative = speculative
        self._dtype, self._device = dtype, device
        self._draft_dtype = draft_dtype or dtype
        self._draft_device = draft_device or device
        if draft_device is not None:
            parse_device(draft_device, "draft_device")  # refused before the target loads
        self._backend, self._exact = backend, exact
        check_quantization(quantization, backend)
        if isinstance(model, str) and device == "cpu":
            import torch

            warn_once_if_busy(logger, torch.get_num_threads())  # once per process
        self.target: Backend = (
            load(model, dtype, device, backend, exact, quantization)
            if isinstance(model, str)
            else model
        )
        self.tokenizer: Tokenizer = self.target.tokenizer
        self._draft_source = draft
        self._draft: Backend | None = None
        self._drafters: OrderedDict[SpeculativeConfig, Drafter] = OrderedDict()
        self._told_cap: set[tuple] = set()  # drafter keys warned about their longest draft
        self._tree_builders: OrderedDict[SpeculativeConfig, TreeBuilder] = OrderedDict()
        self._controllers: dict[tuple, SpeculationController] = {}
        self.engine_config = engine_config or EngineConfig()
        self._prefix_cache: PrefixCache | None = None
        self.prefix_cache()  # refused now on a backend that cannot share prompt KV
        if self.engine_config.invariant_prefill:
            check_invariant_prefill(self.target)
        #: what verification forwards and drafts cost here, learned from every generation
        #: (the adaptive controllers read it; see :mod:`specdec.control.cost`)
        self.cost_model = CostModel()
        #: compiles ``SamplingParams.structured_outputs`` for this tokenizer (llguidance's
        #: tokenizer is built on the first structured request)
        self.grammars = GrammarCompiler(
            self.tokenizer.hf, self.target.vocab_size, self.tokenizer.eos_token_ids
        )
        # One step at a time on this LLM (models, drafters and builders are shared); held
        # per step, never across a yield, so interleaved streams in one thread work.
        self._lock = threading.RLock()
        self._request_counter = itertools.count()  # vLLM's request ids: "0", "1", ...
        self.drafter(speculative)  # load and check the draft now, not mid-generation

    def drafter(self, config: SpeculativeConfig) -> Drafter:
        """The drafter for ``config`` (built once per config, so that what a drafter
        learns, such as suffix's global cache, stays with its config: a benchmark's
        methods never see each other's answers); a draft model loads once. The
        :data:`DRAFTERS` most recently built are kept (and the LLM's own), so a server's
        clients varying k or the tree cannot make it hold a drafter, or a head, per value."""
        drafter = self._drafters.get(config)  # no lock on the common path (a server's
        if drafter is None:  # handlers must not wait for a running step)
            with self._lock:
                if config not in self._drafters:
                    self._drafters[config] = self._build_drafter(config)
                    self._tell_cap(config, self._drafters[config])
                    older = [c for c in self._drafters if c not in (config, self.speculative)]
                    for old in older[: max(0, len(self._drafters) - DRAFTERS)]:
                        del self._drafters[old]  # sequences running keep their own reference
                drafter = self._drafters[config]
        return drafter

    def prefix_cache(self) -> PrefixCache | None:
        """The prompt-chunk KV shared by this LLM's generations with
        ``engine_config.enable_prefix_caching`` (``None`` without): one
        :class:`~specdec.engine.PrefixCache`, made again if ``engine_config`` changes its
        block (``prefill_chunk``) or budget.

        Raises:
            ValueError: prefix caching on the transformers backend.
        """
        config = self.engine_config
        if not config.enable_prefix_caching:
            return None
        cache = self._prefix_cache
        if cache is None or (cache.block_size, cache.max_bytes) != (
            prefix_block_size(config),
            config.prefix_cache_bytes,
        ):
            cache = self._prefix_cache = new_prefix_cache(self.target, config)
        return cache

    def controller(self, config: SpeculativeConfig) -> SpeculationController:
        """The speculation controller for ``config`` (one per controller and options, so
        what a learning controller shares across requests carries over)."""
        key = (config.controller, config.controller_options)
        controller = self._controllers.get(key)
        if controller is None:
            with self._lock:
                if key not in self._controllers:
                    entry = registry.controller_entry(config.controller)
                    self._controllers[key] = entry.factory(config.controller_options)
                controller = self._controllers[key]
        return controller

    def reset_drafters(self) -> None:
        """Forget every drafter built so far and what it learned (suffix's global cache,
        recycling's table, layer-skip's search) and every controller's shared statistics; the
        next generation builds fresh ones (the cost model keeps its measurements). A
        loaded draft model stays loaded; your own ``drafter=`` object is kept as it is."""
        with self._lock:
            self._drafters.clear()
            self._controllers.clear()

    def reset_prefix_cache(self) -> bool:
        """Drop every block of the prefix cache (vLLM's ``LLM.reset_prefix_cache``), e.g.
        to time cold prompts again; requests running keep what they hold.

        Returns:
            whether prefix caching is on (``False``: there was nothing to drop).
        """
        with self._lock:
            cache = self.prefix_cache()
            if cache is not None:
                cache.clear()
            return cache is not None

    def has_draft_model(self, config: SpeculativeConfig) -> bool:
        """Whether ``config`` names a draft model or this LLM was given one."""
        return config.draft_model is not None or self._draft_source is not None

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
        builder = self._tree_builders.get(config)  # no lock on the common path (above)
        if builder is not None:
            return builder
        with self._lock:  # the TREE_BUILDERS most recently built (clients vary trees freely)
            if config not in self._tree_builders:
                self._tree_builders[config] = make_tree_builder(config.tree)
                while len(self._tree_builders) > TREE_BUILDERS:
                    self._tree_builders.popitem(last=False)
            return self._tree_builders[config]

    def _build_drafter(self, config: SpeculativeConfig) -> Drafter:
        if config.method == CUSTOM:
            if self._custom is None:
                raise ValueError("method 'custom' needs a drafter object: LLM(..., drafter=...)")
            return self._custom
        entry = registry.drafter_entry(config.method)
        context = registry.DrafterContext(
            self.target, self.tokenizer, lambda: self._load_draft(config)
        )
        return entry.factory(context, config.options)

    def _tell_cap(self, config: SpeculativeConfig, drafter: Drafter) -> None:
        """Say, when ``config``'s drafter is built, that it asks for longer drafts than
        the drafter makes (Medusa's heads, a parallel head's block): as a warning the
        first time per drafter, after that at debug level (a server's clients must not
        fill its log)."""
        most = getattr(drafter, "max_draft_tokens", None)
        if most is None:
            return
        key = _drafter_key(config)
        quiet = logging.DEBUG if key in self._told_cap else logging.WARNING
        cap = (
            "its head's block size" if hasattr(drafter, "block_size")
            else "its head's number of heads" if hasattr(drafter, "num_heads")
            else "its max_draft_tokens"
        )  # fmt: skip
        if config.tree is None and config.num_speculative_tokens > most:
            # the default k was not asked for: say it quietly (a new user's trial found
            # every default run of a head drafter warning about "the 5 asked")
            asked = config.num_speculative_tokens != DEFAULT_NUM_SPECULATIVE_TOKENS
            if asked:
                self._told_cap.add(key)
            logger.log(
                quiet if asked else min(quiet, logging.INFO),
                "%s drafts at most %d tokens a step (%s), not the %d %s "
                "(num_speculative_tokens); chains of %d run",
                config.method, most, cap, config.num_speculative_tokens,
                "asked" if asked else "of the default", most,
            )  # fmt: skip
        elif config.tree is not None:
            depth = make_tree_builder(config.tree).max_depth
            if depth > most:
                self._told_cap.add(key)
                logger.log(
                    quiet,
                    "%s fills at most %d levels of a token tree (%s); the "
                    "tree %s is %d deep, so its deeper levels stay empty",
                    config.method, most, cap, config.tree, depth,
                )  # fmt: skip

    @property
    def loaded_draft(self) -> Backend | None:
        """The draft model loaded for ``draft-model`` drafting (``None`` until a drafter
        needed one)."""
        return self._draft

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
                logger.warning(
                    "the %s draft %s runs on transformers, although the backend is native: "
                    "%s layers are torch's quantized modules; the target runs on %s. For a "
                    "cheaper copy of the target itself, the quantized drafter (--drafter "
                    "quantized, method=\"quantized\") drafts with its own quantized products "
                    "on the native runtime",
                    INT8_DYNAMIC, source, INT8_DYNAMIC, self.target.backend,
                )  # fmt: skip
                backend = "hf"
            draft = load(source, self._draft_dtype, self._draft_device, backend, self._exact)
        self._draft = draft
        return draft

    def encode(
        self,
        prompt: Prompt,
        chat: bool | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Prompt -> token ids (chat template for strings when the model has one).

        A prompt is a string, a list of chat messages, a list of token ids, or vLLM's
        prompt dicts ``{"prompt": text}`` / ``{"prompt_token_ids": ids}`` (read as the
        text, raw as vLLM reads it unless ``chat=True``, or the ids).
        ``add_generation_prompt``, ``continue_final_message`` and
        ``chat_template_kwargs`` apply where the chat template does (see
        :meth:`specdec.tokenizer.Tokenizer.encode`; vLLM's chat arguments), and so do
        ``tools`` (OpenAI's function tools, checked by :func:`specdec.tools.check_tools`).

        Raises:
            ValueError: empty prompt, token ids outside the vocabulary, a prompt dict with
                other keys (or both), ``continue_final_message`` with
                ``add_generation_prompt`` or after a last message that is not the
                assistant's, bad ``chat_template_kwargs``, or bad ``tools``.
        """
        if tools:
            tools = check_tools(tools)
        if isinstance(prompt, dict):
            if "prompt" in prompt and chat is None:  # vLLM's text prompt: raw text
                chat = False
            prompt = _vllm_prompt(prompt)
        if not isinstance(prompt, (str, list, tuple)):
            raise ValueError(
                "prompt must be a string, a list of chat messages or a list of token ids, "
                f"got {type(prompt).__name__}"
            )
        extra = (add_generation_prompt, continue_final_message, chat_template_kwargs)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            self._check_text_length(len(prompt))
            ids = self.tokenizer.encode(prompt, chat, *extra, tools=tools)
            if not ids:  # whitespace is text; a tokenizer that drops it leaves nothing
                raise ValueError(f"prompt {prompt!r} encodes to no tokens")
            return ids
        if not prompt:
            raise ValueError(
                "prompt is empty (an empty list is neither a prompt nor a batch of prompts)"
            )
        if all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids outside the vocabulary: {bad[:5]}")
            return list(prompt)
        if all(isinstance(m, dict) for m in prompt):
            prompt = _text_messages(prompt)
            self._check_text_length(sum(len(m["content"]) for m in prompt))
            return self.tokenizer.encode(prompt, chat, *extra, tools=tools)
        raise ValueError("prompt must be a string, a list of chat messages or a list of token ids")

    def _check_text_length(self, chars: int) -> None:
        """Refuse a text far too long for the context before tokenizing it: tokenizing 16 MB
        of text took about 20 s (and held a server's event loop that long). A prompt of C
        characters (message contents summed) has at least ``C / max_token_chars`` tokens
        (:attr:`~specdec.tokenizer.Tokenizer.max_token_chars`); texts over twice that bound
        are refused, so no prompt that fits is (a margin for tokenizers that normalize the
        text). Longer prompts that still cannot fit are refused after tokenizing, as
        before.

        Raises:
            ValueError: the text is over ``2 * max_token_chars * max_context`` characters.
        """
        context = self.target.max_context
        per_token = 2 * self.tokenizer.max_token_chars
        if chars > per_token * context:
            raise ValueError(
                f"the prompt has {chars} characters, at least {chars // per_token} tokens; "
                f"this model's context is {context} tokens"
            )

    def get_tokenizer(self):
        """vLLM's ``LLM.get_tokenizer``: the target's Hugging Face tokenizer
        (``transformers.PreTrainedTokenizerBase``; specdec's own wrapper is
        :attr:`tokenizer`)."""
        return self.tokenizer.hf

    def generate(
        self,
        prompts: Prompt | list[Prompt] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        speculative: SpeculativeConfig | list[SpeculativeConfig] | None = None,
        chat: bool | None = None,
        prediction: str | list[int] | list | None = None,
        use_tqdm: bool = False,
        prompt: Prompt | list[Prompt] | None = None,
    ) -> GenerationOutput | list[GenerationOutput]:
        """Generate a completion, or one per prompt of a batch.

        Args:
            prompts: (vLLM's name; ``prompt=`` is accepted too) a user message (str;
                chat template applied when the model has one and ``chat`` is not False),
                a list of chat messages, prompt token ids, or
                vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``; or a
                *batch*: a list of such prompts (a list of strings, of token-id lists, of
                message lists or of prompt dicts), run together by the batched engine.
            sampling_params: defaults to greedy with 256 new tokens; for a batch, one for
                all or a list with one per prompt.
            speculative: override the LLM's drafter settings for this call
                (e.g. ``SpeculativeConfig(method="none")`` for the plain baseline); for a
                batch, one for all or a list with one per prompt.
            chat: force the chat template on/off for string prompts.
            prediction: OpenAI's Predicted Outputs: the expected output (text, or token
                ids), drafted from by prompt lookup instead of the configured drafter
                (:class:`~specdec.drafters.prediction.PredictionDrafter`; chains of up to
                ``max(num_speculative_tokens, 16)`` tokens, the configured controller and
                verifier).
                Lossless: it changes speed only. The output then reports
                ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``. For a
                batch, a list with one per prompt (``None`` for none).
            use_tqdm: show a progress bar of finished requests on stderr while a batch
                runs (vLLM's argument; its default is ``True``, specdec's ``False``).
            prompt: the same as ``prompts`` (one of the two).

        Returns:
            GenerationOutput | list: one :class:`GenerationOutput`, or a list of them in
            prompt order for a batch
            (each equal to what the prompt gives alone: greedy token for token, seeded
            sampling the same draws). With ``sampling_params.n > 1``, a prompt's entry is
            instead a :class:`Choices` list of ``n`` outputs (choice i: seed ``seed + i``;
            with ``best_of``, the ``n`` candidates with the highest mean log-probability
            per token, best first); with ``n == 1`` and ``best_of``, the one best output.
            Each also reads as vLLM's ``RequestOutput`` (``.outputs[i].text``).

        Raises:
            ValueError: empty prompt or batch, a prompt that fills the model's context, bad
                ids, a list of sampling parameters, speculative settings or predictions
                whose length is not the number of prompts, an empty prediction, or a
                prediction with speculation off (method ``none``).
            TypeError: both ``prompts`` and ``prompt``.
        """
        if prompts is not None and prompt is not None:
            raise TypeError("generate() takes the prompt(s) once: prompts=... (or prompt=...)")
        prompt = prompts if prompt is None else prompt  # None: refused as any bad prompt
        if speculative is not None and not isinstance(speculative, list):
            speculative = _speculative_config(speculative)
        if isinstance(sampling_params, (list, tuple)):  # vLLM takes any sequence
            sampling_params = [_sampling_params(p) for p in sampling_params]
        elif sampling_params is not None:
            sampling_params = _sampling_params(sampling_params)
        if _is_batch(prompt):
            return self._numbered(
                self._generate_batch(
                    prompt, sampling_params, speculative, chat, prediction, use_tqdm
                )
            )
        if isinstance(sampling_params, list) or isinstance(speculative, list):
            raise ValueError(
                "a list of sampling parameters or speculative settings needs a list of prompts"
            )
        params = self.resolve_params(sampling_params or SamplingParams())
        if params.n > 1 or params.best_of is not None:  # choices run as a batch
            return self._numbered(
                self._generate_batch(
                    [prompt], [params], [speculative], chat, [prediction], use_tqdm
                )
            )[0]
        config = speculative or self.speculative
        drafter = self.prediction_drafter(prediction, config)
        prompt_ids, steps = self._steps(prompt, params, speculative, chat, drafter)
        ids: list[int] = []
        logprobs = [] if params.logprobs is not None else None
        prompt_logprobs = None
        for step in steps:  # no per-step detokenization: the text is built once at the end
            if step.error:
                raise NoAllowedToken(step.error)
            ids.extend(step.new_token_ids)
            if logprobs is not None:
                logprobs.extend(step.logprobs)
            if step.prompt_logprobs is not None:
                prompt_logprobs = step.prompt_logprobs
        text = final_text(self.tokenizer, ids, step.finish_reason, step.text_end)
        output = GenerationOutput(text, ids, prompt_ids, step.finish_reason, step.stats, logprobs)
        output.prompt_logprobs = prompt_logprobs
        output.prompt = _prompt_text(prompt)
        output.stop_reason = _stop_reason(self.tokenizer, ids, step, params)
        return self._numbered([output._with_prediction(drafter)])[0]

    def _numbered(self, results: list) -> list:
        """``results`` (one entry per prompt: an output or its :class:`Choices`) with the
        next request ids, in order."""
        for result in results:
            request_id = str(next(self._request_counter))
            for out in result if isinstance(result, Choices) else [result]:
                out.request_id = request_id
        return results

    def resolve_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its ``bad_words`` tokenized into ``bad_words_token_ids``: each
        word as written and with a leading space (as vLLM does; a word's tokens differ
        after a space in most vocabularies)."""
        if not params.bad_words:
            return params
        seqs = list(params.bad_words_token_ids)
        for word in params.bad_words:
            for text in (word, " " + word.lstrip(" ")):
                ids = tuple(self.tokenizer.hf.encode(text, add_special_tokens=False))
                if ids:
                    seqs.append(ids)
        return dataclasses.replace(params, bad_words_token_ids=tuple(seqs))

    def prediction_drafter(self, prediction, config: SpeculativeConfig) -> PredictionDrafter | None:
        """The :class:`~specdec.drafters.prediction.PredictionDrafter` of one request's
        ``prediction`` (text or token ids; ``None`` gives ``None``).

        Raises:
            ValueError: an empty prediction, ids outside the vocabulary, or speculation off.
        """
        if prediction is None:
            return None
        if config.method == "none":
            raise ValueError(
                "a prediction is a draft source: it needs speculation on (a method other than none)"
            )
        if isinstance(prediction, str):
            check_text(prediction, "the prediction")
            ids = self.tokenizer.hf.encode(prediction, add_special_tokens=False)
        elif isinstance(prediction, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prediction
        ):
            ids = list(prediction)
            outside = [t for t in ids if not 0 <= t < self.target.vocab_size]
            if outside:
                raise ValueError(f"prediction token ids outside the vocabulary: {outside[:5]}")
        else:
            raise ValueError("a prediction is a string or a list of token ids")
        if not ids:
            raise ValueError("the prediction is empty")
        return PredictionDrafter(ids)

    def _generate_batch(
        self, prompts, sampling_params, speculative, chat, prediction=None, use_tqdm=False
    ):
        if not prompts:
            raise ValueError("the batch of prompts is empty")
        all_params = _per_prompt(sampling_params, len(prompts), "sampling parameters")
        all_params = [self.resolve_params(p or SamplingParams()) for p in all_params]
        configs = _per_prompt(speculative, len(prompts), "speculative settings")
        configs = [self.speculative if c is None else _speculative_config(c) for c in configs]
        if prediction is not None and not isinstance(prediction, list):
            raise ValueError("for a batch, prediction is a list with one per prompt")
        predictions = _per_prompt(prediction, len(prompts), "predictions")
        for p, c in zip(predictions, configs, strict=True):
            self.prediction_drafter(p, c)  # checked before anything runs
        encoded = []  # every prompt checked first
        for i, p in enumerate(prompts):
            try:
                encoded.append(self.encode(p, chat))
            except ValueError as exc:
                raise ValueError(f"prompt {i} of the batch: {exc}") from None
        groups = [_choices(p) for p in all_params]  # per prompt: its candidates' params
        if any(
            len(g) > 1 or p.best_of is not None for g, p in zip(groups, all_params, strict=True)
        ):
            flat = [(ids, c, config, pred) for ids, g, config, pred in zip(
                encoded, groups, configs, predictions, strict=True) for c in g]  # fmt: skip
            outputs = self._run_batch(
                [f[0] for f in flat], [f[1] for f in flat], [f[2] for f in flat],
                [f[3] for f in flat], use_tqdm,
            )  # fmt: skip
            results: list = []
            for prompt, params, group in zip(prompts, all_params, groups, strict=True):
                candidates, outputs = outputs[: len(group)], outputs[len(group) :]
                chosen = _best_of(candidates, params)
                for index, out in enumerate(chosen):
                    out.prompt, out.index = _prompt_text(prompt), index
                results.append(Choices(chosen) if params.n > 1 else chosen[0])
            return results
        outputs = self._run_batch(encoded, all_params, configs, predictions, use_tqdm)
        for prompt, out in zip(prompts, outputs, strict=True):
            out.prompt = _prompt_text(prompt)
        return outputs

    def _run_batch(
        self, encoded, all_params, configs, predictions, use_tqdm=False
    ) -> list[GenerationOutput]:
        """Encoded prompts, one sequence each, through one batched engine (with
        ``use_tqdm``, a progress bar of finished sequences)."""
        drafters = [
            self.prediction_drafter(p, c) for p, c in zip(predictions, configs, strict=True)
        ]
        with self._lock:
            engine = Engine(self.target, self.engine_config, self.cost_model, self.prefix_cache())
            sequences = [
                engine.add_request(str(i), ids, params, **self._request(config, params, drafter))
                for i, (ids, params, config, drafter) in enumerate(
                    zip(encoded, all_params, configs, drafters, strict=True)
                )
            ]
        bar = tqdm(total=len(sequences), desc="requests", unit="req", disable=not use_tqdm)
        try:
            while True:
                with self._lock:
                    if not engine.has_unfinished():
                        break
                    engine.step()
                bar.update(sum(seq.is_finished for seq in sequences) - bar.n)
        finally:
            bar.close()
            for seq in sequences:
                engine.abort(seq.request_id)
        return [
            _output(self.tokenizer, seq)._with_prediction(drafter)
            for seq, drafter in zip(sequences, drafters, strict=True)
        ]

    def _request(
        self, config: SpeculativeConfig, params: SamplingParams, drafter: Drafter | None = None
    ) -> dict:
        """The per-request engine arguments for ``config`` and ``params``; ``drafter``
        (a request's own, e.g. its prediction) replaces the configured one and drafts
        chains."""
        k = 0 if config.method == "none" else config.num_speculative_tokens
        if isinstance(drafter, PredictionDrafter):  # long exact runs are what it is for
            k = max(k, PREDICTION_K)
        return dict(
            drafter=drafter or self.drafter(config),
            num_speculative_tokens=k,
            tree_builder=None if drafter else self.tree_builder(config, params.seed),
            stop_checker=self._stop_checker(params),
            generator=make_generator(params.seed, self.target.device),
            controller=self.controller(config),
            verifier=config.verifier,
            grammar=self.grammar(params),
        )

    def grammar(self, params: SamplingParams) -> GrammarState | None:
        """A fresh grammar state for ``params.structured_outputs`` (``None`` without).

        Raises:
            ValueError: an invalid schema, regex or grammar, or a tokenizer llguidance
                cannot read.
        """
        spec = params.structured_outputs
        return None if spec is None else self.grammars.matcher(spec)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        speculative: SpeculativeConfig | list[SpeculativeConfig] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        use_tqdm: bool = False,
    ) -> GenerationOutput | list[GenerationOutput]:
        """vLLM's ``LLM.chat``: :meth:`generate` on one conversation (a list of
        ``{"role", "content"}`` messages, the chat template applied) or on a batch of them.

        ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs`` and
        ``tools`` are vLLM's (see :meth:`encode`; the tools go to the chat template; to
        force a call, or to read calls out of the text, see :mod:`specdec.tools`);
        ``use_tqdm`` as in :meth:`generate`.

        Raises:
            ValueError: a conversation that is not a non-empty list of messages, what
                :meth:`encode` refuses, or what :meth:`generate` refuses.
        """
        batch = bool(messages) and all(isinstance(m, list) for m in messages)
        conversations = messages if batch else [messages]
        for conversation in conversations:
            if not conversation or not all(isinstance(m, dict) for m in conversation):
                raise ValueError(
                    "chat takes a conversation (a non-empty list of {'role', 'content'} "
                    "messages) or a list of conversations"
                )
        conversations = [_text_messages(c) for c in conversations]
        messages = conversations if batch else conversations[0]
        flags = (add_generation_prompt, continue_final_message, chat_template_kwargs)
        if flags == (True, False, None) and not tools:
            return self.generate(
                messages, sampling_params, speculative=speculative, chat=True, use_tqdm=use_tqdm
            )
        ids = [self.encode(c, True, *flags, tools=tools) for c in conversations]
        return self.generate(
            ids if batch else ids[0], sampling_params, speculative=speculative, use_tqdm=use_tqdm
        )

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        speculative: SpeculativeConfig | None = None,
        chat: bool | None = None,
        prediction: str | list[int] | None = None,
    ) -> Iterator[GenerationChunk]:
        """Like :meth:`generate`, yielding text as it is produced (one chunk per step).

        Text that could still become part of a stop string, or an incomplete UTF-8
        character, is held back until it is settled, so nothing after a stop is ever
        yielded. Bad input (an empty or over-long prompt, invalid sampling values, ``n >
        1``) raises here, at the call, as :meth:`generate` does; generation itself starts at
        the first ``next``.

        Raises:
            ValueError: as :meth:`generate`, and for ``n > 1`` or ``best_of``.
        """
        if _is_batch(prompt):
            raise ValueError(
                "stream takes one prompt (a string, chat messages, token ids or a prompt "
                "dict), not a list of prompts: stream each one, or generate(list) a batch"
            )
        if speculative is not None:
            speculative = _speculative_config(speculative)
        if sampling_params is not None:
            sampling_params = _sampling_params(sampling_params)
        params = self.resolve_params(sampling_params or SamplingParams())
        if params.n > 1 or params.best_of is not None:
            raise ValueError("stream returns one output: use generate for n > 1 or best_of")
        drafter = self.prediction_drafter(prediction, speculative or self.speculative)
        prompt_ids, steps = self._steps(prompt, params, speculative, chat, drafter)
        check_prompt_fits(self.target, prompt_ids)
        return self._chunks(prompt_ids, steps, params, drafter)

    def _chunks(self, prompt_ids, steps, params, drafter) -> Iterator[GenerationChunk]:
        for chunk in _stream_text(self.tokenizer, prompt_ids, steps, params):
            if chunk.output is not None:
                self._numbered([chunk.output._with_prediction(drafter)])
            yield chunk

    def _steps(self, prompt: Prompt, params: SamplingParams, speculative, chat, drafter=None):
        """Encode the prompt and start the engine's step iterator (each step under the
        lock)."""
        config = speculative or self.speculative
        prompt_ids = self.encode(prompt, chat)
        request = self._request(config, params, drafter)
        steps = generate_steps(
            self.target,
            request["drafter"],
            prompt_ids,
            params,
            request["num_speculative_tokens"],
            request["stop_checker"],
            request["generator"],
            request["tree_builder"],
            self.engine_config,
            controller=request["controller"],
            cost_model=self.cost_model,
            verifier=request["verifier"],
            grammar=request["grammar"],
            prefix_cache=self.prefix_cache(),
        )
        return prompt_ids, self._locked(steps)

    def _locked(self, steps: Iterator) -> Iterator:
        try:
            while True:
                with self._lock:
                    try:
                        step = next(steps)
                    except StopIteration:
                        return
                yield step
        finally:
            with self._lock:
                steps.close()

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
        return StopChecker(stop_ids, params.stop, self.tokenizer.decode, params.min_tokens)


def _choices(params: SamplingParams) -> list[SamplingParams]:
    """The candidates of one prompt: ``best_of`` (or ``n``) single-choice params, choice i
    with seed ``seed + i``; log-probabilities computed when they rank the candidates."""
    count = params.best_of or params.n
    rank = count > params.n
    return [
        dataclasses.replace(
            params,
            n=1,
            best_of=None,
            seed=choice_seed(params.seed, i),
            logprobs=0 if rank and params.logprobs is None else params.logprobs,
        )
        for i in range(count)
    ]


def _best_of(candidates: list[GenerationOutput], params: SamplingParams) -> list:
    """The ``n`` candidates with the highest mean log-probability per token (all of them,
    in order, without ``best_of``); log-probabilities computed only to rank are dropped."""
    if len(candidates) == params.n:
        return candidates

    def score(i: int) -> float:
        values = [t.logprob for t in candidates[i].logprobs]
        return sum(values) / len(values) if values else float("-inf")

    chosen = [candidates[i] for i in sorted(range(len(candidates)), key=lambda i: (-score(i), i))]
    chosen = chosen[: params.n]
    if params.logprobs is None:
        for out in chosen:
            out.logprobs = None
    return chosen


def _text_messages(messages: list[dict]) -> list[dict]:
    """Chat messages as a chat template reads them, as the server and vLLM take them:
    ``content`` one string (a list of text parts joined with ``"\\n"``; an assistant's
    ``None`` read as ``""``). Refused, naming the message: no role (any non-empty string
    is one, as in vLLM's ``LLM.chat``: templates know roles such as Llama 3.1's
    ``ipython``; the server takes OpenAI's five), no ``content``, ``None`` content from
    another role than the assistant's, or a part that is not text (the model takes text
    only).

    Returns:
        New message dicts (the given ones are not changed).

    Raises:
        ValueError: the first such message.
    """
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        if "content" not in message:
            raise ValueError(f"messages[{i}] ({role}) has no 'content'")
        content = message["content"]
        if content is None:
            if role != "assistant":
                raise ValueError(
                    f"messages[{i}].content is None (only an assistant's content may be)"
                )
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):  # fmt: skip
                    raise ValueError(
                        f"messages[{i}].content[{j}] must be a text part "
                        "{'type': 'text', 'text': ...} (this model takes text only)"
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of content parts, got "
                f"{type(content).__name__}"
            )
        message = {**message, "content": content}
        if message.get("tool_calls"):  # an assistant's calls, arguments as the template reads them
            message["tool_calls"] = template_tool_calls(
                message["tool_calls"], f"messages[{i}].tool_calls"
            )
        out.append(message)
    return out


def _sampling_params(value) -> SamplingParams:
    """``sampling_params=`` as :class:`SamplingParams`: one, or a dict of its fields.

    Raises:
        ValueError: another type, or a dict naming fields it does not have (the message
            names them); what :class:`SamplingParams` refuses.
    """
    return _from_fields(SamplingParams, value, "sampling_params")


def _speculative_config(value) -> SpeculativeConfig:
    """``speculative=`` as a :class:`SpeculativeConfig`: one, or a dict of its fields
    (as vLLM's ``speculative_config={...}``).

    Raises:
        ValueError: another type, or a dict naming fields it does not have (the message
            names them and lists the fields).
    """
    hint = (
        " (vLLM's fields 'model', 'prompt_lookup_max' and 'prompt_lookup_min' are read too, "
        "with its method names ngram, eagle, eagle3, medusa, draft_model and suffix)"
    )
    if isinstance(value, dict):
        value = _from_vllm_fields(value)
    return _from_fields(SpeculativeConfig, value, "speculative", hint)


#: vLLM's ``speculative_config`` methods and the drafters they are here.
VLLM_METHODS = {
    "ngram": "ngram", "eagle": "eagle", "eagle3": "eagle", "medusa": "medusa",
    "draft_model": "draft-model", "suffix": "suffix",
}  # fmt: skip


def _from_vllm_fields(value: dict) -> dict:
    """vLLM's ``speculative_config`` fields as this project's: ``model`` is a draft
    model (``draft_model``, method ``draft-model`` when none or ``draft_model`` is given)
    or a trained head's folder (methods ``eagle`` / ``eagle3`` / ``medusa``: the drafter's
    ``head=``); ``prompt_lookup_max`` / ``prompt_lookup_min`` are ``ngram``'s ``max_n`` /
    ``min_n``; vLLM's method names map by :data:`VLLM_METHODS`. A dict without those
    fields is returned as it is.

    Raises:
        ValueError: ``model`` with a method that reads no model, or ``prompt_lookup_*``
            with a method other than ``ngram``.
    """
    vllm = {"model", "prompt_lookup_max", "prompt_lookup_min"}
    method = value.get("method")
    if not vllm & set(value) and method not in ("eagle3", "draft_model"):
        return value
    out = {k: v for k, v in value.items() if k not in vllm}
    name = VLLM_METHODS.get(method, method) if isinstance(method, str) else method
    model = value.get("model")
    if model is not None:
        if name in (None, "draft-model"):
            name = "draft-model"
            out["draft_model"] = model
        elif name in ("eagle", "medusa"):
            name = f"{name}:head={model}"
        else:
            raise ValueError(
                f"speculative: 'model' names a draft model or a head, which method "
                f"{method!r} does not read (use method 'draft_model', 'eagle' or 'medusa')"
            )
    lookup = {k: value[k] for k in ("prompt_lookup_max", "prompt_lookup_min") if k in value}
    if lookup:
        if name not in (None, "ngram"):
            raise ValueError(
                f"speculative: prompt_lookup_max / prompt_lookup_min are ngram's, not {method!r}'s"
            )
        sizes = {"prompt_lookup_max": "max_n", "prompt_lookup_min": "min_n"}
        name = "ngram:" + ",".join(f"{sizes[k]}={v}" for k, v in lookup.items())
    if name is not None:
        out["method"] = name
    return out


def _from_fields(cls, value, argument: str, hint: str = ""):
    """``value`` if it is a ``cls``, else ``cls(**value)`` for a dict of its fields.

    Raises:
        ValueError: another type, or a dict naming fields ``cls`` does not have (the
            message names them, lists the fields, then ``hint``).
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(
                f"{argument}: unknown field(s) {', '.join(map(repr, unknown))}; "
                f"{cls.__name__} takes {', '.join(sorted(names))}{hint}"
            )
        return cls(**value)
    raise ValueError(
        f"{argument} must be a {cls.__name__} (or a dict of its fields), got {type(value).__name__}"
    )


def _per_prompt(value, num_prompts: int, what: str) -> list:
    """``value`` for every prompt: a list of ``num_prompts`` values, or one value repeated."""
    if not isinstance(value, list):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise ValueError(f"{len(value)} {what} for {num_prompts} prompts")
    return list(value)


def _is_batch(prompt) -> bool:
    """A list of prompts (strings, token-id lists, message lists or vLLM prompt dicts),
    not one prompt."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(p, (str, list, tuple)) or _is_prompt_dict(p) for p in prompt)
    )


#: the keys of vLLM's prompt dicts that specdec reads (``TextPrompt``, ``TokensPrompt``)
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _is_prompt_dict(value) -> bool:
    """A dict that is not a chat message (no ``role``): vLLM's ``{"prompt": ...}`` /
    ``{"prompt_token_ids": ...}``, or a malformed one that :func:`_vllm_prompt` names."""
    return isinstance(value, dict) and "role" not in value


def _vllm_prompt(prompt: dict) -> str | list[int]:
    """vLLM's prompt dict as specdec's prompt: the text or the token ids.

    Raises:
        ValueError: a chat message given alone, other keys (multi-modal data, ...), or
            both keys.
    """
    if "role" in prompt:
        raise ValueError("a chat message must come in a list: [{'role': 'user', 'content': ...}]")
    other = sorted(set(prompt) - set(_PROMPT_KEYS))
    if other:
        raise ValueError(
            f"prompt dict keys {', '.join(map(repr, other))} are not supported: specdec reads "
            "vLLM's {'prompt': text} and {'prompt_token_ids': [ids]}"
        )
    if len(prompt) != 1:
        raise ValueError(
            "a prompt dict has 'prompt' (text) or 'prompt_token_ids' (ids): "
            + ("not both" if prompt else "it has neither")
        )
    value = prompt.get("prompt", prompt.get("prompt_token_ids"))
    if "prompt" in prompt and not isinstance(value, str):
        raise ValueError(f"'prompt' must be a string, got {type(value).__name__}")
    if "prompt_token_ids" in prompt and not (
        isinstance(value, (list, tuple)) and all(isinstance(t, int) for t in value)
    ):
        raise ValueError("'prompt_token_ids' must be a list of token ids")
    return value if isinstance(value, str) else list(value)


def _prompt_text(prompt) -> str | None:
    """The prompt's text as given (a string or a ``{"prompt": text}`` dict), else ``None``."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _output(tokenizer: Tokenizer, seq) -> GenerationOutput:
    """A finished engine :class:`~specdec.engine.Sequence` as a :class:`GenerationOutput`.

    Raises:
        NoAllowedToken: the sequence failed (its transforms allowed no token).
    """
    if seq.error:
        raise NoAllowedToken(seq.error)
    ids = seq.output_ids
    text = final_text(tokenizer, ids, seq.finish_reason, seq.text_end)
    logprobs = list(seq.logprobs) if seq.params.logprobs is not None else None
    output = GenerationOutput(text, ids, seq.prompt_ids, seq.finish_reason, seq.stats, logprobs)
    if seq.params.prompt_logprobs is not None:
        output.prompt_logprobs = list(seq.prompt_logprobs)
    output.stop_reason = _stop_reason(tokenizer, ids, seq, seq.params)
    return output


def _stop_reason(tokenizer: Tokenizer, ids: list[int], ended, params: SamplingParams):
    """vLLM's ``stop_reason`` of an output whose last step (or sequence) is ``ended``."""
    return stop_reason(
        ids, ended.finish_reason, ended.text_end, params.stop, params.stop_token_ids,
        tokenizer.eos_token_ids, tokenizer.decode,
    )  # fmt: skip


def _stream_text(tokenizer: Tokenizer, prompt_ids: list[int], steps, params: SamplingParams):
    """Turn engine steps into text chunks (incremental detokenization)."""
    stream = TextStream(tokenizer, params.stop)
    logprobs = [] if params.logprobs is not None else None
    prompt_logprobs = None
    for step in steps:
        if step.error:
            raise NoAllowedToken(step.error)
        delta = stream.push(step.new_token_ids, step.finish_reason, step.text_end)
        if logprobs is not None:
            logprobs.extend(step.logprobs)
        if step.prompt_logprobs is not None:
            prompt_logprobs = step.prompt_logprobs
        output = None
        if step.finish_reason is not None:
            output = GenerationOutput(
                stream.text, stream.ids, prompt_ids, step.finish_reason, step.stats, logprobs
            )
            output.prompt_logprobs = prompt_logprobs
            output.stop_reason = _stop_reason(tokenizer, stream.ids, step, params)
        yield GenerationChunk(delta, list(step.new_token_ids), output, step.stats, step.logprobs)
