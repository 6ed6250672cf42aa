"""Options dataclasses of the built-in drafters (frozen, validated on construction).

Each is what ``NAME:key=value,...`` configures (see :mod:`specdec.registry`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from specdec.option import option, parse_key_values


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if not _int(value) or value < low or (high is not None and value > high):
        upper = f" and <= {high}" if high is not None else ""
        raise ValueError(f"{name} must be an integer >= {low}{upper}, got {value!r}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def _check_fraction(name: str, value) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


@dataclass(frozen=True)
class NoOptions:
    """A drafter without options (``none``, ``draft-model``)."""


@dataclass(frozen=True)
class NgramOptions:
    """Prompt lookup.

    Attributes:
        min_n, max_n: n-gram sizes matched, longest first (1 <= min_n <= max_n; sizes
            beyond the text's length are skipped).
    """

    min_n: int = option(2, "shortest n-gram matched, in tokens (1 to max_n)")
    max_n: int = option(4, "longest n-gram matched and tried first, in tokens (>= min_n)")

    def __post_init__(self) -> None:
        _check_int("min_n", self.min_n, 1)
        _check_int("max_n", self.max_n, 1)
        if self.min_n > self.max_n:
            raise ValueError(f"need min_n <= max_n, got {self.min_n} and {self.max_n}")


@dataclass(frozen=True)
class DraftModelOptions:
    """An independent draft model (Leviathan et al. 2023; Chen et al. 2023); see
    :mod:`specdec.drafters.draft_model` and, for a draft with another tokenizer,
    :mod:`specdec.drafters.cross_tokenizer`.

    Attributes:
        tokenizers: ``auto`` (default): token ids are shared when the draft's vocabulary
            is the target's, else drafts travel as text (Universal Assisted Generation /
            SLEM: greedy output identical to plain decoding, sampled drafts verified as
            point masses, chains only); ``shared``: refuse a draft whose vocabulary
            differs; ``text``: always translate through text (for testing the text path
            on a pair that shares a tokenizer).
        overlap: draft the next step in a background thread while the target verifies
            this one (PEARL's post-verify, :mod:`specdec.drafters.overlap`); chains only.
        overlap_threads: PyTorch threads of the background thread (>= 1).
    """

    tokenizers: str = option(
        "auto", "auto: shared ids when the vocabularies match, else text; shared; text"
    )
    overlap: bool = option(
        False, "draft the next step in the background while this one is verified (chains)"
    )
    overlap_threads: int = option(1, "PyTorch threads of the background drafting thread (>= 1)")

    def __post_init__(self) -> None:
        _check_int("overlap_threads", self.overlap_threads, 1)
        if self.overlap_threads != 1 and not self.overlap:
            raise ValueError("overlap_threads applies only with overlap=true")
        if self.tokenizers not in ("auto", "shared", "text"):
            raise ValueError(f"tokenizers must be auto, shared or text, got {self.tokenizers!r}")


@dataclass(frozen=True)
class HybridOptions:
    """Hybrid drafting (SAM-Decoding, Hu et al. 2024, arXiv:2411.10666; SuffixDecoding's
    hybrid, Oliaro et al. 2025, arXiv:2411.04975): a suffix-tree draft when its score
    reaches ``threshold``, else the model drafter's.

    Attributes:
        model: the model drafter: a registered chain drafter's name, optionally with its
            options after ``;`` (``quantized;kernel=fma``, ``eagle;head=DIR``), since
            ``,`` separates the hybrid's own options; not ``hybrid`` itself.
        threshold: the least score (expected accepted tokens of the suffix draft, under
            the tree's continuation frequencies) for the suffix draft to be taken (>= 0).
        model_tokens: the most tokens the model drafter drafts in a step (>= 0; ``0``: as
            many as the step allows). A suffix draft is free to make, a model's costs a
            forward per token, so the step's length (``k``) can be long for the suffix
            draft (e.g. 16) while the model's stays short (e.g. 5).
        max_depth: the suffix trees' depth (the suffix drafter's ``max_depth``, 2 to 256).
        global_cache: the suffix drafter's ``global_cache`` (also match earlier requests).
        choose: ``threshold`` (default): the suffix draft when its score reaches
            ``threshold``; ``goodput``: per step, the draft with the higher expected
            tokens per second, ``(1 + E[accepted]) / (draft time + verification time)``,
            each term learned online (:class:`specdec.drafters.hybrid.GoodputChoice`);
            ``threshold`` still decides for seeded sampled requests, whose output must
            not depend on timing.
    """

    model: str = option(
        "quantized", "the model drafter, options after ';' (e.g. 'quantized;kernel=fma')"
    )
    threshold: float = option(
        2.0, "take the suffix draft when its expected accepted tokens are at least this (>= 0)"
    )
    model_tokens: int = option(
        0, "most tokens the model drafter drafts in a step (>= 0; 0: as many as k allows)"
    )
    max_depth: int = option(24, "the suffix trees' depth, hence their longest draft (2 to 256)")
    global_cache: bool = option(True, "the suffix draft also matches earlier requests")
    choose: str = option(
        "threshold",
        "threshold: suffix draft if its score reaches threshold; goodput: learned, more tokens/s",
    )

    def __post_init__(self) -> None:
        if self.choose not in ("threshold", "goodput"):
            raise ValueError(f"choose must be threshold or goodput, got {self.choose!r}")
        name, _ = self.model_spec
        if not name:
            raise ValueError(f"model must name a drafter, got {self.model!r}")
        if name == "hybrid":
            raise ValueError("model cannot be hybrid itself")
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
            raise ValueError(f"threshold must be a number >= 0, got {t!r}")
        _check_int("model_tokens", self.model_tokens, 0)
        _check_int("max_depth", self.max_depth, 2, 256)
        _check_bool("global_cache", self.global_cache)

    @property
    def model_spec(self) -> tuple[str, dict[str, str]]:
        """``(name, {option: value})`` of ``model`` (values unparsed).

        Raises:
            ValueError: an option item without ``=``, or one given twice.
        """
        name, *items = (part.strip() for part in str(self.model).split(";"))
        return name, parse_key_values(items, f"hybrid's model {name!r}")

    @property
    def model_name(self) -> str:
        """The model drafter's name."""
        return self.model_spec[0]


@dataclass(frozen=True)
class SuffixOptions:
    """SuffixDecoding (Oliaro et al. 2024, arXiv:2411.04975).

    Attributes:
        max_depth: longest suffix stored, hence the longest match and draft (2 to 256).
        max_spec_factor: a step drafts at most ``max_spec_factor * match_length`` tokens
            (the paper's α; > 0): longer matches earn longer drafts.
        min_token_prob: stop a draft path where its estimated probability (product of
            continuation frequencies) falls below this (in [0, 1]).
        global_cache: also match against a tree of earlier requests' prompts and outputs
            (shared by every sequence of the drafter).
        max_cached_requests: requests the global tree holds; the least recently finished
            is evicted first (>= 1).
    """

    max_depth: int = option(
        24, "longest suffix stored, hence the longest match and draft, in tokens (2 to 256)"
    )
    max_spec_factor: float = option(
        1.0, "a step drafts at most max_spec_factor * match length tokens (> 0)"
    )
    min_token_prob: float = option(
        0.1, "end a draft path where its estimated probability falls below this (0 to 1)"
    )
    global_cache: bool = option(
        True, "also match earlier requests' prompts and outputs (one tree for all sequences)"
    )
    max_cached_requests: int = option(
        256, "earlier requests the global tree holds; least recently finished go first (>= 1)"
    )

    def __post_init__(self) -> None:
        _check_int("max_depth", self.max_depth, 2, 256)
        factor = self.max_spec_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"max_spec_factor must be a number > 0, got {factor!r}")
        _check_fraction("min_token_prob", self.min_token_prob)
        _check_bool("global_cache", self.global_cache)
        _check_int("max_cached_requests", self.max_cached_requests, 1)


