"""``option(default, help)``: an options dataclass field with a one-line description.

Drafters' and controllers' options dataclasses use it; ``specdec drafters``, ``specdec
controllers`` and the docs' options tables show the descriptions (see
:func:`specdec.registry.option_docs`). A leaf module: it imports nothing from specdec, so
any layer may use it.

Also :func:`env_switch`, the runtime's on / off / auto environment variables.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any, TypeVar

_T = TypeVar("_T")

#: The metadata key of an options field that holds its one-line description.
HELP = "help"


def option(default: _T, help: str) -> _T:
    """An options dataclass field with a default and a one-line description.

    ``specdec drafters``, ``specdec controllers`` and the docs' options tables show the
    description (see :func:`specdec.registry.option_docs`).

    Args:
        default: the option's default (an int, float, bool or str).
        help: what the option does, in one line (units and range briefly).

    Returns:
        a :func:`dataclasses.field` carrying both.
    """
    field: Any = dataclasses.field(default=default, metadata={HELP: help})
    return field


def env_switch(name: str, unset: str, raw: str | None = None) -> bool | None:
    """An on / off / auto environment variable: ``True`` for ``on`` (or ``1`` / ``true``),
    ``False`` for ``off`` (``0`` / ``false``), ``None`` for ``auto`` or unset; any case,
    spaces ignored.

    Args:
        name: the variable.
        unset: what leaving it unset does, for the error message.
        raw: the value to read instead of the environment's.

    Raises:
        ValueError: another value (the message names the variable and the choices).
    """
    raw = os.environ.get(name, "") if raw is None else raw
    value = raw.strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("on", "1", "true"):
        return True
    if value in ("off", "0", "false"):
        return False
    raise ValueError(
        f"{name}={raw!r}: expected on, off or auto (or unset: {unset}; 1/0 and true/false "
        "also work)"
    )


def parse_key_values(items: Iterable[str], owner: str) -> dict[str, str]:
    """``key=value`` items (blank ones skipped) as ``{key: value}``, values unparsed;
    ``owner`` names them in errors (``"option 'x' of 'suffix' is not key=value"``).

    Raises:
        ValueError: an item without ``=`` or a key, or a key given twice.
    """
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in items)):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"option {item!r} of {owner} is not key=value")
        if key in out:
            raise ValueError(f"option {key!r} of {owner} given twice")
        out[key] = value.strip()
    return out
