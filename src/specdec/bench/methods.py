"""Benchmark methods: specdec drafters and external baselines, behind one ``run`` call.

Method strings (``--method``):

* ``ar``: specdec plain autoregressive decoding (the baseline every ratio uses);
* ``NAME[:k=K,option=value,...][@TREE]``: any registered drafter (``specdec drafters``
  lists them), ``k`` = draft tokens per step, the other options go to the drafter, e.g.
  ``ngram:k=10,min_n=1``, ``suffix:k=24,global_cache=false``,
  ``recycling@dynamic:top_k=4,depth=6,budget=24``, ``draft-model:k=4`` (with
  ``--draft-model``);
* a speculation controller follows ``+`` (default ``fixed``, or ``bench --controller``):
  ``ngram:k=10+cost``, ``draft-model:k=8+bandit:discount=0.95``,
  ``draft-model@dynamic:top_k=4,depth=5,budget=16+cost``; ``k`` (or the tree's depth) is
  then the most a step drafts;
* ``hf-prompt-lookup[:k=10,max_ngram=2]``: transformers ``generate(prompt_lookup_num_tokens=k)``;
* ``hf-assisted[:k=4]``: transformers ``generate(assistant_model=draft)``;
* peers, each in a worker process under its own interpreter (:mod:`specdec.bench.peers`):
  ``vllm-ar`` (vLLM plain decoding), ``vllm-ngram[:k=10,max_ngram=4]`` (vLLM's n-gram
  speculative decoding: ``num_speculative_tokens=k``, ``prompt_lookup_max=max_ngram``,
  ``prompt_lookup_min=1``), ``llama-cpp`` (llama.cpp plain decoding of the target's GGUF
  file, through llama-cpp-python) and ``llama-cpp-lookup[:k=10]`` (its
  ``LlamaPromptLookupDecoding(num_pred_tokens=k)``). A peer gets the same prompt token ids,
  one request at a time; its time is the wall time of the library's generate call.

External baselines and peers have no specdec stats (``RunResult.stats`` is ``None``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec import registry
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.llm import LLM
from specdec.metrics import SpecStats
from specdec.trees.spec import TreeSpec

#: Peer methods (vLLM, llama.cpp) and their integer options, with defaults.
PEERS = {
    "vllm-ar": {},
    "vllm-ngram": {"k": 10, "max_ngram": 4},
    "llama-cpp": {},
    "llama-cpp-lookup": {"k": 10},
}
#: The library each peer method runs (``vllm`` or ``llama-cpp``).
PEER_LIBRARY = {
    "vllm-ar": "vllm",
    "vllm-ngram": "vllm",
    "llama-cpp": "llama-cpp",
    "llama-cpp-lookup": "llama-cpp",
}
#: A peer's speculative method -> the same peer's plain decoding (compared turn by turn).
OWN_PLAIN = {"vllm-ngram": "vllm-ar", "llama-cpp-lookup": "llama-cpp"}
#: External baselines (transformers, then the peers) and their integer options, with defaults.
EXTERNAL = {"hf-prompt-lookup": {"k": 10, "max_ngram": 2}, "hf-assisted": {"k": 4}, **PEERS}
#: Draft tokens per step (``k``) when a method does not say; other drafters: 8.
DEFAULT_K = {
    "ngram": 10,
    "draft-model": 4,
    "suffix": 24,
    "recycling": 4,
    "lookahead": 8,
    "retrieval": 10,
    "layer-skip": 5,
    "quantized": 5,
}


@dataclass(frozen=True)
class Method:
    """A parsed ``--method``: ``kind``, its options as written (``k`` and, for specdec
    drafters, the drafter's options) and an optional token tree (a :class:`TreeSpec`
    string)."""

    kind: str
    options: tuple[tuple[str, str], ...] = ()
    tree: str | None = None
    controller: str = "fixed"

    @property
    def name(self) -> str:
        """Label used in reports, e.g. ``ngram:k=10``, ``ngram@static:tree-16`` or
        ``ngram:k=10+cost`` (``autoregressive`` for ``ar``; ``+fixed`` is not shown)."""
        if self.kind == "ar":
            return "autoregressive"
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        label = f"{self.kind}:{opts}" if opts else self.kind
        label = f"{label}@{self.tree}" if self.tree else label
        return label if self.controller == "fixed" else f"{label}+{self.controller}"

    def option(self, key: str) -> int:
        """The integer option ``key`` (``k`` or an external baseline's), or its default."""
        given = dict(self.options)
        if key in given:
            return int(given[key])
        if self.kind in EXTERNAL:
            return EXTERNAL[self.kind][key]
        if key == "k":
            return DEFAULT_K.get(self.kind, 8)
        raise KeyError(key)

    @property
    def settings(self) -> tuple:
        """What the method runs, defaults filled in: equal settings = the same method."""
        config = self.speculative_config()
        if config is not None:
            k = 0 if config.method == "none" else config.num_speculative_tokens
            control = None if config.method == "none" else config.controller_spec
            return config.method, k, config.options, config.tree, control, config.verifier
        full = {**EXTERNAL[self.kind], **{k: int(v) for k, v in self.options}}
        return self.kind, tuple(sorted(full.items())), self.tree

    @property
    def is_specdec(self) -> bool:
        return self.kind not in EXTERNAL

    @property
    def is_peer(self) -> bool:
        """A vLLM or llama.cpp method (runs in a worker, see :mod:`specdec.bench.peers`)."""
        return self.kind in PEERS

    @property
    def needs_draft_model(self) -> bool:
        """It needs ``--draft-model`` (``hf-assisted``, or a drafter that drafts with one)."""
        if self.kind == "hf-assisted":
            return True
        if not self.is_specdec or self.kind == "ar":
            return False
        options = {k: v for k, v in self.options if k not in ("k", "verifier")}
        return registry.needs_draft_model(self.kind, options)

    def speculative_config(self) -> SpeculativeConfig | None:
        """The :class:`SpeculativeConfig` a specdec method runs (``None`` for external
        baselines).

        Raises:
            ValueError: an option the drafter refuses (e.g. ``k=0``, ``min_n=0``).
        """
        if self.kind in EXTERNAL:
            return None
        if self.kind == "ar":
            return SpeculativeConfig(method="none")
        drafter_options = ",".join(
            f"{k}={v}" for k, v in self.options if k not in ("k", "verifier")
        )
        return SpeculativeConfig(
            method=f"{self.kind}:{drafter_options}" if drafter_options else self.kind,
            num_speculative_tokens=self.option("k"),
            tree=self.tree,
            controller=self.controller,
            verifier=(verifier := dict(self.options).get("verifier", "rejection")),
            allow_lossy=verifier.startswith("typical"),  # asked for by name: measured, labelled
        )


def parse_method(text: str, controller: str = "fixed") -> Method:
    """``"ngram:k=8,min_n=2"`` -> ``Method("ngram", (("k", "8"), ("min_n", "2")))``.

    A token tree follows ``@``: ``"ngram@dynamic:top_k=4,depth=5,budget=16"`` (specdec
    drafters that draft trees; ``k`` is then unused). ``verifier=block`` (an option of any
    specdec drafter) verifies sampled chains by block verification, ``verifier=typical``
    by Medusa-2's LOSSY typical acceptance (default epsilon and delta). A speculation
    controller follows ``+`` (``"ngram:k=10+cost"``); ``controller`` is the default for
    specdec drafters.

    Raises:
        ValueError: unknown kind, unknown option, a bad value, a bad tree or controller.
    """
    text, plus, given = text.strip().partition("+")
    if plus:
        controller = given.strip()
    text, at, tree = text.strip().partition("@")
    if at:
        tree = str(TreeSpec.parse(tree))
    kind, items = registry.parse_spec(text)
    if kind == "none":
        kind = "ar"
    known = ("ar", *EXTERNAL, *(n for n in registry.drafter_names() if n != "none"))
    if kind not in known:
        raise ValueError(f"unknown method {kind!r}; choose from {', '.join(known)}")
    if at and (kind in EXTERNAL or kind == "ar"):
        raise ValueError(f"only specdec drafters take a token tree (@...), not {kind!r}")
    if plus and (kind in EXTERNAL or kind == "ar"):
        raise ValueError(f"only specdec drafters take a controller (+...), not {kind!r}")
    if kind in EXTERNAL or kind == "ar":
        controller = "fixed"
    if kind in EXTERNAL:
        _check_external(kind, items)
    elif "k" in items:
        _integer(kind, "k", items["k"])
    try:  # one spelling per controller: its name and non-default options
        controller = SpeculativeConfig(method="none", controller=controller).controller_spec
    except ValueError as error:  # named as given, after the +: the drafter part is fine
        raise ValueError(f"controller {controller!r} of method {text!r}: {error}") from None
    method = Method(kind, tuple(items.items()), tree or None, controller)
    try:
        method.speculative_config()  # specdec's own checks, now rather than mid-run
    except ValueError as error:
        raise ValueError(f"method {text!r}: {error}") from None
    return method


def _integer(kind: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"option {key!r} of {kind!r} needs an integer, got {value!r}") from None


def _check_external(kind: str, items: dict[str, str]) -> None:
    for key, value in items.items():
        if key not in EXTERNAL[kind]:
            raise ValueError(
                f"method {kind!r} has no option {key!r} "
                f"(options: {', '.join(EXTERNAL[kind]) or 'none'})"
            )
        if _integer(kind, key, value) < 1:
            raise ValueError(f"method {kind!r}: {key}={value} must be >= 1")


def parse_methods(texts: Sequence[str], controller: str = "fixed") -> list[Method]:
    """The run's methods: ``ar`` (the baseline) first, then each of ``texts`` once.

    ``ar`` in ``texts`` is the baseline itself (it always runs) and is not run again.

    ``controller`` is the speculation controller of methods that do not name one.

    Raises:
        ValueError: a bad method (see :func:`parse_method`), or the same method given twice
            (also when written differently, e.g. ``ngram`` and ``ngram:k=10``).
    """
    methods = [parse_method("ar")]
    seen = {methods[0].settings: "ar"}
    for text in texts:
        method = parse_method(text, controller)
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
    """One generation: output ids (EOS kept), wall seconds, specdec's stats if any, and
    for a peer whose generate call raised, the error (``"Type: message"``; the ids are
    then what it generated before raising)."""

    token_ids: list[int]
    elapsed_s: float
    stats: SpecStats | None = field(default=None)
    error: str | None = None


class MethodRunner:
    """Runs one method on prompt ids; the wall time covers the whole generate call.

    Peer methods run in :class:`~specdec.bench.peers.PeerRunner` instead.

    Raises:
        ValueError: a method that needs a draft model without one, or a peer method.
    """

    def __init__(self, method: Method, llm: LLM, draft_llm_model=None):
        if method.is_peer:
            raise ValueError(f"peer method {method.name!r} runs in a PeerRunner")
        self.method = method
        self.llm = llm
        self.target = llm.target
        self.draft = draft_llm_model
        if method.needs_draft_model and draft_llm_model is None:
            raise ValueError(f"method {method.kind!r} needs --draft-model")
        self.speculative = method.speculative_config()
        if method.needs_draft_model and method.is_specdec:  # shares the loaded target
            self.llm = LLM(
                llm.target,
                draft=draft_llm_model,
                speculative=self.speculative,
                engine_config=llm.engine_config,
            )
            self.llm.cost_model = llm.cost_model  # the same target: share what it costs

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
