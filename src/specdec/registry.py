"""The drafter registry: one place maps a drafter's name to its options and its factory.

Configuration (:class:`~specdec.config.SpeculativeConfig`), :class:`~specdec.LLM`, the
CLI's ``--drafter`` choices, ``specdec bench --method`` and the server's per-request
``speculative.method`` all read this table, so a new drafter is one
:func:`register_drafter` call.

A drafter is named with a *spec string*: ``NAME`` or ``NAME:key=value,...``, e.g.
``ngram:min_n=1,max_n=3`` or ``suffix:max_depth=32,global_cache=false``; the options go to
the drafter's options dataclass (frozen, validated in its ``__post_init__``). Each option
may carry a one-line description (:func:`option`); :func:`option_docs` reads them for
``specdec drafters``, ``specdec controllers`` and the docs (:func:`options_markdown`).

Third-party drafters register as plugins: a pip package declares an entry point in the
``specdec.drafters`` group (:data:`PLUGIN_GROUP`) whose object is a :class:`DrafterEntry`,
or a callable returning one or a sequence of them::

    # the plugin's pyproject.toml
    [project.entry-points."specdec.drafters"]
    my-drafter = "my_package.drafting:ENTRY"

The registry loads the group once, the first time a drafter is listed or looked up, so the
CLI's ``--drafter`` and ``specdec drafters``, ``specdec bench --method`` and the server's
``speculative.method`` all see plugin drafters. A plugin that fails to load, or that names
a drafter already registered, is skipped with a :class:`PluginWarning` naming it; it never
stops the built-in drafters from working.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import typing
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from specdec.drafters import options as opts
from specdec.option import HELP, parse_key_values
from specdec.option import option as option  # re-exported for third-party options

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrafterContext:
    """What a drafter factory may use.

    Attributes:
        target: the target backend (vocabulary size, device; layer-skip drafts with it).
        tokenizer: the target's :class:`~specdec.tokenizer.Tokenizer`.
        load_draft: loads (once) and checks the draft model; raises ``ValueError`` when
            none was given.
    """

    target: Any
    tokenizer: Any
    load_draft: Callable[[], Any]


@dataclass(frozen=True)
class DrafterEntry:
    """One registered drafter.

    Attributes:
        name: the name used in configs, ``--drafter``, ``--method`` and the server.
        options: its options dataclass (frozen; every field has a default).
        factory: ``factory(context, options) -> Drafter``.
        summary: one line for ``--help`` and the docs.
        samples: its drafts carry a distribution (trees may sample children, ``draw=iid``
            / ``wor``); deterministic drafters' tokens are verified as point masses.
        needs_draft_model: it drafts with a second model (``draft=`` / ``--draft-model``).
    """

    name: str
    options: type
    factory: Callable[[DrafterContext, Any], Any]
    summary: str
    samples: bool = False
    needs_draft_model: bool = False


_DRAFTERS: dict[str, DrafterEntry] = {}
_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def register_drafter(entry: DrafterEntry, *, replace: bool = False) -> None:
    """Add a drafter to the registry.

    Raises:
        ValueError: the name is taken (unless ``replace``), or has ``:``, ``,``, ``@``,
            ``=`` or a space in it, or ``options`` is not a dataclass whose fields all have
            defaults and are int, float, bool or str (optionally ``| None``).
    """
    _add(_DRAFTERS, "drafter", entry, replace, ":,@= ")


def _add(table: dict, kind: str, entry: Any, replace: bool, forbidden: str) -> None:
    """Check ``entry``'s name and options, then put it in ``table``."""
    if not entry.name or any(c in entry.name for c in forbidden):
        raise ValueError(f"a {kind} name cannot be empty or hold '{forbidden}', got {entry.name!r}")
    if entry.name in table and not replace:
        raise ValueError(f"a {kind} named {entry.name!r} is already registered")
    _check_options_class(entry.name, entry.options)
    table[entry.name] = entry


