r"""specdec's history-based drafters inside vLLM, through its ``custom_class`` proposer hook.

vLLM (0.32+, PR #39487) loads a proposer class named in ``speculative_config``:

```bash
python -m vllm.entrypoints.openai.api_server --model HuggingFaceTB/SmolLM2-135M-Instruct \
    --speculative-config '{"method": "custom_class", "num_speculative_tokens": 8,
                           "model": "specdec.integrations.vllm.SuffixProposer"}'
```

and calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` once per step
with the whole persistent batch. vLLM verifies every proposed token (greedy: its output
equals its own plain decoding; sampled: its rejection sampler), so the drafter changes the
speed, never what vLLM may output.

Classes (each a thin :class:`SpecdecProposer` naming a registered drafter):

* :class:`SuffixProposer` -- SuffixDecoding (Oliaro et al. 2024, arXiv:2411.04975) with
  specdec's cross-request cache. vLLM's ``suffix_decoding_max_tree_depth``,
  ``suffix_decoding_max_cached_requests``, ``suffix_decoding_max_spec_factor`` and
  ``suffix_decoding_min_token_prob`` set its options.
* :class:`NgramProposer` -- prompt lookup (Saxena 2023).
* :class:`RetrievalProposer` -- REST (He et al. 2024); needs a datastore:
  ``SPECDEC_VLLM_DRAFTER="retrieval:datastore=PATH"``.
* :class:`SpecdecProposer` -- any registered drafter that needs only the token history
  (plugins included), named by the ``SPECDEC_VLLM_DRAFTER`` environment variable.

``SPECDEC_VLLM_DRAFTER`` (a drafter spec, e.g. ``suffix:max_depth=32,global_cache=false``)
overrides any class's drafter and options; vLLM's worker processes inherit it.

**Per-request state without request ids.** The hook passes the rows of vLLM's persistent
batch, not request ids. A row's state (e.g. its suffix tree) is kept while the row's
tokens continue the tokens it last saw; when they do not, the row holds another request
(a new one, or one the batch condensed into it), which takes over the state that its
tokens continue, if any, or starts a new one. A state no row continues is closed at once
(its request finished or left the batch), which is when a suffix drafter adds the output
to its cross-request cache. A request vLLM takes out of the batch for a step (preemption)
comes back as a new one: drafting stays correct, it only restarts its state.

**What the hook cannot serve:** drafters that read the target's logits or hidden states
(Token Recycling, EAGLE, Medusa), draft with a model (draft-model, layer-skip), or add
rows to the verification (Lookahead) are refused with a clear error: the hook gives a
proposer token ids only. Token trees are not used (vLLM verifies a chain per request).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from specdec import registry
from specdec.config import SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "DRAFTER_ENV",
    "NgramProposer",
    "RetrievalProposer",
    "RowStates",
    "SpecdecProposer",
    "SuffixProposer",
    "check_history_drafter",
]

DRAFTER_ENV = "SPECDEC_VLLM_DRAFTER"
"""The environment variable naming the drafter spec (overrides the class's)."""

#: Built-in drafters that need more than token ids, and what they need (checked before
#: the drafter is built, so the refusal names the reason, not a missing attribute).
_NEEDS = {
    "draft-model": "a draft model",
    "layer-skip": "the target's own layers and KV cache",
    "sparse-kv": "the target's own layers and KV cache",
    "quantized": "the target's own layers and KV cache",
    "eagle": "the target's hidden states",
    "medusa": "the target's hidden states",
    "hydra": "the target's hidden states",
    "parallel": "the target's hidden states",
    "recycling": "the target's logits after every verification",
    "lookahead": "extra rows in the verification forward",
    "hybrid": "a model drafter beside its suffix draft (its model=)",
}

#: vLLM's suffix-decoding fields and the SuffixOptions they set.
_VLLM_SUFFIX_FIELDS = {
    "suffix_decoding_max_tree_depth": "max_depth",
    "suffix_decoding_max_cached_requests": "max_cached_requests",
    "suffix_decoding_max_spec_factor": "max_spec_factor",
    "suffix_decoding_min_token_prob": "min_token_prob",
}


def check_history_drafter(name: str, drafter: Any = None) -> None:
    """Refuse a drafter that needs more than the token history (``drafter``: its instance,
    whose capabilities are read; ``None`` checks only its registry entry).

    Raises:
        ValueError: the drafter drafts with a model, reads the target's logits or hidden
            states, drafts over the target's KV cache, or adds auxiliary rows; the message
            names what it needs.
    """
    if name in _NEEDS:
        need = _NEEDS[name]
    elif registry.drafter_entry(name).needs_draft_model:
        need = "a draft model"
    elif getattr(drafter, "max_aux_rows", 0):
        need = "extra rows in the verification forward"
    elif getattr(drafter, "captures", ()):
        need = "the target's hidden states"
    elif getattr(drafter, "uses_target_cache", False):
        need = "the target's KV cache"
    elif getattr(drafter, "observes", False):
        need = "the target's logits after every verification"
    else:
        return
    raise ValueError(
        f"drafter {name!r} needs {need}; vLLM's custom_class hook passes a proposer only "
        "token ids, so it runs history-based drafters (ngram, suffix, retrieval, or a plugin "
        "that reads only token ids)"
    )


@dataclass
class _Row:
    """One request's drafter state and the tokens it has seen."""

    sequence: Any
    tokens: np.ndarray

    def continued_by(self, tokens: np.ndarray) -> bool:
        n = len(self.tokens)
        return len(tokens) >= n and np.array_equal(tokens[:n], self.tokens)


class RowStates:
    """Per-request drafter states for a batch whose rows carry no request ids.

    Args:
        drafter: a specdec :class:`~specdec.drafters.base.Drafter` that needs only token
            ids (see :func:`check_history_drafter`).
        num_speculative_tokens: draft tokens asked per request and step (>= 1).
        max_model_len: a request's longest length in tokens; a draft never runs past it.
        params: the sampling parameters its sequences start with (the hook does not pass
            the requests'; the default is greedy-like, so drafters share learned state).

    Raises:
        ValueError: ``num_speculative_tokens`` < 1 or ``max_model_len`` < 1.
    """

    def __init__(
        self,
        drafter: Any,
        num_speculative_tokens: int,
        max_model_len: int,
        params: SamplingParams | None = None,
    ) -> None:
        if int(num_speculative_tokens) < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if int(max_model_len) < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.drafter = drafter
        self.k = int(num_speculative_tokens)
        self.max_model_len = int(max_model_len)
        self.params = params or SamplingParams(temperature=0.0)
        self.rows: dict[int, _Row] = {}
        self.generator = torch.Generator().manual_seed(0)
        #: requests started / states closed so far (for tests and logs)
        self.num_started = 0
        self.num_closed = 0

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
    ) -> list[list[int]]:
        """Draft tokens for every row of the batch.

        Args:
            sampled_token_ids: per row, the tokens sampled this step (accepted drafts and
                the bonus token); empty for a row that sampled nothing (a prompt still
                being prefilled in chunks): it gets no draft.
            num_tokens_no_spec: ``[>= rows]`` int, per row the tokens it holds (prompt and
                output, the sampled ones included; no draft tokens).
            token_ids_cpu: ``[>= rows, max_model_len]`` int, per row its token ids.

        Returns:
            per row, up to ``num_speculative_tokens`` draft token ids (fewer near
            ``max_model_len``; none for a row that sampled nothing).
        """
        num_rows = len(sampled_token_ids)
        rows = {
            i: np.asarray(token_ids_cpu[i, : int(num_tokens_no_spec[i])]) for i in range(num_rows)
        }
        live = [i for i in range(num_rows) if len(sampled_token_ids[i])]
        kept: dict[int, _Row] = {}
        for i, tokens in rows.items():  # the same request still in its row
            row = self.rows.get(i)
            if row is not None and row.continued_by(tokens):
                kept[i] = self.rows.pop(i)
        for i, tokens in rows.items():  # a request the batch moved to another row
            if i not in kept:
                moved = next((j for j, r in self.rows.items() if r.continued_by(tokens)), None)
                if moved is not None:
                    kept[i] = self.rows.pop(moved)
        for i in live:  # a new request (a row that sampled nothing waits until it does)
            if i not in kept:
                tokens = rows[i]
                prompt = tokens[: len(tokens) - len(sampled_token_ids[i])].tolist()
                kept[i] = _Row(self.drafter.start(prompt, self.params), tokens[:0].copy())
                self.num_started += 1
        self.close()  # no row continues them: their requests finished or left the batch
        self.rows = kept
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        for i in live:
            row, tokens = kept[i], rows[i]
            row.tokens = tokens.copy()
            room = min(self.k, self.max_model_len - len(tokens) - 1)
            if room > 0:
                proposal = row.sequence.propose(tokens.tolist(), room, self.generator)
                drafts[i] = [int(t) for t in proposal.token_ids[:room]]
        return drafts

    def close(self) -> None:
        """Close every state (the drafter's ``close``: a suffix drafter caches the output)."""
        for row in self.rows.values():
            row.sequence.close()
            self.num_closed += 1
        self.rows = {}


