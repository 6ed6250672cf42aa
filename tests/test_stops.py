"""StopChecker: stop tokens, stop strings, and stop strings held back by ``min_tokens``."""

from __future__ import annotations

import pytest

from specdec.engine import StopChecker

# vLLM's own min_tokens + stop-string case (tests/detokenizer/test_min_tokens.py, PR #22014),
# with a toy detokenizer: id i decodes to PIECES[i].
PIECES = [" is", " Lee", ",", " and", " I", "'m", " a", " stud", "ent", " of"]


def decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def run(checker: StopChecker, ids: list[int], step: int = 1):
    """Feed ``ids`` ``step`` at a time, as the engine does; the first match and the text
    it keeps, or ``None``."""
    done = 0
    while done < len(ids):
        new = min(step, len(ids) - done)
        done += new
        match = checker.check(ids[:done], new)
        if match is not None:
            return match, decode(ids[: match.num_tokens])[: match.text_end]
    return None


IDS = list(range(len(PIECES)))


@pytest.mark.parametrize("step", [1, 3, 10])
@pytest.mark.parametrize(
    ("min_tokens", "kept", "num_tokens"),
    [
        (0, " is L", 2),
        (1, " is L", 2),
        (2, " is Lee, and I'm a stud", 9),
        (5, " is Lee, and I'm a stud", 9),
        (9, None, None),
    ],
)
def test_min_tokens_ignores_stop_strings_inside_its_text(step, min_tokens, kept, num_tokens):
    """vLLM's rule: with min_tokens=5 the "e" of " Lee" (inside the first five tokens'
    text) is ignored and the "e" of " student" stops the output; with 9 every "e" is
    inside and nothing stops. Whatever the step size (speculation commits several tokens
    at once)."""
    result = run(StopChecker((), ("e",), decode, min_tokens=min_tokens), IDS, step)
    if kept is None:
        assert result is None
    else:
        match, text = result
        assert (text, match.num_tokens) == (kept, num_tokens)


def test_a_stop_string_that_straddles_the_min_tokens_boundary_stops():
    """The stop string "Lee," with min_tokens=2 (" is Lee"): it starts inside the held
    text and ends after it, so it counts, as in vLLM (whose search starts len(stop) - 1
    characters back)."""
    checker = StopChecker((), ("Lee,",), decode, min_tokens=2)
    match, text = run(checker, IDS)
    assert (match.num_tokens, text) == (3, " is ")


def test_a_stop_string_wholly_inside_the_min_tokens_text_never_stops():
    checker = StopChecker((), ("Lee",), decode, min_tokens=4)
    assert run(checker, IDS) is None
    assert run(StopChecker((), ("Lee",), decode), IDS)[1] == " is "


def test_stop_tokens_are_not_held_back_by_the_checker():
    """min_tokens holds stop tokens back in the sampling transform (-inf); a stop token
    that does arrive (a grammar allowed it) still ends the output."""
    checker = StopChecker({3}, (), None, min_tokens=6)
    assert checker.check(IDS[:4], 1).num_tokens == 4


def test_negative_min_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        StopChecker((), (), None, min_tokens=-1)
