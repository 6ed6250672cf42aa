"""Help text, listings and the docs say what the registry and the code do."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from specdec import LLM, SpeculativeConfig, registry
from specdec.cli import main

DOCS = Path(__file__).resolve().parents[1] / "docs"
OPTION_PAGES = {"drafter": DOCS / "drafters.md", "controller": DOCS / "controllers.md"}
KINDS = {
    "drafter": (registry.drafter_names, registry.drafter_entry),
    "controller": (registry.controller_names, registry.controller_entry),
}


def _all_docs():
    for kind, (names, entry_of) in KINDS.items():
        for name in names():
            for doc in registry.option_docs(entry_of(name).options):
                yield f"{kind} {name}: {doc.name}", doc


def test_every_builtin_option_has_a_one_line_description():
    docs = list(_all_docs())
    assert len(docs) > 30
    for where, doc in docs:
        assert doc.help.strip() and doc.help != registry.NO_DESCRIPTION, where
        assert "\n" not in doc.help and len(doc.help) <= 110, where


def test_option_docs_report_name_default_kind_and_help():
    from specdec.drafters.options import RetrievalOptions, SuffixOptions

    suffix = {d.name: d for d in registry.option_docs(SuffixOptions)}
    assert suffix["max_depth"].default == 24 and suffix["max_depth"].kind == "int"
    assert suffix["global_cache"].default_text == "true" and suffix["global_cache"].kind == "bool"
    assert suffix["min_token_prob"].kind == "float"
    assert "(2 to 256)" in suffix["max_depth"].help
    datastore = registry.option_docs(RetrievalOptions)[0]
    assert (datastore.name, datastore.kind, datastore.default_text) == ("datastore", "str", '""')
    with pytest.raises(ValueError, match="not an options dataclass"):
        registry.option_docs(int)


@dataclass(frozen=True)
class _PlainOptions:
    size: int = 3
    label: str | None = field(default=None)


def test_third_party_options_without_descriptions_register_and_list(capsys):
    entry = registry.DrafterEntry("plain-test", _PlainOptions, lambda c, o: None, "a test")
    registry.register_drafter(entry)
    try:
        docs = registry.option_docs(_PlainOptions)
        assert [d.help for d in docs] == [registry.NO_DESCRIPTION] * 2
        assert docs[1].kind == "str" and docs[1].default is None
        assert main(["drafters"]) == 0
        assert re.search(r"^ +size=3 +\(no description\)$", capsys.readouterr().out, re.M)
    finally:
        registry._DRAFTERS.pop("plain-test")


def test_a_description_must_be_one_line():
    @dataclass(frozen=True)
    class TwoLines:
        size: int = registry.option(3, "first line\nsecond line")

    entry = registry.DrafterEntry("two-lines-test", TwoLines, lambda c, o: None, "a test")
    with pytest.raises(ValueError, match="description of option 'size' .* one line"):
        registry.register_drafter(entry)
    assert "two-lines-test" not in registry.drafter_names()


@pytest.mark.parametrize("kind", list(KINDS))
def test_cli_listing_prints_default_and_description(capsys, kind):
    assert main([f"{kind}s"]) == 0
    out = capsys.readouterr().out
    for where, doc in _all_docs():
        if where.startswith(kind):
            pattern = rf"^ +{re.escape(f'{doc.name}={doc.default_text}')} +{re.escape(doc.help)}$"
            assert re.search(pattern, out, re.M), where


def test_unknown_option_points_to_the_listing():
    with pytest.raises(ValueError, match=r"no option 'size' \(options: min_n, max_n; `specdec dr"):
        registry.make_options("ngram", {"size": "2"})
    with pytest.raises(ValueError, match="`specdec controllers` describes them"):
        registry.make_controller_options("cost", {"nope": "1"})
    with pytest.raises(ValueError, match=r"\(it takes no options\)"):
        registry.make_options("none", {"size": "2"})


def test_options_markdown_lists_every_entry():
    table = registry.options_markdown("drafter")
    assert table.splitlines()[0] == "| drafter | option | default | description |"
    assert "| `ngram` | `min_n` | `2` | shortest n-gram" in table
    assert "| `none` |  |  | no options |" in table
    assert "| `fixed` |  |  | no options |" in registry.options_markdown("controller")
    with pytest.raises(ValueError, match="'drafter' or 'controller'"):
        registry.options_markdown("drafters")


@pytest.mark.parametrize("kind", list(KINDS))
def test_docs_options_reference_is_current(kind):
    page = OPTION_PAGES[kind]
    text = page.read_text(encoding="utf-8")
    block = rf"<!-- options:{kind}\b[^>]*-->\n(.*?)\n<!-- /options:{kind} -->"
    found = re.findall(block, text, re.S)
    assert len(found) == 1, f"{page.name} needs one <!-- options:{kind} --> block"
    assert found[0] == registry.options_markdown(kind), (
        f"{page.name}'s {kind} options are stale: replace the block with the output of "
        f"python -c 'from specdec import registry; print(registry.options_markdown(\"{kind}\"))'"
    )


def test_docs_name_ngram_as_the_default_drafter():
    text = OPTION_PAGES["drafter"].read_text(encoding="utf-8")
    assert "the default choice without a draft model" not in text
    assert SpeculativeConfig().method == "ngram"
    row = next(line for line in text.splitlines() if line.startswith("| `ngram` | prompt"))
    assert "**the default**" in row


def test_bench_serving_help_says_subprocess(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    serving = help_text[help_text.index("--serving instead") :]
    assert "`specdec serve` in a subprocess" in serving
    assert "in this process" not in serving.split("--controller")[0]


def test_int8_draft_with_native_backend_logs_what_happens(tiny_model_dir, caplog):
    with caplog.at_level("WARNING"):
        llm = LLM(
            tiny_model_dir,
            draft=tiny_model_dir,
            draft_dtype="int8-dynamic",
            backend="native",
            speculative=SpeculativeConfig(method="draft-model"),
        )
    assert llm.target.backend == "native" and llm._draft.backend == "hf"
    text = " ".join(caplog.text.split())
    assert "runs on transformers, although the backend is native" in text
    assert "quantized modules" in text and "the target runs on native" in text
    assert "--drafter quantized" in text  # the cheaper copy of the target it points to
    assert "backend auto" not in text
