"""Parse ``--tree`` specifications into a validated :class:`TreeSpec`.

Grammar (``KIND:OPTIONS``, options ``key=value`` separated by commas)::

    static:<preset or paths.json>[,draw=top|iid|wor]
    dynamic:top_k=4,depth=5,budget=16[,adaptive=true]
    best-first:budget=16,depth=6[,adaptive=true]
    sequoia:budget=16,depth=6

A bare preset (``tree-16``, ``chain-4``) is read as ``static:`` it, a bare kind
(``dynamic``, ``best-first``, ``sequoia``) as that kind with its default options.

The tree budget (draft nodes verified per step) is the knob that trades verification
cost for acceptance length; ``adaptive=true`` makes it the most a step verifies, each step
keeping only the nodes that pay for their rows (:func:`specdec.trees.builders.adaptive_size`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

RankPath = tuple[int, ...]

#: Static presets as rank paths (Medusa "choices" style): ``(0, 1)`` is the second most
#: probable child of the most probable first token. tree-8/16/32 are Sequoia-optimal
#: shapes (:func:`specdec.trees.sequoia.sequoia_tree`) under the prior per-rank acceptance
#: (0.55, 0.15, 0.07, 0.04, 0.02, 0.01); ``chain-<k>`` is a single path of k nodes.
PRESETS: dict[str, tuple[RankPath, ...]] = {
    "tree-8": ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)),
    "tree-16": (
        (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1),
        (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0),
    ),
    "tree-32": (
        (0,), (1,), (2,), (3,), (4,), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (2, 0),
        (3, 0), (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 2, 0), (1, 0, 0), (2, 0, 0),
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0), (0, 0, 0, 0, 0),
        (0, 0, 0, 1, 0), (0, 0, 1, 0, 0), (0, 1, 0, 0, 0), (1, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0),
        (0, 0, 0, 0, 0, 0, 0),
    ),
}  # fmt: skip

KINDS = ("static", "dynamic", "best-first", "sequoia")
DRAWS = ("top", "iid", "wor")
_OPTIONS = {
    "static": {"draw"},
    "dynamic": {"top_k", "depth", "budget", "adaptive"},
    "best-first": {"budget", "depth", "adaptive"},
    "sequoia": {"budget", "depth"},
}
MAX_BUDGET = 1024
MAX_TOP_K = 64
MAX_DEPTH = 128
MAX_SEQUOIA_BUDGET = 128


class TreeSpecError(ValueError):
    """A token-tree spec that does not parse, as :class:`~specdec.config.SpeculativeConfig`
    reports it: its option names (``top_k``, ``depth``, ...) are the spec's own, which the
    CLI must not rewrite as its flags (``--top-k`` is the sampling flag)."""


@dataclass(frozen=True)
class TreeSpec:
    """A validated tree configuration.

    Attributes:
        kind: ``static`` (rank paths), ``dynamic`` (EAGLE-2), ``best-first`` (DDTree) or
            ``sequoia`` (optimal shape from measured per-rank acceptance).
        paths: static rank paths (every prefix included), else ``()``.
        source: the preset name or file the static paths came from.
        draw: static only: ``top`` (children are the draft's top-ranked tokens,
            deterministic), ``iid`` (sampled with replacement, SpecInfer) or ``wor``
            (sampled without replacement, RSD); the last two need a draft model and
            temperature > 0.
        top_k: dynamic: children per expanded node and nodes expanded per level.
        depth: deepest draft level (dynamic, best-first, sequoia).
        budget: draft nodes per step (dynamic, best-first, sequoia); with ``adaptive``
            the most per step.
        adaptive: dynamic and best-first: verify each step only the ranked nodes whose
            expected acceptance pays for their rows in the cost model's forward time
            (OPT-Tree, Wang et al. 2024, arXiv:2406.17276).
    """

    kind: str
    paths: tuple[RankPath, ...] = ()
    source: str = ""
    draw: str = "top"
    top_k: int = 4
    depth: int = 5
    budget: int = 16
    adaptive: bool = False

    def __post_init__(self) -> None:
        """Validate every field (so a TreeSpec built in Python is checked like a parsed one).

        Raises:
            ValueError: unknown kind or draw, a non-positive or too large number, or
                static paths that are missing or not a tree.
        """
        if self.kind not in KINDS:
            raise ValueError(f"unknown tree kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.draw not in DRAWS:
            raise ValueError(f"draw must be one of {', '.join(DRAWS)}, got {self.draw!r}")
        for key in ("top_k", "depth", "budget"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"tree option {key} must be an integer >= 1, got {value!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"tree option adaptive must be true or false, got {self.adaptive!r}")
        if self.adaptive and self.kind not in ("dynamic", "best-first"):
            raise ValueError(
                f"adaptive=true sizes dynamic and best-first trees, not {self.kind} trees"
            )
        if self.kind == "static":
            paths = validate_paths(
                [list(p) if isinstance(p, (list, tuple)) else p for p in self.paths],
                self.source or "paths",
            )
            object.__setattr__(self, "paths", paths)
            if not self.source:
                object.__setattr__(self, "source", "<paths>")
        elif self.paths:
            raise ValueError(f"paths are only used by static trees, not {self.kind}")
        if self.budget > MAX_BUDGET or len(self.paths) > MAX_BUDGET:
            raise ValueError(f"a tree has at most {MAX_BUDGET} nodes (budget)")
        if self.kind == "sequoia" and self.budget > MAX_SEQUOIA_BUDGET:
            raise ValueError(
                f"a sequoia tree has at most {MAX_SEQUOIA_BUDGET} nodes (its dynamic program "
                "costs budget**2 * depth)"
            )
        if self.top_k > MAX_TOP_K:
            raise ValueError(f"top_k is at most {MAX_TOP_K} (top_k**2 candidates per level)")
        if self.depth > MAX_DEPTH or max(map(len, self.paths), default=0) > MAX_DEPTH:
            raise ValueError(f"a tree is at most {MAX_DEPTH} levels deep")

    def __str__(self) -> str:
        if self.kind == "static":
            return f"static:{self.source}" + ("" if self.draw == "top" else f",draw={self.draw}")
        adaptive = ",adaptive=true" if self.adaptive else ""
        if self.kind == "dynamic":
            return f"dynamic:top_k={self.top_k},depth={self.depth},budget={self.budget}{adaptive}"
        return f"{self.kind}:budget={self.budget},depth={self.depth}{adaptive}"

    @property
    def num_nodes(self) -> int:
        """Most draft nodes a step can verify."""
        return len(self.paths) if self.kind == "static" else self.budget

    @classmethod
    def parse(cls, text: str | TreeSpec) -> TreeSpec:
        """Parse a ``--tree`` string (see the module docstring).

        Raises:
            ValueError: unknown kind or option, a bad number, a missing or malformed paths
                file, or paths that are not a tree (a path whose prefix is missing).
        """
        if isinstance(text, TreeSpec):
            return text
        if isinstance(text, str) and ":" not in text:  # a bare preset or kind
            bare = text.strip()
            if bare in PRESETS or re.fullmatch(r"chain-\d+", bare):
                text = f"static:{bare}"
            elif bare in KINDS and bare != "static":
                text = f"{bare}:"  # its default options
        if not isinstance(text, str) or ":" not in text:
            raise ValueError(
                f"tree spec {text!r} must look like KIND:OPTIONS with KIND one of "
                f"{', '.join(KINDS)} (e.g. 'dynamic:top_k=4,depth=5,budget=16')"
            )
        kind, _, rest = text.partition(":")
        kind = kind.strip()
        if kind not in KINDS:
            raise ValueError(f"unknown tree kind {kind!r}; choose one of {', '.join(KINDS)}")
        items = [item.strip() for item in rest.split(",") if item.strip()]
        fields: dict = {"kind": kind}
        if kind == "static":
            if not items or "=" in items[0]:
                presets = ", ".join([*PRESETS, "chain-<k>"])
                raise ValueError(f"static tree needs a preset ({presets}) or a paths file")
            source = items.pop(0)
            fields["source"] = source
            fields["paths"] = _load_paths(source)
        for item in items:
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or key not in _OPTIONS[kind]:
                allowed = ", ".join(sorted(_OPTIONS[kind]))
                raise ValueError(f"unknown option {item!r} for a {kind} tree (allowed: {allowed})")
            if key in fields:
                raise ValueError(f"tree option {key} given twice in {text!r}")
            if key == "draw":
                if value not in DRAWS:
                    raise ValueError(f"draw must be one of {', '.join(DRAWS)}, got {value!r}")
                fields[key] = value
            elif key == "adaptive":
                if value.strip().lower() not in ("true", "false"):
                    raise ValueError(f"tree option adaptive must be true or false, got {value!r}")
                fields[key] = value.strip().lower() == "true"
            else:
                fields[key] = _positive_int(key, value)
        return cls(**fields)


def names_a_file(text: str) -> bool:
    """Whether a ``--tree`` string is a static tree read from a paths file (not a preset
    or ``chain-K``), found without touching the file system: a server refuses such specs
    from its clients, whose paths would open files on the server's disk."""
    kind, _, rest = text.partition(":")
    if kind.strip() != "static":
        return False
    source = rest.split(",", 1)[0].strip()
    return source not in PRESETS and re.fullmatch(r"chain-\d+", source) is None