@dataclass(frozen=True)
class RecyclingOptions:
    """Token Recycling (Luo et al. 2024, arXiv:2408.08696).

    Attributes:
        top_k: candidates kept per token in the adjacency table (1 to 64).
        shared: one table for every sequence of the drafter, kept across requests (the
            paper's "hot start"); ``false`` gives each sequence its own, starting empty.
    """

    top_k: int = option(8, "candidate next tokens kept per token in the table (1 to 64)")
    shared: bool = option(
        True, "one table for all sequences, kept across requests; false: one per sequence"
    )

    def __post_init__(self) -> None:
        _check_int("top_k", self.top_k, 1, 64)
        _check_bool("shared", self.shared)


def parse_layer_set(text: str) -> tuple[int, ...]:
    """Parse a set of layer indices: ``"4-11+14"`` or ``"4-11,14"`` -> ``(4, 5, ..., 11, 14)``.

    Items are separated by ``+`` (usable inside a drafter spec string, whose options are
    separated by commas) or ``,``; an item is an index ``i`` or an inclusive range
    ``a-b`` (``a <= b``). Spaces are ignored. Range checks against a model's depth happen
    when the drafter is built.

    Args:
        text: the set; ``""`` gives the empty tuple.

    Returns:
        the indices, sorted and distinct.

    Raises:
        ValueError: an item that is not a non-negative integer or ``a-b`` range, a range
            with ``a > b``, or an index given twice.

    Example:
        >>> parse_layer_set("4-6+9")
        (4, 5, 6, 9)
    """
    out: list[int] = []
    for item in text.replace(" ", "").replace("+", ",").split(","):
        if not item:
            continue
        match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", item)
        if match is None:
            raise ValueError(f"layer set item {item!r} is not an index or a range like 4-11")
        first = int(match[1])
        last = int(match[2]) if match[2] is not None else first
        if first > last:
            raise ValueError(f"layer range {item!r} is empty (its start exceeds its end)")
        out.extend(range(first, last + 1))
    if len(set(out)) != len(out):
        raise ValueError(f"layer set {text!r} names a layer twice")
    return tuple(sorted(out))


