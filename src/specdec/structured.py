"""Structured output: a grammar (JSON schema, regex, choice, Lark) masks every verified row.

The grammar engine is `llguidance <https://github.com/guidance-ai/llguidance>`_ (also a
structured-output backend of vLLM and llama.cpp), chosen after measuring it beside
xgrammar and outlines-core on this project's tokenizer (``benchmarks/grammar_cpu``): all
three mask a JSON-schema step in well under a millisecond on CPU; llguidance is one
dependency-free wheel (xgrammar pulls in triton), takes byte-level Hugging Face tokenizers
as they are (outlines-core needs its byte decoding done by hand), and never allows a
special token (``<|endoftext|>``, ``<|im_start|>``) inside a JSON string, which xgrammar
did.

How speculation stays lossless (the invariant of :mod:`specdec.sampling`): the grammar is
one more history-dependent transform. Row i of a verification gets the mask of the grammar
state reached after the committed output *and the draft tokens before row i* (a tree
node's row: its root-to-node path), and every disallowed token's logit becomes ``-inf``
before any other transform reads it. A draft token the grammar forbids therefore has
target probability 0: greedy verification never matches it and rejection sampling never
accepts it, so it is never committed, and the rows after it are never used. Plain decoding
applies the same masks one row at a time, so the output law (greedy: the tokens) is the
same with speculation on or off.

The grammar's end is a terminal condition: when the tokens a step keeps bring the grammar
to a stop (nothing but EOS could follow), the output ends there with ``finish_reason``
``"stop"`` (the first terminal condition in token order wins, see
:func:`specdec.engine.commit.finish_step`).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy and torch load on first use: `import specdec` stays light
    import numpy as np
    import torch

#: Largest grammar source accepted (characters of a schema, regex, Lark text or choices).
MAX_GRAMMAR_CHARS = 1 << 17
#: :attr:`StructuredOutput.kind` in words, for error messages.
_KIND_NAMES = {"json": "JSON schema", "grammar": "grammar (Lark)", "json_object": "JSON object"}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match: exactly one of the fields (vLLM's
    ``StructuredOutputsParams``; OpenAI's ``response_format`` maps onto ``json`` and
    ``json_object``).

    Args:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value valid
            against it (llguidance's JSON-schema subset: types, properties / required /
            additionalProperties, items, enum / const, anyOf / oneOf / allOf, string
            patterns and formats, numeric bounds, ``$ref``).
        regex: the output matches this regular expression in full (Rust ``regex`` syntax,
            as llguidance reads it; no look-around or back-references).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar in llguidance's Lark dialect (``start: ...``).
        json_object: the output is any JSON object (OpenAI's ``{"type": "json_object"}``).
        disable_any_whitespace: JSON only: no whitespace between tokens of the JSON text
            (default: any JSON whitespace is allowed, as in vLLM).

    Attributes:
        kind: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"`` or ``"json_object"``.

    Raises:
        ValueError: none or more than one of the fields given, an empty value, a schema
            that is not a JSON object, a source larger than :data:`MAX_GRAMMAR_CHARS`, or
            a schema, regex or grammar llguidance cannot read (checked here, without a
            tokenizer; what needs the tokenizer is checked when it is compiled, see
            :class:`GrammarCompiler`).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    kind: str = field(init=False, default="")

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "structured output needs exactly one of json, regex, choice, grammar or "
                f"json_object; got {', '.join(given) or 'none'}"
            )
        kind = given[0]
        object.__setattr__(self, "kind", kind)
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as error:
                    raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
            if not isinstance(schema, dict):
                raise ValueError(
                    f"a JSON schema must be a JSON object, got {type(schema).__name__}"
                )
            # stored as JSON text (hashable); key order kept: it orders the properties
            object.__setattr__(self, "json", json.dumps(schema))
        elif kind == "choice":
            choices = self.choice
            if isinstance(choices, str) or not isinstance(choices, Iterable):
                raise ValueError("choice must be a list of strings")
            choices = tuple(choices)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choices)
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{kind} must be a non-empty string")
        if len(self.source_text) > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"the {kind} has {len(self.source_text)} characters; at most "
                f"{MAX_GRAMMAR_CHARS} are accepted"
            )
        self.validated()

    def validated(self, tokenizer=None) -> str:
        """The llguidance grammar of this constraint, checked: without ``tokenizer``
        (construction, before any model loads) its syntax and satisfiability; with an
        ``LLTokenizer`` (:meth:`GrammarCompiler.compile`) also what needs the vocabulary.

        Raises:
            ValueError: ``invalid <kind in words>: <llguidance's reason>`` (a JSON
                schema: ``invalid JSON schema: ...``).
        """
        from llguidance import LLMatcher

        try:
            grammar = self.to_llguidance()
        except ValueError as error:
            raise ValueError(f"invalid {self.kind_name}: {_short(str(error))}") from None
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(f"invalid {self.kind_name}: {_short(error)}")
        return grammar

    @property
    def kind_name(self) -> str:
        """:attr:`kind` in words for messages (``JSON schema``, ``regex``, ...)."""
        return _KIND_NAMES.get(self.kind, self.kind)

    @property
    def source_text(self) -> str:
        """The constraint as text (schema JSON, regex, Lark, or the choices as JSON)."""
        if self.kind == "choice":
            return json.dumps(list(self.choice))
        if self.kind == "json_object":
            return '{"type": "object"}'
        return getattr(self, self.kind)

    def to_llguidance(self) -> str:
        """The llguidance grammar (its JSON form) for this constraint."""
        from llguidance import LLMatcher

        options = {"whitespace_flexible": not self.disable_any_whitespace}
        if self.kind == "json":
            return LLMatcher.grammar_from_json_schema(self.json, defaults=options)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.regex)
        if self.kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in self.choice)
            return LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        return LLMatcher.grammar_from_lark(self.grammar)


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` for one tokenizer and model vocabulary.

    Args:
        tokenizer: the Hugging Face *fast* tokenizer (``PreTrainedTokenizerFast``) of the
            target, with a byte-level (GPT-2 style) or byte-fallback (SentencePiece style)
            vocabulary; llguidance needs each token's bytes.
        vocab_size: the target's logit width (may exceed the tokenizer's: padding ids are
            never allowed).
        eos_token_ids: the ids that end generation; the grammar allows them once it is
            complete.

    The llguidance tokenizer is built on first use (about 0.5 s for a 49k vocabulary) and
    kept; compiled grammars are cached (64 most recent). Thread-safe.

    Raises:
        ValueError: (on first use) a tokenizer llguidance cannot read.
    """

    CACHE_SIZE = 64

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = sorted({int(i) for i in eos_token_ids})
        self._ll = None
        self._cache: OrderedDict[StructuredOutputsParams, str] = OrderedDict()
        self._lock = threading.Lock()

    def _llg_tokenizer(self):
        if self._ll is None:
            import llguidance.hf

            hf = getattr(self.tokenizer, "hf", self.tokenizer)  # a specdec Tokenizer
            eos = self.eos_token_ids or None
            try:
                self._ll = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
            except ValueError as error:
                raise ValueError(
                    "structured output needs a byte-level or byte-fallback fast tokenizer; "
                    f"llguidance cannot read this one: {error}"
                ) from None
        return self._ll

    def compile(self, spec: StructuredOutputsParams) -> str:
        """The validated llguidance grammar of ``spec``.

        Raises:
            ValueError: the schema, regex or grammar is invalid or unsupported (the
                message is llguidance's).
        """
        with self._lock:
            tokenizer = self._llg_tokenizer()
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
                return grammar
            grammar = spec.validated(tokenizer)
            self._cache[spec] = grammar
            if len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
            return grammar

    def matcher(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh per-sequence :class:`GrammarState` for ``spec``.

        Raises:
            ValueError: as :meth:`compile`.
        """
        from llguidance import LLMatcher

        grammar = self.compile(spec)
        matcher = LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind_name}: {_short(matcher.get_error())}")
        return GrammarState(matcher, self.vocab_size)


def _short(message: str) -> str:
    return re.sub(r"\s+", " ", message).strip()[:500]


class GrammarState:
    """One sequence's grammar state: advanced by committed tokens only.

    Args:
        matcher: an ``llguidance.LLMatcher`` at the sequence's committed output.
        vocab_size: the logit width V of the masks.

    Draft tokens are explored with consume-then-rollback, never committed here; a token
    the grammar forbids is never consumed (llguidance's error state is permanent).
    """

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._forced: list[int] | None = None  # forced_tokens at the committed output

    # ------------------------------------------------------------ masks

    def _fill(self, out: np.ndarray) -> None:
        """The current state's bitmask into ``out`` (``[words]`` int32)."""
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def allowed(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        """Which tokens the grammar allows at each verified row.

        Args:
            prefixes: per row, the tokens between the committed output and the row (see
                :func:`specdec.sampling.process_logits`).

        Returns:
            ``[N, V]`` bool, ``True`` = allowed. A row whose prefix holds a token the
            grammar forbids is unreachable (that token has probability 0); it gets the mask
            of the last reachable state on its path, so it stays a valid distribution.

        Raises:
            RuntimeError: the matcher is in an error state (a bug: a forbidden token was
                committed).
        """
        import numpy as np

        m = self.matcher
        if m.is_error():
            raise RuntimeError(f"grammar matcher in an error state: {_short(m.get_error())}")
        bits = np.zeros((len(prefixes), self._words), dtype=np.int32)
        path: list[int] = []  # tokens consumed beyond the committed output
        masks: dict[tuple, np.ndarray] = {}  # consumed path -> the mask of that state

        def mask() -> np.ndarray:
            key = tuple(path)
            if key not in masks:
                masks[key] = np.zeros(self._words, dtype=np.int32)
                self._fill(masks[key])
            return masks[key]

        try:
            for row, prefix in enumerate(prefixes):
                prefix = list(prefix)
                common = 0
                while common < min(len(path), len(prefix)) and path[common] == prefix[common]:
                    common += 1
                if len(path) > common:
                    m.rollback(len(path) - common)
                    del path[common:]
                for token in prefix[common:]:
                    if m.is_stopped() or not _bit(mask(), token):
                        break  # the rest of this row's path is unreachable
                    if not m.consume_token(int(token)):  # cannot happen: the mask allowed it
                        raise RuntimeError(f"grammar refused token {token} it allowed")
                    path.append(int(token))
                bits[row] = mask()
        finally:
            if path:
                m.rollback(len(path))
        return _unpack(bits, self.vocab_size)

    def valid_prefix_length(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (a chain after the committed output) the grammar's
        masks allow in order: the draft tokens after the first forbidden one could never
        be accepted."""
        import torch

        if not tokens:
            return 0
        allowed = self.allowed([list(tokens[:i]) for i in range(len(tokens))])
        index = torch.arange(len(tokens))
        ok = allowed[index, torch.as_tensor(list(tokens), dtype=torch.long)].tolist()
        return next((i for i, good in enumerate(ok) if not good), len(tokens))

    def forced_tokens(self, max_tokens: int) -> list[int]:
        """The tokens the grammar forces after the committed output (at most
        ``max_tokens``): llguidance's fast-forward tokens, the canonical tokenization of
        the bytes every match must continue with (``[{"name":"`` of a compact tool call;
        SGLang's jump-forward decoding). The engine drafts them: under the mask they are
        the only continuation, so verification accepts them (another tokenization of the
        same bytes may be what the target picks: verification decides, as for any draft).

        Returns:
            ``[m]`` token ids, m <= ``max_tokens`` (empty when nothing is forced, or the
            grammar is stopped).
        """
        m = self.matcher
        if max_tokens <= 0 or m.is_stopped() or m.is_error():
            return []
        if self._forced is None:  # once per committed state (a step plans, then drafts)
            self._forced = [int(t) for t in m.compute_ff_tokens()]
        return self._forced[:max_tokens]

    # ------------------------------------------------------------ commit

    def commit(self, tokens: Sequence[int]) -> int:
        """Advance by the tokens a step keeps, stopping after the token that completes
        the grammar.

        Returns:
            how many of ``tokens`` the output keeps (all, or up to and including the one
            after which the grammar is stopped).

        Raises:
            RuntimeError: a token the grammar forbids (verification never commits one).
        """
        m = self.matcher
        self._forced = None
        for i, token in enumerate(tokens):
            if m.is_stopped():
                return i
            if not m.consume_token(int(token)):
                raise RuntimeError(
                    f"grammar refused committed token {token}: {_short(m.get_error())}"
                )
        return len(tokens)

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and nothing but EOS may follow."""
        return bool(self.matcher.is_stopped())

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS may follow)."""
        return bool(self.matcher.is_accepting())


def _bit(words: np.ndarray, token: int) -> bool:
    return 0 <= token < words.size * 32 and bool((int(words[token >> 5]) >> (token & 31)) & 1)


def _unpack(bits: np.ndarray, vocab_size: int) -> torch.Tensor:
    """``[N, words]`` int32 bitmasks (bit j of word w = token 32 w + j) as ``[N, V]``
    bool."""
    import numpy as np
    import torch

    flat = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(flat[:, :vocab_size].astype(bool))
