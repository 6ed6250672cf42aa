"""MkDocs hooks: the committed benchmark reports and plots (``benchmarks/*/``) become pages
of the site under ``benchmarks/``, so the docs link to the very files the runs wrote; and
the docstrings' Sphinx roles (``:class:`~specdec.x.Y``` and the like, which the code's
readers and ``help()`` see) render as plain code names in the API reference."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def on_files(files, config):
    for path in sorted((ROOT / "benchmarks").rglob("*")):
        if path.suffix in (".md", ".png") and path.is_file():
            rel = path.relative_to(ROOT).as_posix()
            files.append(File(rel, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|const):(<code>)~?(?:[\w.]+\.)?")


def on_page_content(html, page, config, files):
    return _ROLE.sub(r"\1", html)
