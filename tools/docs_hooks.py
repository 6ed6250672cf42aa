"""MkDocs hook: the committed benchmark reports and plots (``benchmarks/*/``) become pages
of the site under ``benchmarks/``, so the docs link to the very files the runs wrote."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def on_files(files, config):
    for path in sorted((ROOT / "benchmarks").rglob("*")):
        if path.suffix in (".md", ".png") and path.is_file():
            rel = path.relative_to(ROOT).as_posix()
            files.append(File(rel, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files