def _lookup(table: dict, kind: str, name: str) -> Any:
    entry = table.get(name)
    if entry is None:
        hint = ""
        if kind == "drafter" and "@" in name and name.split("@", 1)[0] in table:
            drafter, tree = name.split("@", 1)
            hint = (
                f" (DRAFTER@TREE is bench --method's notation; give them apart: --drafter "
                f"{drafter} --tree {tree}[:OPTIONS], or SpeculativeConfig(method={drafter!r}, "
                f"tree='{tree}[:OPTIONS]'))"
            )
        raise ValueError(f"unknown {kind} {name!r}; choose one of {', '.join(table)}{hint}")
    return entry


def _check_options_class(name: str, cls: type) -> None:
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"options of {name!r} must be a dataclass")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"option {f.name!r} of {name!r} needs a default")
        if _base_type(hints[f.name]) not in _KIND_NAMES:
            raise ValueError(f"option {f.name!r} of {name!r} must be an int, float, bool or str")
        text = f.metadata.get(HELP, "")  # a description is optional
        if not isinstance(text, str) or "\n" in text:
            raise ValueError(f"the description of option {f.name!r} of {name!r} must be one line")


def _base_type(hint: Any) -> Any:
    """``int`` for ``int`` and for ``int | None``."""
    kinds = [t for t in typing.get_args(hint) if t is not type(None)]
    return (kinds or [hint])[0]


#: What :func:`option_docs` gives for an option registered without a description.
NO_DESCRIPTION = "(no description)"


@dataclass(frozen=True)
class OptionDoc:
    """One option of an options dataclass, as ``specdec drafters`` and the docs show it.

    Attributes:
        name: the key in ``NAME:key=value``.
        default: its default value.
        kind: ``"int"``, ``"float"``, ``"bool"`` or ``"str"``.
        help: its one-line description, or :data:`NO_DESCRIPTION`.
    """

    name: str
    default: Any
    kind: str
    help: str

    @property
    def default_text(self) -> str:
        """The default as a spec string writes it (``true``, ``0.5``; ``""`` when empty)."""
        return _value_text(self.default) if self.default != "" else '""'


def option_docs(options_cls: type) -> tuple[OptionDoc, ...]:
    """The options of an options dataclass with their defaults and descriptions.

    Args:
        options_cls: a drafter's or controller's options dataclass (``entry.options``).

    Returns:
        tuple[OptionDoc, ...]: one :class:`OptionDoc` per field, in declaration order.

    Raises:
        ValueError: ``options_cls`` is not a dataclass.
    """
    if not dataclasses.is_dataclass(options_cls):
        raise ValueError(f"{options_cls!r} is not an options dataclass")
    hints = typing.get_type_hints(options_cls)
    return tuple(
        OptionDoc(
            f.name,
            f.default if f.default is not dataclasses.MISSING else f.default_factory(),
            _base_type(hints[f.name]).__name__,
            f.metadata.get(HELP) or NO_DESCRIPTION,
        )
        for f in dataclasses.fields(options_cls)
    )


def options_markdown(kind: str) -> str:
    """The options table of every built-in drafter, or every registered controller, as in
    the docs (plugin drafters are not listed).

    Args:
        kind: ``"drafter"`` or ``"controller"``.

    Returns:
        a Markdown table with columns kind, option, default and description: a row per
        option (the entry's name on its first), a "no options" row for an entry without
        any; no trailing newline.

    Raises:
        ValueError: ``kind`` is neither.
    """
    builtin = {name: _DRAFTERS[name] for name in _BUILTIN_DRAFTERS}
    tables = {"drafter": builtin, "controller": _CONTROLLERS}
    if kind not in tables:
        raise ValueError(f"kind must be 'drafter' or 'controller', got {kind!r}")
    rows = [f"| {kind} | option | default | description |", "|---|---|---|---|"]
    for name, entry in tables[kind].items():
        docs = option_docs(entry.options)
        if not docs:
            rows.append(_markdown_row(f"`{name}`", "", "", "no options"))
        for i, doc in enumerate(docs):
            label = f"`{name}`" if i == 0 else ""
            rows.append(_markdown_row(label, f"`{doc.name}`", f"`{doc.default_text}`", doc.help))
    return "\n".join(rows)


def _markdown_row(*cells: str) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


PLUGIN_GROUP = "specdec.drafters"
"""The entry-point group third-party packages register drafters in."""

_BUILTIN_DRAFTERS: tuple[str, ...] = ()
_plugins_loaded = False


class PluginWarning(UserWarning):
    """A drafter plugin was skipped (it failed to load, or its name is taken)."""


def load_plugins(*, reload: bool = False) -> tuple[str, ...]:
    """Register the drafters of every ``specdec.drafters`` entry point (once).

    Each entry point's object is a :class:`DrafterEntry`, or a callable returning one or a
    sequence of them. Called by :func:`drafter_names` and :func:`drafter_entry`, so a
    caller seldom needs it.

    Args:
        reload: load the group again (after installing a plugin in a running process);
            drafters registered before are kept.

    Returns:
        the names of the drafters registered by this call, in entry-point order.

    Warns:
        PluginWarning: for each entry point that cannot be loaded, returns something other
            than drafter entries, or names a drafter already registered; it is skipped.
    """
    global _plugins_loaded
    if _plugins_loaded and not reload:
        return ()
    _plugins_loaded = True
    added: list[str] = []
    for point in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        where = f"drafter plugin {point.name!r} ({point.value})"
        try:
            obj = point.load()
            entries = obj() if callable(obj) and not isinstance(obj, DrafterEntry) else obj
            if isinstance(entries, DrafterEntry):
                entries = (entries,)
            entries = tuple(entries) if isinstance(entries, (list, tuple)) else ()
            if not entries or not all(isinstance(e, DrafterEntry) for e in entries):
                raise TypeError(
                    "its object must be a DrafterEntry, a sequence of them, or a callable "
                    "returning either"
                )
        except Exception as exc:  # noqa: BLE001 - one broken plugin must not stop the rest
            warnings.warn(f"skipped {where}: {exc}", PluginWarning, stacklevel=2)
            continue
        for entry in entries:
            try:
                register_drafter(entry)
            except ValueError as exc:
                warnings.warn(
                    f"skipped drafter {entry.name!r} of {where}: {exc}", PluginWarning,
                    stacklevel=2,
                )  # fmt: skip
            else:
                added.append(entry.name)
    return tuple(added)


def drafter_names() -> tuple[str, ...]:
    """Registered drafter names: the built-in ones in registration order, then plugins'
    (:func:`load_plugins`) and any added by :func:`register_drafter`."""
    load_plugins()
    return tuple(_DRAFTERS)


def builtin_drafter_names() -> tuple[str, ...]:
    """The drafters that ship with specdec (no plugins), in registration order."""
    return _BUILTIN_DRAFTERS


def drafter_entry(name: str) -> DrafterEntry:
    """The registry entry for ``name``.

    Raises:
        ValueError: no drafter has that name (the message lists the names).
    """
    if name not in _DRAFTERS:
        load_plugins()
    return _lookup(_DRAFTERS, "drafter", name)


def _nests(options_cls: type) -> bool:
    """Whether a drafter's options name another drafter inside them (``model_spec``: a
    ``hybrid``'s ``model=``)."""
    return hasattr(options_cls, "model_spec")


def check_ready(name: str, options: Any) -> None:
    """What building drafter ``name`` with ``options`` (its options dataclass) needs that
    can be checked without a model: the options' own ``check_ready`` (a datastore file),
    and for options that name another drafter (a ``hybrid``'s ``model=``) that drafter,
    its options and their needs. Called by :class:`~specdec.config.SpeculativeConfig`, so
    the CLI refuses them before loading.

    Raises:
        ValueError: what is missing or wrong (a nested drafter's naming ``NAME:model=...``).
    """
    ready = getattr(options, "check_ready", None)
    if ready is not None:
        ready()
    if _nests(type(options)):
        inner, values, _ = nested_drafter(name, options)
        try:
            check_ready(inner, make_options(inner, values))
        except ValueError as exc:
            raise ValueError(f"{name}:model={options.model}: {exc}") from exc


def needs_draft_model(name: str, options: Mapping[str, Any] | Any | None = None) -> bool:
    """Whether drafter ``name`` with ``options`` (its options dataclass, a mapping of
    unparsed values, or ``None``) drafts with a second model: ``draft-model``, or a
    drafter whose options name one that does (a ``hybrid``'s ``model=``).

    Raises:
        ValueError: unknown drafter or invalid options (as :func:`make_options`).
    """
    if drafter_entry(name).needs_draft_model:
        return True
    if _nests(drafter_entry(name).options):
        inner, values, _ = nested_drafter(name, make_options(name, options))
        return needs_draft_model(inner, values)
    return False


def parse_spec(text: str) -> tuple[str, dict[str, str]]:
    """``"suffix:max_depth=32"`` -> ``("suffix", {"max_depth": "32"})`` (values unparsed).

    Raises:
        ValueError: an item without ``=`` or an option given twice; bench's
            ``DRAFTER@TREE`` notation (with how to give the drafter and tree apart).
    """
    name, _, rest = text.strip().partition(":")
    if "@" in name and name.split("@", 1)[0].strip() in _DRAFTERS:
        drafter_entry(name.strip())  # bench's DRAFTER@TREE: say so before its tree options
    return name.strip(), parse_key_values(rest.split(","), repr(name))


def make_options(name: str, values: Mapping[str, Any] | Any | None = None) -> Any:
    """The options dataclass of drafter ``name`` from a mapping (strings are converted by
    the field's type: int, float, bool ``true/false/1/0``, str), an instance, or ``None``
    (defaults).

    Raises:
        ValueError: unknown drafter or option, a value of the wrong type, an instance of
            another drafter's options, or whatever the options' own validation refuses.
    """
    return _make_options("drafter", name, drafter_entry(name).options, values)


def _make_options(kind: str, name: str, cls: type, values: Any) -> Any:
    if values is None:
        return cls()
    if isinstance(values, cls):
        return values
    if not isinstance(values, Mapping):
        raise ValueError(
            f"options of {kind} {name!r} must be a {cls.__name__} or a mapping, "
            f"got {type(values).__name__}"
        )
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            hint = (
                f" (options: {', '.join(known)}; `specdec {kind}s` describes them)"
                if known
                else " (it takes no options)"
            )
            if key == "k" and kind == "drafter":
                hint += (
                    "; the draft length is --num-speculative-tokens / num_speculative_tokens "
                    "(k= is bench --method's notation)"
                )
            elif kind == "drafter" and _nests(cls):  # a hybrid: its model's options
                hint += f"; the model drafter's options go after ';': model=NAME;{key}=..."
            raise ValueError(f"{kind} {name!r} has no option {key!r}{hint}")
        kwargs[key] = _convert(f"{kind} {name!r}", key, value, hints[key])
    return cls(**kwargs)


def _convert(name: str, key: str, value: Any, hint: Any) -> Any:
    """A string option value as the field's type; other values are checked, not cast."""
    kind = _base_type(hint)
    if value is None and type(None) in typing.get_args(hint):
        return None
    if not isinstance(value, str):
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise ValueError(f"option {key!r} of {name} needs {_KIND_NAMES[kind]}, got {value!r}")
        return value
    try:
        if kind is bool:
            lowered = value.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return lowered in ("true", "1", "yes")
        return kind(value)
    except ValueError:
        raise ValueError(
            f"option {key!r} of {name} needs {_KIND_NAMES[kind]}, got {value!r}"
        ) from None


