"""Benchmark methods: specdec drafters and external baselines, behind one ``run`` call.

Method strings (``--method``):

* ``ar``: specdec plain autoregressive decoding (the baseline every ratio uses);
* ``ngram[:k=10,min=2,max=4]``: specdec prompt lookup;
* ``draft-model[:k=4]``: specdec with the ``--draft-model``;
* ``hf-prompt-lookup[:k=10,max_ngram=2]``: transformers ``generate(prompt_lookup_num_tokens=k)``;
* ``hf-assisted[:k=4]``: transformers ``generate(assistant_model=draft)``.

A llama.cpp baseline is not implemented yet.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.llm import LLM
from specdec.metrics import SpecStats
from specdec.trees.spec import TreeSpec

SPECDEC_KINDS = {"ar": "none", "ngram": "ngram", "draft-model": "draft-model"}


@dataclass(frozen=True)
class Method:
    """A parsed ``--method``: ``kind``, integer options (``k``, ``min``, ``max``, ...) and,
    for specdec drafters, an optional token tree (``tree``, a :class:`TreeSpec` string)."""

    kind: str
    options: tuple[tuple[str, int], ...] = ()
    tree: str | None = None

    @property
    def name(self) -> str:
        """Label used in reports, e.g. ``ngram:k=10`` or ``ngram@static:tree-16``
        (``autoregressive`` for ``ar``)."""
        if self.kind == "ar":
            return "autoregressive"
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        label = f"{self.kind}:{opts}" if opts else self.kind
        return f"{label}@{self.tree}" if self.tree else label

    def option(self, key: str, default: int | None = None) -> int:
        """The value of option ``key`` (its documented default when not given)."""
        fallback = _DEFAULTS.get(self.kind, {}).get(key, default)
        return dict(self.options).get(key, fallback)

    @property
    def settings(self) -> tuple:
        """What the method runs, defaults filled in: equal settings = the same method."""
        full = {**_DEFAULTS.get(self.kind, {}), **dict(self.options)}
        return self.kind, tuple(sorted(full.items())), self.tree

    @property
    def is_specdec(self) -> bool:
        return self.kind in SPECDEC_KINDS

    def speculative_config(self) -> SpeculativeConfig | None:
        """The :class:`SpeculativeConfig` a specdec method runs (``None`` for external
        baselines).

        Raises:
            ValueError: an option value the config refuses (e.g. ``k=0``).
        """
        if self.kind == "ar":
            return SpeculativeConfig(method="none")
        if self.kind == "ngram":
            return SpeculativeConfig(
                method="ngram",
                num_speculative_tokens=self.option("k"),
                ngram_min=self.option("min"),
                ngram_max=self.option("max"),
                tree=self.tree,
            )
        if self.kind == "draft-model":
            return SpeculativeConfig(
                method="draft-model", num_speculative_tokens=self.option("k"), tree=self.tree
            )
        return None


#: Options each kind takes, with their defaults.
_DEFAULTS = {
    "ar": {},
    "ngram": {"k": 10, "min": 2, "max": 4},
    "draft-model": {"k": 4},
    "hf-prompt-lookup": {"k": 10, "max_ngram": 2},
    "hf-assisted": {"k": 4},
}
_ALLOWED = {kind: tuple(defaults) for kind, defaults in _DEFAULTS.items()}


def parse_method(text: str) -> Method:
    """``"ngram:k=8,min=2"`` -> ``Method("ngram", (("k", 8), ("min", 2)))``.

    A token tree follows ``@``: ``"ngram@dynamic:top_k=4,depth=5,budget=16"`` (specdec's
    ``ngram`` and ``draft-model`` only; ``k`` is then unused).

    Raises:
        ValueError: unknown kind, unknown option, a non-integer value, or a bad tree.
    """
    text, at, tree = text.strip().partition("@")
    if at:
        tree = str(TreeSpec.parse(tree))
    kind, _, rest = text.partition(":")
    if at and kind not in ("ngram", "draft-model"):
        raise ValueError(f"only ngram and draft-model take a token tree (@...), not {kind!r}")
    if kind not in _ALLOWED:
        raise ValueError(f"unknown method {kind!r}; choose from {', '.join(_ALLOWED)}")
    options = []
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in _ALLOWED[kind]:
            raise ValueError(f"method {kind!r} has no option {key!r} (options: {_ALLOWED[kind]})")
        try:
            options.append((key, int(value)))
        except ValueError:
            raise ValueError(
                f"option {key!r} of {kind!r} needs an integer, got {value!r}"
            ) from None
    method = Method(kind, tuple(options), tree or None)
    try:
        method.speculative_config()  # specdec's own checks, now rather than mid-run
    except ValueError as error:
        raise ValueError(f"method {text!r}: {error}") from None
    small = [f"{key}={value}" for key, value in options if value < 1]
    if small:
        raise ValueError(f"method {text!r}: {', '.join(small)} must be >= 1")
    return method


def parse_methods(texts: Sequence[str]) -> list[Method]:
    """The run's methods: ``ar`` (the baseline) first, then each of ``texts`` once.

    ``ar`` in ``texts`` is the baseline itself (it always runs) and is not run again.

    Raises:
        ValueError: a bad method (see :func:`parse_method`), or the same method given twice
            (also when written differently, e.g. ``ngram`` and ``ngram:k=10``).
    """
    methods = [parse_method("ar")]
    seen = {methods[0].settings: "ar"}
    for text in texts:
        method = parse_method(text)
        if method.kind == "ar":
            continue
        if method.settings in seen:
            raise ValueError(
                f"--method {text!r} is the same method as {seen[method.settings]!r}; "
                "give each method once"
            )
        seen[method.settings] = text
        methods.append(method)
    return methods


@dataclass
class RunResult:
    """One generation: output ids (EOS kept), wall seconds, and specdec's stats if any."""

    token_ids: list[int]
    elapsed_s: float
    stats: SpecStats | None = field(default=None)


