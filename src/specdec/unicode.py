"""The one rule for text handed to specdec: it must be valid Unicode (UTF-8 as bytes).

Every entry point (the CLI's prompt argument and standard input, stop strings, dataset and
corpus files, the server's prompts, chat messages and stop strings, Python callers) goes
through :func:`check_text` or :func:`decode_utf8`, so text that is not valid Unicode is
refused with a one-line ``ValueError`` naming where it came from and where the bad part is,
instead of a tokenizer's ``TypeError`` deep inside generation. Nothing is guessed or
replaced: a prompt re-encoded behind the user's back would be generated from silently.

Python strings can hold what is not Unicode text: *lone surrogates* (U+D800..U+DFFF),
which arrive from JSON escapes such as ``"\\udcff"`` and from bytes that are not UTF-8
in command-line arguments (Python decodes argv with ``surrogateescape``, so byte ``0xE9``
becomes U+DCE9). A leaf module: it imports nothing from specdec.
"""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")

#: How to convert text in another encoding, shown with every refusal.
CONVERT_HINT = "convert it to UTF-8 first (e.g. iconv -f latin1 -t utf-8)"


def find_invalid(text: str) -> int:
    """Index of the first character of ``text`` that is not valid Unicode (a lone
    surrogate), or ``-1`` when the whole string is valid.

    Example:
        >>> find_invalid("caf\\udce9 hi"), find_invalid("café")
        (3, -1)
    """
    match = _SURROGATE.search(text)
    return -1 if match is None else match.start()


def check_text(text: str, what: str, from_argv: bool = False) -> str:
    """``text`` unchanged when it is valid Unicode.

    Args:
        text: any ``str``.
        what: where it came from, for the message (``"the prompt"``, ``"stop string 2"``).
        from_argv: ``text`` is a command-line argument, where U+DC80..U+DCFF stand for
            bytes that are not UTF-8 (Python's ``surrogateescape``): name the byte.

    Returns:
        ``text``.

    Raises:
        ValueError: ``text`` holds a lone surrogate; the message names ``what``, the
            character index, and the surrogate (or, with ``from_argv``, the byte).

    Example:
        >>> check_text("café", "the prompt")
        'café'
        >>> check_text("caf\\udce9", "the prompt", from_argv=True)
        Traceback (most recent call last):
        ...
        ValueError: the prompt is not valid UTF-8: byte 0xe9 at character 3; convert it to UTF-8 first (e.g. iconv -f latin1 -t utf-8)
    """  # noqa: E501
    index = find_invalid(text)
    if index < 0:
        return text
    code = ord(text[index])
    if from_argv and 0xDC80 <= code <= 0xDCFF:  # surrogateescape: an undecodable byte
        raise ValueError(
            f"{what} is not valid UTF-8: byte 0x{code - 0xDC00:02x} at character {index}; "
            f"{CONVERT_HINT}"
        )
    raise ValueError(
        f"{what} is not valid Unicode: lone surrogate U+{code:04X} at character {index} "
        "(a UTF-16 surrogate must come in a high/low pair)"
    )


def decode_utf8(data: bytes, what: str) -> str:
    """``data`` decoded as UTF-8 (a leading byte-order mark is dropped).

    Args:
        data: raw bytes (standard input, a file's content).
        what: where they came from, for the message (``"standard input"``, a path).

    Returns:
        the text.

    Raises:
        ValueError: ``data`` is not valid UTF-8; the message names ``what`` and the byte
            offset.

    Example:
        >>> decode_utf8("café".encode(), "standard input")
        'café'
        >>> decode_utf8(b"caf\\xe9 hi", "standard input")
        Traceback (most recent call last):
        ...
        ValueError: standard input is not valid UTF-8: byte 0xe9 at offset 3; convert it to UTF-8 first (e.g. iconv -f latin1 -t utf-8)
    """  # noqa: E501
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        bad = data[error.start]
        raise ValueError(
            f"{what} is not valid UTF-8: byte 0x{bad:02x} at offset {error.start}; {CONVERT_HINT}"
        ) from None


def decode_lenient(data: bytes) -> tuple[str, int]:
    """``data`` as UTF-8 with every byte that is not UTF-8 replaced by U+FFFD, and how
    many characters were replaced (bulk corpora, where one stray byte must not stop a
    build; prompts use the strict :func:`decode_utf8`).

    Example:
        >>> decode_lenient(b"caf\\xe9 \\xef\\xbf\\xbd")
        ('caf\\ufffd \\ufffd', 1)
    """
    text = data.decode("utf-8", errors="replace")
    return text, text.count("\ufffd") - data.count("\ufffd".encode())


def replace_invalid(text: str) -> tuple[str, int]:
    """``text`` with each lone surrogate replaced by U+FFFD, and how many were.

    Example:
        >>> replace_invalid("caf\\udce9")
        ('caf\\ufffd', 1)
    """
    return _SURROGATE.subn("\ufffd", text)


def printable(text: str) -> str:
    """``text`` with any lone surrogate written as a backslash escape, so a message that
    quotes user input can always be printed or sent as UTF-8.

    Example:
        >>> printable("caf\\udce9")
        'caf\\\\udce9'
    """
    if find_invalid(text) < 0:
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