def _value_text(value: Any) -> str:
    """An option value as a spec string writes it (``true``, ``0.5``, ``suffix``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def options_string(options: Any) -> str:
    """The options that differ from their defaults, as ``key=value,...`` (``""`` if none)."""
    defaults = type(options)()
    items = []
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if value != getattr(defaults, f.name):
            items.append(f"{f.name}={_value_text(value)}")
    return ",".join(items)


# ---------------------------------------------------------------------- built-in drafters
# Factories import their drafter lazily: configuration must not load torch-heavy modules
# it does not need, and drafter modules import the config.


def _none(context: DrafterContext, options: opts.NoOptions):
    from specdec.drafters.base import NoDrafter

    return NoDrafter()


def _ngram(context: DrafterContext, options: opts.NgramOptions):
    from specdec.drafters.ngram import NgramDrafter

    return NgramDrafter(options.min_n, options.max_n)


def _draft_model(context: DrafterContext, options: opts.DraftModelOptions):
    from specdec.drafters.cross_tokenizer import CrossTokenizerDrafter
    from specdec.drafters.draft_model import DraftModelDrafter, check_vocab_compatible

    draft = context.load_draft()
    mode = options.tokenizers
    if mode == "auto":
        mode = "shared" if draft.tokenizer.get_vocab() == context.tokenizer.get_vocab() else "text"
        if mode == "text":
            logger.warning(
                "draft %s has another tokenizer than %s: its drafts travel as text "
                "(draft-model:tokenizers=auto; chains only, sampled drafts verified as "
                "point masses)", draft.name, context.target.name,
            )  # fmt: skip
    if mode == "text":
        drafter = CrossTokenizerDrafter(draft, context.tokenizer, context.target.vocab_size)
    else:
        check_vocab_compatible(context.target, draft)
        drafter = DraftModelDrafter(draft, context.target.vocab_size, len(context.tokenizer))
    if options.overlap:
        from specdec.drafters.overlap import OverlapDrafter

        return OverlapDrafter(drafter, options.overlap_threads)
    return drafter


def _suffix(context: DrafterContext, options: opts.SuffixOptions):
    from specdec.drafters.suffix import SuffixDrafter

    return SuffixDrafter(options)


def _recycling(context: DrafterContext, options: opts.RecyclingOptions):
    from specdec.drafters.recycling import RecyclingDrafter

    return RecyclingDrafter(context.target.vocab_size, options)


def _layer_skip(context: DrafterContext, options: opts.LayerSkipOptions):
    from specdec.drafters.layer_skip import LayerSkipDrafter

    return LayerSkipDrafter(context.target, options)


def _sparse_kv(context: DrafterContext, options: opts.SparseKVOptions):
    from specdec.drafters.sparse_kv import SparseKVDrafter

    return SparseKVDrafter(context.target, options)


def _quantized(context: DrafterContext, options: opts.QuantizedOptions):
    from specdec.drafters.quantized import QuantizedDrafter

    return QuantizedDrafter(context.target, options)


#: targets already warned about a hybrid over model=quantized (once per target)
_WARNED_HYBRID: weakref.WeakSet = weakref.WeakSet()


def nested_drafter(owner: str, options: Any) -> tuple[str, dict[str, str], DrafterEntry]:
    """``(name, unparsed options, entry)`` of the drafter that drafter ``owner``'s options
    name (``model_spec``: a ``hybrid``'s ``model=``).

    Raises:
        ValueError: no drafter of that name (the message lists the chain drafters: not
            those that nest one, nor ``lookahead``, which adds rows to verification).
    """
    name, values = options.model_spec
    if name not in _DRAFTERS:
        chains = [n for n, e in _DRAFTERS.items() if n != "lookahead" and not _nests(e.options)]
        raise ValueError(
            f"{owner}:model={name}: unknown drafter; choose a chain drafter: {', '.join(chains)}"
        )
    return name, values, _DRAFTERS[name]


def _hybrid(context: DrafterContext, options: opts.HybridOptions):
    from specdec.drafters.hybrid import HybridDrafter
    from specdec.drafters.suffix import SuffixDrafter

    name, values, entry = nested_drafter("hybrid", options)
    try:
        model = entry.factory(context, make_options(name, values))
    except ValueError as exc:
        raise ValueError(f"hybrid:model={options.model}: {exc}") from exc
    weights = getattr(getattr(context.target, "decoder", None), "weights", None)
    quantized = name == "quantized" and getattr(weights, "quantized", False)
    if quantized and context.target not in _WARNED_HYBRID:  # once per target
        _WARNED_HYBRID.add(context.target)
        logger.warning(
            "hybrid:model=quantized on %s, which runs quantized products already: its drafts "
            "cost most of a target step and rarely pay; --drafter suffix is faster on it, or "
            "load the target dense (--quantization none) for the hybrid",
            context.target.name,
        )
    suffix = SuffixDrafter(
        opts.SuffixOptions(max_depth=options.max_depth, global_cache=options.global_cache)
    )
    return HybridDrafter(suffix, model, options)


def _head(context: DrafterContext, kind: str, options):
    """The head of ``options.head`` (or the shipped one), with ``options.quantization``."""
    from specdec.heads.format import load_head, shipped_head_path
    from specdec.heads.modules import quantize_head

    view = context.target.head_view()
    path = options.head
    if not path:
        shipped = shipped_head_path(view, kind)
        if shipped is None:
            raise ValueError(
                f"no {kind} head is shipped for {view.name}: pass {kind}:head=PATH, a head "
                f"trained with `specdec train-head --kind {kind} --model {view.name}`"
            )
        path = str(shipped)
    head = load_head(path, view, kind)
    quantize_head(head, options.quantization)
    head.source = path  # what `specdec generate` reports
    return head


def _eagle(context: DrafterContext, options: opts.EagleOptions):
    from specdec.drafters.eagle import EagleDrafter

    return EagleDrafter(context.target, _head(context, "eagle", options), options)


def _medusa(context: DrafterContext, options: opts.MedusaOptions):
    from specdec.drafters.medusa import MedusaDrafter

    return MedusaDrafter(context.target, _head(context, "medusa", options), options)


def _hydra(context: DrafterContext, options: opts.HydraOptions):
    from specdec.drafters.hydra import HydraDrafter

    return HydraDrafter(context.target, _head(context, "hydra", options), options)


def _parallel(context: DrafterContext, options: opts.ParallelOptions):
    from specdec.drafters.parallel import ParallelDrafter

    return ParallelDrafter(context.target, _head(context, "parallel", options), options)


def _retrieval(context: DrafterContext, options: opts.RetrievalOptions):
    from specdec.drafters.retrieval import Datastore, RetrievalDrafter

    return RetrievalDrafter(Datastore.load(options.datastore, context.tokenizer), options)


def _lookahead(context: DrafterContext, options: opts.LookaheadOptions):
    from specdec.drafters.lookahead import LookaheadDrafter

    return LookaheadDrafter(options)


for _entry in (
    DrafterEntry("none", opts.NoOptions, _none, "no drafter: plain autoregressive decoding"),
    DrafterEntry(
        "ngram", opts.NgramOptions, _ngram, "prompt lookup: copy what followed the suffix"
    ),
    DrafterEntry(
        "draft-model",
        opts.DraftModelOptions,
        _draft_model,
        "a smaller model: shared token ids, or text between two tokenizers",
        samples=True,
        needs_draft_model=True,
    ),
    DrafterEntry(
        "suffix",
        opts.SuffixOptions,
        _suffix,
        "SuffixDecoding: suffix trees over this request and earlier ones",
    ),
    DrafterEntry(
        "recycling",
        opts.RecyclingOptions,
        _recycling,
        "Token Recycling: the target's own earlier top-k candidates per token",
    ),
    DrafterEntry(
        "lookahead",
        opts.LookaheadOptions,
        _lookahead,
        "Lookahead decoding: n-grams from Jacobi iteration in the verification forward",
    ),
    DrafterEntry(
        "retrieval",
        opts.RetrievalOptions,
        _retrieval,
        "REST: what followed the context's longest suffix in a datastore of text",
    ),
    DrafterEntry(
        "layer-skip",
        opts.LayerSkipOptions,
        _layer_skip,
        "self-speculative: the target minus some layers drafts (Draft & Verify, SWIFT)",
        samples=True,
    ),
    DrafterEntry(
        "sparse-kv",
        opts.SparseKVOptions,
        _sparse_kv,
        "long-context self-speculative: the target over a sinks + recent KV window drafts",
        samples=True,
    ),
    DrafterEntry(
        "quantized",
        opts.QuantizedOptions,
        _quantized,
        "self-speculative: the target with 4-bit weights (or 8-bit activations) drafts",
        samples=True,
    ),
    DrafterEntry(
        "hybrid",
        opts.HybridOptions,
        _hybrid,
        "SAM-Decoding / SuffixDecoding hybrid: a confident suffix draft, else a model's",
        samples=True,
    ),
    DrafterEntry(
        "eagle",
        opts.EagleOptions,
        _eagle,
        "EAGLE-3: a trained one-layer head drafts from the target's hidden states",
        samples=True,
    ),
    DrafterEntry(
        "medusa",
        opts.MedusaOptions,
        _medusa,
        "Medusa: trained heads on the target's last hidden state guess further tokens",
        samples=True,
    ),
    DrafterEntry(
        "hydra",
        opts.HydraOptions,
        _hydra,
        "Hydra: Medusa's heads, each also reading the tokens drafted before it",
        samples=True,
    ),
    DrafterEntry(
        "parallel",
        opts.ParallelOptions,
        _parallel,
        "parallel drafting (PARD, DFlash): a trained head proposes a block in one forward",
        samples=True,
    ),
):
    register_drafter(_entry)
_BUILTIN_DRAFTERS = tuple(_DRAFTERS)


# ---------------------------------------------------------------------- controllers


@dataclass(frozen=True)
class ControllerEntry:
    """One registered speculation controller.

    Attributes:
        name: the name used in ``SpeculativeConfig(controller=...)``, ``--controller``,
            ``bench --method ...+NAME`` and the server.
        options: its options dataclass (frozen; every field has a default).
        factory: ``factory(options) -> SpeculationController``.
        summary: one line for ``--help`` and the docs.
    """

    name: str
    options: type
    factory: Callable[[Any], Any]
    summary: str


_CONTROLLERS: dict[str, ControllerEntry] = {}


def register_controller(entry: ControllerEntry, *, replace: bool = False) -> None:
    """Add a speculation controller to the registry.

    Raises:
        ValueError: as :func:`register_drafter` (taken or malformed name, bad options).
    """
    _add(_CONTROLLERS, "controller", entry, replace, ":,@+= ")


def controller_names() -> tuple[str, ...]:
    """Registered controller names, in registration order."""
    return tuple(_CONTROLLERS)


def controller_entry(name: str) -> ControllerEntry:
    """The registry entry for controller ``name``.

    Raises:
        ValueError: no controller has that name (the message lists the names).
    """
    return _lookup(_CONTROLLERS, "controller", name)


def make_controller_options(name: str, values: Mapping[str, Any] | Any | None = None) -> Any:
    """As :func:`make_options`, for controller ``name``."""
    return _make_options("controller", name, controller_entry(name).options, values)


def _register_controllers() -> None:
    from specdec.control import controllers as c

    for entry in (
        ControllerEntry(
            "fixed", c.FixedOptions, c.FixedController,
            "every step drafts the configured k, capped by the tokens left to generate "
            "(reproducible benchmarks)",
        ),
        ControllerEntry(
            "heuristic", c.HeuristicOptions, c.HeuristicController,
            "transformers' schedule: +2 after a fully accepted draft, -1 otherwise",
        ),
        ControllerEntry(
            "confidence", c.ConfidenceOptions, c.ConfidenceController,
            "SpecDec++-style: stop drafting once the predicted rejection chance passes threshold",
        ),
        ControllerEntry(
            "cost", c.CostOptions, c.CostController,
            "k (0 = off) maximizing expected tokens/s from acceptance and measured costs",
        ),
        ControllerEntry(
            "bandit", c.BanditOptions, c.BanditController,
            "UCB over draft lengths (BanditSpec), shorter lengths scored counterfactually",
        ),
    ):  # fmt: skip
        register_controller(entry)


_register_controllers()