class SpecdecProposer:
    """A vLLM ``custom_class`` proposer running a specdec drafter (see the module doc).

    Args:
        vllm_config: vLLM's ``VllmConfig``; read: ``speculative_config``
            (``num_speculative_tokens``, and the ``suffix_decoding_*`` fields for the
            suffix drafter) and ``model_config`` (``max_model_len``, ``tokenizer``, the
            vocabulary size).

    Raises:
        ValueError: no drafter named (neither the class's :attr:`DRAFTER` nor
            ``SPECDEC_VLLM_DRAFTER``), an unknown drafter or option, or a drafter that
            needs more than token ids.
    """

    #: the drafter spec this class runs unless ``SPECDEC_VLLM_DRAFTER`` is set
    DRAFTER: str | None = None

    def __init__(self, vllm_config: Any) -> None:
        spec_config = vllm_config.speculative_config
        model_config = vllm_config.model_config
        from_env = os.environ.get(DRAFTER_ENV)
        spec = from_env or self.DRAFTER
        if not spec:
            raise ValueError(
                f"{type(self).__name__} runs the drafter named by {DRAFTER_ENV} (e.g. "
                f"{DRAFTER_ENV}=suffix:max_depth=32); it is not set"
            )
        try:
            drafter, name, options = self._build(spec, bool(from_env), spec_config, model_config)
        except ValueError as exc:
            source = f"{DRAFTER_ENV}={spec!r}" if from_env else f"{type(self).__name__}"
            raise ValueError(f"{source}: {exc}") from None
        if from_env and self.DRAFTER and name != self.DRAFTER:
            logger.warning(
                "specdec: %s=%s overrides %s's drafter (%s)",
                DRAFTER_ENV, spec, type(self).__name__, self.DRAFTER,
            )  # fmt: skip
        self.name = name
        self.options = options
        self.states = RowStates(
            drafter, spec_config.num_speculative_tokens, model_config.max_model_len
        )

    @staticmethod
    def _build(spec: str, from_env: bool, spec_config: Any, model_config: Any):
        name, values = registry.parse_spec(spec)
        if name == "none":
            raise ValueError(
                "drafter 'none' proposes nothing: leave speculative_config out instead"
            )
        if name == "suffix" and not from_env:
            for field, option in _VLLM_SUFFIX_FIELDS.items():
                if getattr(spec_config, field, None) is not None:
                    values.setdefault(option, getattr(spec_config, field))
        if name not in registry.drafter_names():
            names = registry.drafter_names()
            entries = [registry.drafter_entry(n) for n in names]
            usable = [
                n for n, e in zip(names, entries, strict=True)
                if n != "none" and n not in _NEEDS and not e.needs_draft_model
            ]  # fmt: skip
            raise ValueError(
                f"unknown drafter {name!r}; drafters that run inside vLLM: {', '.join(usable)}"
            )
        options = registry.make_options(name, values)
        check_history_drafter(name)
        if name == "retrieval" and not options.datastore:
            raise ValueError(
                "retrieval needs a datastore: retrieval:datastore=PATH (build one with "
                "`specdec datastore build`)"
            )
        context = registry.DrafterContext(
            target=SimpleNamespace(vocab_size=_vocab_size(model_config),
                                   name=str(model_config.model)),
            tokenizer=_LazyTokenizer(model_config),
            load_draft=_no_draft_model,
        )  # fmt: skip
        drafter = registry.drafter_entry(name).factory(context, options)
        check_history_drafter(name, drafter)
        return drafter, name, options

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load (vLLM calls it for every proposer)."""

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """vLLM's hook: draft tokens per row of the persistent batch (see
        :meth:`RowStates.propose`); ``slot_mappings`` is unused."""
        return self.states.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)


class SuffixProposer(SpecdecProposer):
    """SuffixDecoding with specdec's cross-request cache (``suffix``)."""

    DRAFTER = "suffix"


class NgramProposer(SpecdecProposer):
    """Prompt lookup (``ngram``)."""

    DRAFTER = "ngram"


class RetrievalProposer(SpecdecProposer):
    """REST retrieval (``retrieval``); name its datastore in ``SPECDEC_VLLM_DRAFTER``."""

    DRAFTER = "retrieval"


def _vocab_size(model_config: Any) -> int | None:
    get = getattr(model_config, "get_vocab_size", None)
    return int(get()) if callable(get) else None


def _no_draft_model() -> Any:
    raise ValueError("vLLM's custom_class hook runs no draft model in specdec's proposer")


class _LazyTokenizer:
    """The target's tokenizer, loaded on first use (only some drafters read it)."""

    def __init__(self, model_config: Any) -> None:
        self._source = getattr(model_config, "tokenizer", None) or model_config.model
        self._tokenizer = None

    def _load(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from specdec.tokenizer import Tokenizer

            hf = AutoTokenizer.from_pretrained(self._source)
            self._tokenizer = Tokenizer(hf, name=str(self._source))
        return self._tokenizer

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._load(), name)

    def __len__(self) -> int:
        return len(self._load())