@dataclass(frozen=True)
class LayerSkipOptions:
    """Self-speculative layer skipping (Draft & Verify, arXiv:2309.08168; SWIFT,
    arXiv:2410.06916); see :mod:`specdec.drafters.layer_skip`.

    Attributes:
        skip: a fixed set of decoder layers to skip while drafting, e.g. ``"4-11+14"``
            (see :func:`parse_layer_set`; ``+`` or ``,`` between items); ``""`` (default)
            chooses the set on the fly from measured acceptance (then ``skip_ratio`` and
            the search options apply; otherwise they are ignored).
        skip_ratio: fraction of all layers to skip when choosing on the fly, in [0, 1)
            (rounded to a whole number of layers; the first and last layers are never
            skipped, so at most ``num_layers - 2``). ``0`` drafts with the whole target.
            The default suits small models such as the embedded 135M one (measured on
            one prompt: 0.2 kept more than half of the draft tokens, 0.3 and 0.4 far
            fewer); the papers skip ~0.4-0.5 of 7B-70B models.
        confidence: stop a draft at the first token whose draft top-1 probability is
            below this (the token is not proposed); in [0, 1), ``0`` disables. Chains
            only (tree builders pick their own nodes). The default is low because a
            layer-skipped small model is rarely sure (at 0.5 most drafts stopped at once).
        search_steps: verification steps that evaluate one candidate skip set (>= 1).
        search_rounds: candidate sets tried after the initial one before the best is
            kept for good (>= 0; ``0`` keeps the initial heuristic set).
        seed: seed of the search's own random choices (>= 0); with the same feedback,
            the same seed gives the same sequence of skip sets.
        lookup: a second, free level under the draft (Cascade Speculative Drafting's
            statistical bottom level, Chen et al. 2024, arXiv:2312.11462; ML-SpecQD's
            second level, Georganas et al. 2025): each draft forward also takes up to this
            many tokens that prompt lookup (the ``ngram`` drafter) expects next, and every
            guess the draft agrees with saves a draft forward. The draft tokens stay
            exactly what the draft proposes without it (each row of a forward is what a
            forward of that row alone gives in exact mode); only their cost changes.
            ``0`` (default) disables; chains only.
        vocab: the draft proposes from a subset of the vocabulary, its LM head computing
            only those logits (FR-Spec, Zhao et al. 2025, arXiv:2502.14856): the ``vocab``
            lowest token ids (a BPE tokenizer's merge order, most frequent first;
            a multiple of 8 reads fastest) and every token the sequence has held (see
            :mod:`specdec.drafters.vocab`). Tokens outside it are never drafted; the
            output is unchanged. ``0`` (default) drafts over the whole vocabulary.
    """

    skip: str = option(
        "", "fixed layers skipped while drafting, e.g. 4-11+14; empty: searched on the fly"
    )
    skip_ratio: float = option(
        0.2, "fraction of layers skipped by the on-the-fly search, in [0, 1)"
    )
    confidence: float = option(
        0.3, "end a chain draft before a token whose draft probability is below this; 0: off"
    )
    search_steps: int = option(8, "verification steps that score one candidate skip set (>= 1)")
    search_rounds: int = option(
        12, "candidate skip sets tried after the first before the best is kept (>= 0)"
    )
    seed: int = option(0, "seed of the skip-set search's random choices (>= 0)")
    lookup: int = option(
        0, "tokens prompt lookup guesses per draft forward (a free second level); 0: off"
    )
    vocab: int = option(
        0,
        "draft over the N lowest token ids + the sequence's own tokens (>= 0); "
        "0 or >= the vocabulary size: all",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.skip, str):
            raise ValueError(f"skip must be a string like '4-11+14', got {self.skip!r}")
        parse_layer_set(self.skip)
        for name in ("skip_ratio", "confidence"):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
        _check_int("search_steps", self.search_steps, 1)
        _check_int("search_rounds", self.search_rounds, 0)
        _check_int("seed", self.seed, 0)
        _check_int("lookup", self.lookup, 0)
        _check_int("vocab", self.vocab, 0)


def _check_skip_confidence(skip, confidence) -> None:
    """A fixed self-draft's ``skip`` (a layer set) and ``confidence`` (in [0, 1))."""
    if not isinstance(skip, str):
        raise ValueError(f"skip must be a string like '10-14', got {skip!r}")
    parse_layer_set(skip)
    ok = isinstance(confidence, (int, float)) and not isinstance(confidence, bool)
    if not ok or not 0.0 <= confidence < 1.0:
        raise ValueError(f"confidence must be a number in [0, 1), got {confidence!r}")


#: ``quantization`` values of the ``quantized`` drafter.
DRAFT_QUANTIZATIONS = ("auto", "target", "q4_1", "q8_0", "gguf")
#: ``kernel`` values of the ``quantized`` drafter (``specdec.runtime.quant.QUANT_KERNELS``).
DRAFT_KERNELS = ("auto", "fma", "amx", "dpbf16", "q8")


@dataclass(frozen=True)
class SparseKVOptions:
    """Long-context self-speculation with a sparse KV cache (StreamingLLM's window as the
    draft's cache: Xiao et al. 2024, arXiv:2309.17453; as a self-draft: TriForce, Sun et
    al. 2024, arXiv:2404.11912, and MagicDec, Chen et al. 2025, arXiv:2408.11049); see
    :mod:`specdec.drafters.sparse_kv`.

    Attributes:
        sinks: first cached tokens every draft forward attends to (attention sinks, >= 0).
        recent: last cached tokens every draft forward attends to (>= 1); ``sinks +
            recent`` is the draft's KV budget.
        align: the recent part is extended back to start ``sinks + m * align`` slots
            into the sequence (>= 1; it then holds ``recent + 1`` to ``recent + align``
            slots, the row's own included). The default 64 is the KV cache's block: a long
            sequence's packed blocks
            (:meth:`~specdec.runtime.cache.NativeKVCache.pack_tiles`) then serve the
            window's attention as they are, where an unaligned window packs its keys and
            values again on every draft forward; ``1``: exactly the ``recent`` before the
            row.
        min_context: draft only once the sequence holds at least this many tokens
            (>= 0): below it a windowed forward saves too little of a step to pay for
            drafting (measured on the embedded model, bf16: a step at 2k tokens costs
            1.2x one at 256, at 8k 2.7x).
        skip: decoder layers the draft also skips (as ``layer-skip:skip=``; ``""``:
            none), for a cheaper draft at a lower acceptance.
        confidence: end a chain draft before a token whose draft top-1 probability is
            below this, in [0, 1); ``0`` disables.
        quantization: the draft's products: ``none`` (default: the target's own), or
            quantized weights as the ``quantized`` drafter's ``quantization`` (``auto``,
            ``target``, ``q4_1``, ``q8_0``, ``gguf``; CPU only): the window then saves a
            draft step's KV reads and the blocks its weight reads, as QuantSpec (Tiwari et
            al. 2025, arXiv:2502.10424) pairs 4-bit weights with a 4-bit KV cache.
        kernel: the quantized draft's product kernel, as the ``quantized`` drafter's
            ``kernel`` (``auto`` = ``q8``); only with a ``quantization`` other than
            ``none``.
        lookup: prompt lookup's guesses per draft forward, a free second level that
            makes the same drafts in fewer forwards (as :class:`LayerSkipOptions`'
            ``lookup``); ``0`` (default) disables.
        vocab: draft over the ``vocab`` lowest token ids and the sequence's own tokens
            only (as :class:`LayerSkipOptions`' ``vocab``; ``0``: the whole vocabulary).
            The default, 8192, drafted 1.52x plain decoding at 8k tokens where the whole
            vocabulary drafted 1.38x, at the same mean acceptance length (run 15 of
            ``benchmarks/long_context_cpu``, 2-core Zen 4, quantized window draft): its
            draft forward reads a sixth of the LM head.
    """

    sinks: int = option(16, "first cached tokens the draft attends to (attention sinks, >= 0)")
    recent: int = option(496, "last cached tokens the draft attends to (>= 1)")
    align: int = option(
        64, "start the recent part on a block of this many slots after the sinks (>= 1)"
    )
    min_context: int = option(
        1024, "draft only once the sequence holds this many tokens (>= 0); shorter: plain steps"
    )
    skip: str = option("", "decoder layers the draft also skips, e.g. 10-14; empty: none")
    confidence: float = option(
        0.0,
        "end a chain draft before a token whose draft probability is below this, in [0, 1); 0: off",
    )
    quantization: str = option(
        "none",
        "the draft's products: none (the target's), or quantized as quantized's: auto, target, "
        "q4_1, q8_0, gguf",
    )
    kernel: str = option(
        "auto", "the quantized draft's product kernel, as quantized:kernel= (auto = q8)"
    )
    lookup: int = option(
        0, "tokens prompt lookup guesses per draft forward (a free second level); 0: off"
    )
    vocab: int = option(
        8192,
        "draft over the N lowest token ids + the sequence's own tokens (>= 0); "
        "0 or >= the vocabulary size: all",
    )

    def __post_init__(self) -> None:
        _check_int("sinks", self.sinks, 0)
        _check_int("recent", self.recent, 1)
        _check_int("align", self.align, 1)
        _check_int("min_context", self.min_context, 0)
        _check_int("lookup", self.lookup, 0)
        _check_int("vocab", self.vocab, 0)
        _check_skip_confidence(self.skip, self.confidence)
        _check_quantization(self.quantization, self.kernel, ("none", *DRAFT_QUANTIZATIONS))
        if self.quantization == "none" and self.kernel != "auto":
            raise ValueError(
                f"kernel={self.kernel!r} chooses a quantized draft's kernel: give "
                "quantization too (e.g. quantization=auto), or leave kernel out"
            )


