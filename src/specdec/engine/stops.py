"""Stop conditions: stop tokens (EOS, end-of-turn, user ids) and stop strings."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

#: ``text_end`` of an output that ends with ``finish_reason`` ``"stop"`` but keeps all its
#: text (a completed grammar): without it, ``"stop"`` means the last id is a stop token,
#: which is not part of the text.
WHOLE_TEXT = sys.maxsize


@dataclass
class StopMatch:
    """Where output must end.

    Attributes:
        num_tokens: output tokens to keep (a stop token is kept as the last id).
        text_end: for a stop string, the character offset in the decoded output at which
            text ends (the stop string is dropped); ``None`` for a stop token;
            :data:`WHOLE_TEXT` for a completed grammar.
    """

    num_tokens: int
    text_end: int | None = None


class StopChecker:
    """Finds the first stop inside the tokens one step added.

    Args:
        stop_token_ids: ids that end generation (kept in the ids, not in the text).
        stop_strings: strings that end generation (dropped with everything after them).
        decode: detokenizer ``list[int] -> str``; needed only with stop strings.
        min_tokens: the request's ``min_tokens`` (int >= 0). A stop string counts only
            where it ends after the text of the first ``min_tokens`` output tokens, as in
            vLLM's detokenizer (vLLM PR #22014): one that lies wholly inside that text is
            ignored, one that starts inside it and ends after it stops the output. (Stop
            *tokens* are held back by the sampling transform instead, which puts -inf on
            them until then.)

    Raises:
        ValueError: stop strings without ``decode``, or a negative ``min_tokens``.
    """

    def __init__(
        self,
        stop_token_ids: Iterable[int],
        stop_strings: Iterable[str] = (),
        decode: Callable[[list[int]], str] | None = None,
        min_tokens: int = 0,
    ) -> None:
        self.stop_token_ids = frozenset(stop_token_ids)
        self.stop_strings = tuple(stop_strings)
        if self.stop_strings and decode is None:
            raise ValueError("stop strings need a decode function")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        self.decode = decode
        self.min_tokens = min_tokens

    def check(self, output_ids: list[int], num_new: int) -> StopMatch | None:
        """Return where output must end, or ``None`` to go on.

        Args:
            output_ids: all generated ids so far (prompt excluded), the step's new ones last.
            num_new: how many of them this step added.
        """
        start = len(output_ids) - num_new
        stop_at = next(
            (i + 1 for i in range(start, len(output_ids)) if output_ids[i] in self.stop_token_ids),
            None,
        )
        if self.stop_strings:
            limit = len(output_ids) if stop_at is None else stop_at
            if limit > self.min_tokens:
                match = self._find_stop_string(output_ids, max(start, self.min_tokens), limit)
                if match is not None:
                    return match
        return None if stop_at is None else StopMatch(stop_at)

    def _first_hit(self, text: str, floor: int) -> int | None:
        """Where the earliest stop string in ``text`` that ends after ``floor`` begins."""
        hits = [text.find(s, max(0, floor - len(s) + 1)) for s in self.stop_strings]
        return min((pos for pos in hits if pos >= 0), default=None)

    def _min_tokens_floor(self, output_ids: list[int]) -> int:
        """Characters of the first ``min_tokens`` output tokens' text (0 without
        ``min_tokens``); a partial character at its end (U+FFFD) does not count."""
        if not self.min_tokens:
            return 0
        return len(self.decode(output_ids[: self.min_tokens]).rstrip("\ufffd"))

    def _find_stop_string(self, output_ids: list[int], start: int, limit: int) -> StopMatch | None:
        floor = self._min_tokens_floor(output_ids)
        text_end = self._first_hit(self.decode(output_ids[:limit]), floor)
        if text_end is None:
            return None
        # Fewest tokens whose text already contains a stop string: nothing after it leaks.
        for n in range(max(start, 1), limit + 1):
            if self._first_hit(self.decode(output_ids[:n]), floor) is not None:
                return StopMatch(n, text_end)
        return StopMatch(limit, text_end)


def stop_reason(
    ids: list[int],
    finish_reason: str | None,
    text_end: int | None,
    stop_strings: Iterable[str],
    stop_token_ids: Iterable[int],
    eos_token_ids: Iterable[int],
    decode: Callable[[list[int]], str],
) -> str | int | None:
    """vLLM's ``stop_reason`` of a finished output: the stop string that ended it (the
    first of ``stop_strings`` that begins where its text ends), or the requested stop
    token id it ends with; ``None`` for EOS / end-of-turn, the length limit or a completed
    grammar.

    Args:
        ids: the output's token ids; finish_reason, text_end: as the engine reported them.
        stop_strings, stop_token_ids: the request's.
        eos_token_ids: the ids that end generation by themselves (not a stop reason).
        decode: detokenizer, the one the stop checker used.
    """
    if finish_reason != "stop" or text_end == WHOLE_TEXT:
        return None
    if text_end is None:  # a stop token, the last id
        last = ids[-1] if ids else None
        wanted = set(stop_token_ids)
        return last if last in wanted and last not in set(eos_token_ids) else None
    rest = decode(list(ids))[text_end:]
    return next((s for s in stop_strings if rest.startswith(s)), None)