def _positive_int(key: str, value: str) -> int:
    if not re.fullmatch(r"\s*\d+\s*", value) or int(value) < 1:
        raise ValueError(f"tree option {key} must be an integer >= 1, got {value!r}")
    return int(value)


def _load_paths(source: str) -> tuple[RankPath, ...]:
    chain = re.fullmatch(r"chain-(\d+)", source)
    if chain:
        k = int(chain.group(1))
        if not 1 <= k <= MAX_BUDGET:
            raise ValueError(f"chain preset length must be 1..{MAX_BUDGET}, got {k}")
        return tuple((0,) * i for i in range(1, k + 1))
    if source in PRESETS:
        return PRESETS[source]
    path = Path(source).expanduser()
    if path.is_dir():
        raise ValueError(f"{source!r} is a directory, not a JSON file of rank paths")
    if not path.is_file():
        raise ValueError(
            f"{source!r} is neither a preset ({', '.join([*PRESETS, 'chain-<k>'])}) nor a file "
            "(file names cannot contain commas)"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{source}: not a JSON list of rank paths ({exc})") from exc
    return validate_paths(data, source)


def validate_paths(data, source: str = "paths") -> tuple[RankPath, ...]:
    """Check rank paths (a JSON-like list of lists of ints >= 0) form a tree.

    Returns:
        The paths as tuples, sorted by length then lexicographically.

    Raises:
        ValueError: not a non-empty list of non-empty int lists, a duplicate, or a path
            whose parent path is missing.
    """
    if isinstance(data, tuple):
        data = [list(p) if isinstance(p, tuple) else p for p in data]
    if not isinstance(data, list) or not data:
        raise ValueError(f"{source}: expected a non-empty JSON list of rank paths like [[0], [1]]")
    paths = []
    for entry in data:
        if (
            not isinstance(entry, list)
            or not entry
            or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in entry)
        ):
            raise ValueError(f"{source}: {entry!r} is not a non-empty list of ranks >= 0")
        paths.append(tuple(entry))
    if len(set(paths)) != len(paths):
        raise ValueError(f"{source}: duplicate paths")
    present = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in present:
            raise ValueError(f"{source}: path {list(p)} has no parent path {list(p[:-1])}")
    return tuple(sorted(paths, key=lambda p: (len(p), p)))