def _check_quantization(quantization, kernel, allowed: tuple[str, ...]) -> None:
    """A self-draft's ``quantization`` (one of ``allowed``) and ``kernel``."""
    if quantization not in allowed:
        raise ValueError(f"quantization must be one of {', '.join(allowed)}, got {quantization!r}")
    if kernel not in DRAFT_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(DRAFT_KERNELS)}, got {kernel!r}")


@dataclass(frozen=True)
class QuantizedOptions:
    """Quantized self-speculation: the target with quantized products drafts (ML-SpecQD,
    Georganas et al. 2025, arXiv:2503.13565; QSpec, Zhao et al. 2025, arXiv:2410.11305);
    see :mod:`specdec.drafters.quantized`.

    Attributes:
        quantization: the draft's blocks. ``auto`` (default): a dense target's weights in
            its GGUF file's blocks when it came from one, else quantized to ``q4_1`` at
            load; a quantized target's own blocks (``target``). ``q4_1`` / ``q8_0`` /
            ``gguf``: as ``--quantization`` (dense targets; on a quantized target, the name of
            its own quantization means ``target``).
        kernel: the draft's quantized product kernel: ``auto`` (default) is ``q8``
            (activations rounded to 8 bits, integer dot products: the fastest one-row
            product on the CPUs measured, and a draft's rounding never changes the
            output; Spec-Bench on the embedded model's dense weights, bf16, 2-core AMD
            Zen 4: 1.38x plain decoding on ``q8``, 1.22x on ``dpbf16``), ``fma``,
            ``amx``, ``dpbf16`` (bfloat16 only) or ``q8``.
        skip: decoder layers the draft also skips (as ``layer-skip:skip=``; ``""``:
            none), for a cheaper draft at a lower acceptance.
        confidence: end a chain draft before a token whose draft top-1 probability is
            below this, in [0, 1); ``0`` (default) disables.
        lookup: prompt lookup's guesses per draft forward, a free second level that
            makes the same drafts in fewer forwards (as :class:`LayerSkipOptions`'
            ``lookup``); ``0`` (default) disables.
        vocab: draft over the ``vocab`` lowest token ids and the sequence's own tokens
            only (as :class:`LayerSkipOptions`' ``vocab``); ``0`` (default): the whole
            vocabulary.
    """

    quantization: str = option(
        "auto",
        "the draft's blocks: auto (GGUF's, else q4_1; a quantized target's: target), "
        "q4_1, q8_0, gguf",
    )
    kernel: str = option(
        "auto",
        "the draft's product kernel: auto (= q8: 8-bit activations), q8, fma, amx, "
        "dpbf16 (bf16 only)",
    )
    skip: str = option("", "decoder layers the draft also skips, e.g. 10-14; empty: none")
    confidence: float = option(
        0.0,
        "end a chain draft before a token whose draft probability is below this, in [0, 1); 0: off",
    )

    lookup: int = option(
        0, "tokens prompt lookup guesses per draft forward (a free second level); 0: off"
    )
    vocab: int = option(
        0,
        "draft over the N lowest token ids + the sequence's own tokens (>= 0); "
        "0 or >= the vocabulary size: all",
    )

    def __post_init__(self) -> None:
        _check_quantization(self.quantization, self.kernel, DRAFT_QUANTIZATIONS)
        _check_skip_confidence(self.skip, self.confidence)
        _check_int("lookup", self.lookup, 0)
        _check_int("vocab", self.vocab, 0)


@dataclass(frozen=True)
class RetrievalOptions:
    """REST, retrieval-based speculative decoding (He et al. 2024, arXiv:2311.08252).

    Defaults are the REST reference code's: suffixes of 16 down to 2 tokens, up to 5000
    occurrences retrieved, 10 tokens of each continuation.

    Attributes:
        datastore: path of a datastore built with ``specdec datastore build`` using the
            target's tokenizer (required; the path cannot hold a comma).
        max_match: longest context suffix searched, in tokens (1 to 256; at most what the
            datastore was indexed for).
        min_match: shortest suffix that counts as a match (1 <= min_match <= max_match).
        max_occurrences: occurrences whose continuations form the trie (>= 1); more are
            thinned evenly.
        continuation_length: tokens kept after each occurrence: the trie's depth, hence the
            longest draft (1 to 256).
    """

    datastore: str = option(
        "", "path of a `specdec datastore build` file for the target's tokenizer (required)"
    )
    max_match: int = option(16, "longest context suffix searched, in tokens (1 to 256)")
    min_match: int = option(2, "shortest suffix that counts as a match, in tokens (1 to max_match)")
    max_occurrences: int = option(
        5000, "occurrences whose continuations form the draft trie; more are thinned (>= 1)"
    )
    continuation_length: int = option(
        10, "tokens kept after each occurrence: the longest draft (1 to 256)"
    )

    def __post_init__(self) -> None:
        if not isinstance(self.datastore, str):
            raise ValueError(f"datastore must be a path (a string), got {self.datastore!r}")
        _check_int("max_match", self.max_match, 1, 256)
        _check_int("min_match", self.min_match, 1)
        if self.min_match > self.max_match:
            raise ValueError(
                f"need min_match <= max_match, got {self.min_match} and {self.max_match}"
            )
        _check_int("max_occurrences", self.max_occurrences, 1)
        _check_int("continuation_length", self.continuation_length, 1, 256)

    def check_ready(self) -> None:
        """What building the drafter needs that can be checked without a model (called by
        :class:`~specdec.config.SpeculativeConfig`): a datastore file that exists.

        Raises:
            ValueError: no datastore given, or the path is not a file.
        """
        if not self.datastore:
            raise ValueError(
                "drafter 'retrieval' needs a datastore: retrieval:datastore=PATH, with PATH "
                "built from your text by `specdec datastore build FILES... -o PATH --model "
                "TARGET`"
            )
        path = Path(self.datastore).expanduser()
        what = "a folder" if path.is_dir() else "not found" if not path.is_file() else None
        if what is None:
            with path.open("rb") as handle:
                if handle.read(4) != b"PK\x03\x04":  # .npz files are zip archives
                    what = "not a datastore file"
        if what is not None:
            raise ValueError(
                f"retrieval datastore {path}: {what}; expected a .npz file written by "
                "`specdec datastore build`"
            )


