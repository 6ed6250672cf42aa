"""The training-data contamination check (word 8-grams against Spec-Bench and HumanEval)."""

from __future__ import annotations

import pytest

from specdec.training.contamination import benchmark_items, check_contamination, word_ngrams

TEST = [
    ("a", "Describe the history of the printing press in Europe during the fifteenth century."),
    ("b", "def add(x, y):\n    return x + y  # add two numbers and return their sum"),
]


def test_an_eight_word_copy_is_caught_whatever_its_case_and_punctuation():
    copied = "As I said: the HISTORY of the printing press, in Europe -- during"
    report = check_contamination(["unrelated text", copied], TEST)
    assert report.contaminated == {"a": 2} and not report.clean  # 9 shared words: 2 8-grams
    assert sorted(report.examples) == [
        "history of the printing press in europe during",
        "the history of the printing press in europe",
    ]
    assert report.num_train_texts == 2 and report.num_test_items == 2


def test_seven_shared_words_are_not_a_copy():
    report = check_contamination(["the history of the printing press in Asia"], TEST)
    assert report.clean and report.to_dict()["num_contaminated_items"] == 0


def test_every_shared_ngram_counts_once_per_item():
    text = TEST[1][1] + " " + TEST[1][1]  # the whole item, twice
    report = check_contamination([text, text], TEST)
    assert report.contaminated == {"b": len(word_ngrams(TEST[1][1]))}


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="n-gram size must be >= 1"):
        check_contamination([], TEST, n=0)


def test_the_real_test_sets_index_and_check_themselves():
    try:
        items = benchmark_items()
    except FileNotFoundError as missing:
        pytest.skip(f"a test set is not installed here: {missing}")
    assert len([i for i, _ in items if i.startswith("humaneval/")]) == 164
    assert len({i.split("#")[0] for i, _ in items if i.startswith("spec_bench/")}) == 480
    assert len([i for i, _ in items if i.startswith("outside#")]) == 20
    report = check_contamination([items[0][1]], items)
    assert items[0][0] in report.contaminated
