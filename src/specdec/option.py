"""``option(default, help)``: an options dataclass field with a one-line description.

Drafters' and controllers' options dataclasses use it; ``specdec drafters``, ``specdec
controllers`` and the docs' options tables show the descriptions (see
:func:`specdec.registry.option_docs`). A leaf module: it imports nothing from specdec, so
any layer may use it.
"""

from __future__ import annotations

import dataclasses
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