class MethodRunner:
    """Runs one method on prompt ids; the wall time covers the whole generate call.

    Raises:
        ValueError: a method that needs a draft model without one.
    """

    def __init__(self, method: Method, llm: LLM, draft_llm_model=None):
        self.method = method
        self.llm = llm
        self.target = llm.target
        self.draft = draft_llm_model
        if method.kind in ("draft-model", "hf-assisted") and draft_llm_model is None:
            raise ValueError(f"method {method.kind!r} needs --draft-model")
        self.speculative = method.speculative_config()
        if method.kind == "draft-model":  # a view sharing the loaded target, with the draft
            self.llm = LLM(llm.target, draft=draft_llm_model, speculative=self.speculative)

    def run(self, prompt_ids: list[int], params: SamplingParams) -> RunResult:
        start = time.perf_counter()
        if self.speculative is not None:
            out = self.llm.generate(prompt_ids, params, speculative=self.speculative)
            return RunResult(out.token_ids, time.perf_counter() - start, out.metrics)
        ids = self._run_transformers(prompt_ids, params)
        return RunResult(ids, time.perf_counter() - start)

    @torch.inference_mode()
    def _run_transformers(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        kwargs = dict(
            max_new_tokens=params.max_new_tokens,
            eos_token_id=sorted(self.target.tokenizer.eos_token_ids) or None,
            pad_token_id=min(self.target.tokenizer.eos_token_ids, default=0),
        )
        if params.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(
                do_sample=True,
                temperature=params.temperature,
                top_k=params.top_k or None,
                top_p=params.top_p,
            )
            torch.manual_seed(params.seed or 0)
        if self.method.kind == "hf-prompt-lookup":
            kwargs.update(
                prompt_lookup_num_tokens=self.method.option("k"),
                max_matching_ngram_size=self.method.option("max_ngram"),
            )
        else:
            kwargs.update(assistant_model=self.draft.model)
            self.draft.model.generation_config.num_assistant_tokens = self.method.option("k")
            self.draft.model.generation_config.num_assistant_tokens_schedule = "constant"
        ids = torch.tensor([prompt_ids], device=self.target.device)
        out = self.target.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return out[0, len(prompt_ids) :].tolist()
