import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.drafters import NgramDrafter
from specdec.drafters.ngram import find_ngram_continuation


def _find(ids, min_n=1, max_n=3, k=4):
    return find_ngram_continuation(np.array(ids, dtype=np.int64), min_n, max_n, k).tolist()


def test_longest_ngram_wins_over_shorter():
    # suffix "1 2 3": the trigram occurs once (followed by 7); "3" alone first occurs before 9.
    assert _find([3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]) == [7, 8, 5, 1]


def test_earliest_occurrence_is_used():
    assert _find([4, 5, 1, 4, 5, 2, 4, 5], min_n=2, max_n=2, k=1) == [1]


def test_no_match_and_caps():
    assert _find([1, 2, 3, 4]) == []
    assert _find([1, 2, 1], k=0) == []
    assert _find([1, 2, 1], k=5) == [2, 1]  # continuation cut at the end of the sequence
    assert _find([7]) == []


def test_min_n_excludes_short_matches():
    assert _find([5, 6, 9, 5], min_n=2, max_n=3) == []
    assert _find([5, 6, 9, 5], min_n=1, max_n=3) == [6, 9, 5]


@given(
    ids=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    k=st.integers(0, 6),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
)
@settings(max_examples=200, deadline=None)
def test_continuation_follows_a_real_match(ids, k, min_n, extra):
    max_n = min_n + extra
    arr = np.array(ids, dtype=np.int64)
    found = find_ngram_continuation(arr, min_n, max_n, k).tolist()
    assert len(found) <= k
    if not found:
        return
    # Some earlier window equal to a suffix of length n in [min_n, max_n] is followed by found.
    assert any(
        ids[start : start + n] == ids[len(ids) - n :]
        and ids[start + n : start + n + len(found)] == found
        for n in range(min_n, max_n + 1)
        for start in range(0, len(ids) - n)
    )


def test_drafter_is_deterministic_point_mass():
    drafter = NgramDrafter(1, 2)
    proposal = drafter.propose([1, 2, 3, 1, 2], 2, torch.Generator())
    assert proposal.token_ids == [3, 1] and proposal.draft_probs is None