@dataclass(frozen=True)
class LookaheadOptions:
    """Lookahead decoding (Fu et al. 2024, arXiv:2402.02057).

    Attributes:
        window: W, columns of the lookahead window (1 to 64).
        ngram: N, n-gram size; the window has N - 1 rows and drafts are N - 1 tokens
            (2 to 16).
        candidates: G, most n-grams drafted per step (a chain uses the most recent one;
            a token tree merges up to G of them) (1 to 64).

    Each verification also runs ``(N - 1) * W`` lookahead rows.
    """

    window: int = option(5, "W: columns of the lookahead window (1 to 64)")
    ngram: int = option(4, "N: n-gram size; drafts and window rows are N - 1 tokens (2 to 16)")
    candidates: int = option(
        5, "G: most n-grams drafted per step (a chain takes the newest) (1 to 64)"
    )

    def __post_init__(self) -> None:
        _check_int("window", self.window, 1, 64)
        _check_int("ngram", self.ngram, 2, 16)
        _check_int("candidates", self.candidates, 1, 64)


#: ``quantization`` values of the head drafters (``specdec.heads.modules.HEAD_QUANTIZATIONS``,
#: here without importing torch): ``auto`` is ``q8_0`` for a head on the CPU when the
#: native runtime's kernels are available, else ``none``.
HEAD_QUANTIZATION_CHOICES = ("auto", "none", "q8_0", "q4_1")


def _check_head_options(drafter: str, head: str, confidence: float, quantization="auto") -> None:
    if quantization not in HEAD_QUANTIZATION_CHOICES:
        raise ValueError(
            f"quantization must be one of {', '.join(HEAD_QUANTIZATION_CHOICES)}, got "
            f"{quantization!r}"
        )
    ok = isinstance(confidence, (int, float)) and not isinstance(confidence, bool)
    if not ok or not 0.0 <= confidence < 1.0:
        raise ValueError(f"confidence must be a number in [0, 1), got {confidence!r}")
    if not isinstance(head, str):
        raise ValueError(f"head must be a path (a string), got {head!r}")
    if head:
        path = Path(head).expanduser()
        if not path.is_dir() or not (path / "config.json").is_file():
            what = "not found" if not path.exists() else "not a head folder (no config.json)"
            raise ValueError(
                f"{drafter} head {path}: {what}; a head is a folder written by `specdec "
                f"train-head --kind {drafter}`"
            )
        if not (path / "head.safetensors").is_file():
            raise ValueError(
                f"{drafter} head {path} has no head.safetensors (`specdec train-head` writes one)"
            )
        import json  # the kind, before any model loads (load_head checks the rest)

        try:
            kind = json.loads((path / "config.json").read_text("utf-8")).get("kind")
        except (OSError, ValueError, AttributeError):
            kind = None  # malformed: load_head says how
        if isinstance(kind, str) and kind != drafter:
            article = "an" if kind[:1] in "aeiou" else "a"
            raise ValueError(
                f"{drafter} head {path} is {article} {kind} head, not {drafter} (use "
                f"--drafter {kind})"
            )


