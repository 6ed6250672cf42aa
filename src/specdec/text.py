"""Output text from generated token ids: the final text (stops applied, no incomplete
character) and incremental detokenization for streams (the API's ``stream`` and the
server's SSE)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from specdec.tokenizer import Tokenizer


def complete_text(text: str) -> str:
    """Drop a trailing incomplete character.

    A byte-level tokenizer can stop inside a multi-byte UTF-8 character (a token may carry
    only its first bytes); decoding then ends in U+FFFD, the replacement character. As in
    the incremental detokenizers of vLLM and text-generation-inference, trailing U+FFFD is
    taken as such an incomplete tail: it is held back while streaming and dropped from the
    final text (the token ids keep every token).

    Example:
        >>> complete_text("apples and bananas \\ufffd")
        'apples and bananas '
    """
    return text.rstrip("\ufffd")


def final_text(
    tokenizer: Tokenizer, ids: Sequence[int], finish_reason: str | None, text_end: int | None
) -> str:
    """The output text: up to a stop string (``text_end``), without a stop token (finish
    reason ``"stop"`` without ``text_end``), and without an incomplete last character."""
    if text_end is not None:
        return complete_text(tokenizer.decode(ids)[:text_end])
    if finish_reason == "stop":  # ended by a stop token: it is not part of the text
        return complete_text(tokenizer.decode(ids[:-1]))
    return complete_text(tokenizer.decode(ids))


class TextStream:
    """Incremental detokenization of one generation.

    Text that could still become part of a stop string (the last ``len(longest stop) - 1``
    characters) or an incomplete UTF-8 character is held back until it is settled, so
    nothing after a stop is ever emitted, and the concatenated deltas equal
    :func:`final_text`.

    Args:
        tokenizer: decodes the ids.
        stop_strings: the request's stop strings.
    """

    def __init__(self, tokenizer: Tokenizer, stop_strings: Iterable[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0
        self.text: str | None = None  # the final text, once finished

    def push(
        self, new_ids: Sequence[int], finish_reason: str | None = None, text_end: int | None = None
    ) -> str:
        """Add a step's tokens; returns the text now settled (possibly empty). With a
        ``finish_reason`` the rest of the final text is returned and :attr:`text` set."""
        self.ids.extend(new_ids)
        if finish_reason is None:
            text = complete_text(self.tokenizer.decode(self.ids))
            end = max(self.sent, len(text) - self.holdback)
            delta, self.sent = text[self.sent : end], end
            return delta
        self.text = final_text(self.tokenizer, self.ids, finish_reason, text_end)
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta
