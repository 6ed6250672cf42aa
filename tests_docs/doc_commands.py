"""Shell commands of the README and the docs, one per complete command line."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(bash|sh|console)\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Command:
    page: str  # README.md or docs/NAME.md
    block: int  # index of the fenced block on the page
    text: str  # the command as written (continuation lines joined)

    @property
    def id(self) -> str:
        words = self.text.replace("\\\n", " ").split()
        return f"{self.page}#{self.block}:{' '.join(words[:4])[:60]}"


def _complete(text: str) -> bool:
    if text.rstrip().endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on
        return False
    return True


def commands() -> list[Command]:
    """Every command of every ```bash block in README.md and docs/*.md."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = []
    for page in pages:
        name = page.relative_to(ROOT).as_posix()
        for b, match in enumerate(FENCE.finditer(page.read_text(encoding="utf-8"))):
            current = ""
            for line in match.group(2).splitlines():
                if not current and (not line.strip() or line.lstrip().startswith("#")):
                    continue
                current = f"{current}\n{line}" if current else line
                if _complete(current):
                    found.append(Command(name, b, current))
                    current = ""
            if current:
                found.append(Command(name, b, current))
    return found


if __name__ == "__main__":
    for c in commands():
        print(c.id)