@dataclass(frozen=True)
class _HeadOptions:
    """The options every trained-head drafter takes (see :class:`EagleOptions`); each
    subclass names its head ``kind``, which a given folder must hold."""

    kind: ClassVar[str] = ""
    head: str = option("", "head folder from specdec train-head; empty: the shipped head")
    confidence: float = option(0.0, "end a chain draft below this draft probability; 0: off")
    quantization: str = option(
        "auto", "head weights: auto (q8_0 on the CPU), none (float), q8_0 or q4_1"
    )

    def __post_init__(self) -> None:
        _check_head_options(self.kind, self.head, self.confidence, self.quantization)


@dataclass(frozen=True)
class EagleOptions(_HeadOptions):
    """EAGLE drafting with a trained head (EAGLE-3, arXiv:2503.01840); see
    :mod:`specdec.drafters.eagle`.

    Attributes:
        head: folder of a head trained for the target by ``specdec train-head --kind
            eagle``; ``""`` (default) uses the head shipped for the embedded model.
        confidence: stop a chain draft before a token whose draft probability is below
            this, in [0, 1) (``0``, the default, never stops early; EAGLE-2's trees use
            the head's confidences instead).
        quantization: the head's weights at inference: ``auto`` (default: ``q8_0`` on
            the CPU, where a draft step's time is its weights' bytes), ``none`` (the
            trained float weights), ``q8_0`` or ``q4_1`` (GGUF blocks run by the native
            runtime's kernel; CPU only). Lossless whatever the choice: drafts are only
            proposals.
    """

    kind: ClassVar[str] = "eagle"


@dataclass(frozen=True)
class HydraOptions(_HeadOptions):
    """Hydra drafting with trained sequentially dependent heads (arXiv:2402.05109); see
    :mod:`specdec.drafters.hydra`.

    Attributes:
        head: folder of heads trained for the target by ``specdec train-head --kind
            hydra``; ``""`` (default) uses the heads shipped for the embedded model.
        confidence: stop a chain draft before a token whose draft probability is below
            this, in [0, 1) (``0``: never).
        quantization: the head's weights at inference (see :class:`EagleOptions`).
    """

    kind: ClassVar[str] = "hydra"


@dataclass(frozen=True)
class ParallelOptions(_HeadOptions):
    """Parallel (block) drafting with a trained head (PARD, arXiv:2504.18583; DFlash,
    arXiv:2602.06036); see :mod:`specdec.drafters.parallel`.

    Attributes:
        head: folder of a head trained for the target by ``specdec train-head --kind
            parallel``; ``""`` (default) uses the head shipped for the embedded model.
        confidence: stop a chain draft before a token whose draft probability is below
            this, in [0, 1) (``0``: never).
        quantization: the head's weights at inference (see :class:`EagleOptions`).
    """

    kind: ClassVar[str] = "parallel"


@dataclass(frozen=True)
class MedusaOptions(_HeadOptions):
    """Medusa drafting with trained heads (arXiv:2401.10774); see
    :mod:`specdec.drafters.medusa`.

    Attributes:
        head: folder of heads trained for the target by ``specdec train-head --kind
            medusa``; ``""`` (default) uses the heads shipped for the embedded model.
        confidence: stop a chain draft before a token whose draft probability is below
            this, in [0, 1) (``0``: never).
        quantization: the head's weights at inference (see :class:`EagleOptions`).
    """

    kind: ClassVar[str] = "medusa"
