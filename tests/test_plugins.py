"""Third-party drafters registered through the ``specdec.drafters`` entry-point group: a
real distribution on ``sys.path`` (a ``.dist-info`` with ``entry_points.txt``), as pip
installs one."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from specdec import LLM, SamplingParams, SpeculativeConfig, registry
from specdec.server.protocol import SpeculativeOptions

PLUGIN = '''
from dataclasses import dataclass

from specdec.drafters import DrafterBase, DraftProposal
from specdec.registry import DrafterEntry, option


@dataclass(frozen=True)
class RepeatOptions:
    copies: int = option(2, "how many copies of the last token to propose")


class RepeatLast(DrafterBase):
    """Proposes the last token again (a deterministic, history-only drafter)."""

    def __init__(self, copies):
        self.copies = copies

    def start(self, prompt_ids, params):
        return self

    def propose(self, token_ids, num_tokens, generator):
        return DraftProposal([token_ids[-1]] * min(num_tokens, self.copies))


ENTRY = DrafterEntry(
    "repeat-last", RepeatOptions, lambda context, o: RepeatLast(o.copies), "repeats the last token"
)


def both():
    return [DrafterEntry("repeat-last-2", RepeatOptions, ENTRY.factory, "again")]


TAKEN = DrafterEntry("ngram", RepeatOptions, ENTRY.factory, "a name that is taken")
NOT_AN_ENTRY = 42
'''

ENTRY_POINTS = """
[specdec.drafters]
repeat-last = specdec_plugin_demo:ENTRY
more = specdec_plugin_demo:both
taken = specdec_plugin_demo:TAKEN
wrong-object = specdec_plugin_demo:NOT_AN_ENTRY
missing = specdec_plugin_demo_missing:ENTRY
"""


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    (root / "specdec_plugin_demo.py").write_text(textwrap.dedent(PLUGIN))
    info = root / "specdec_plugin_demo-0.1.dist-info"
    info.mkdir()
    metadata = "Metadata-Version: 2.1\nName: specdec-plugin-demo\nVersion: 0.1\n"
    (info / "METADATA").write_text(metadata)
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return str(root)


@pytest.fixture
def plugins(plugin_path, monkeypatch):
    monkeypatch.syspath_prepend(plugin_path)
    importlib.invalidate_caches()
    before = set(registry._DRAFTERS)
    with pytest.warns(registry.PluginWarning) as caught:
        added = registry.load_plugins(reload=True)
    yield added, [str(w.message) for w in caught]
    for name in set(registry._DRAFTERS) - before:
        registry._DRAFTERS.pop(name)


def test_plugins_register_and_bad_ones_are_skipped_with_a_warning(plugins):
    added, warnings = plugins
    assert added == ("repeat-last", "repeat-last-2")
    assert registry.drafter_names()[-2:] == added
    assert registry.drafter_entry("repeat-last").summary == "repeats the last token"
    assert len(warnings) == 3
    assert any("drafter 'ngram' of drafter plugin 'taken'" in w and "already registered" in w
               for w in warnings)  # fmt: skip
    assert any("'wrong-object'" in w and "DrafterEntry" in w for w in warnings)
    assert any("'missing'" in w and "specdec_plugin_demo_missing" in w for w in warnings)
    # The built-in ngram is untouched, and the README's table lists built-ins only.
    assert registry.drafter_entry("ngram").summary.startswith("prompt lookup")
    assert "repeat-last" not in registry.options_markdown("drafter")
    assert registry.builtin_drafter_names()[0] == "none"
    # The server's per-request method accepts it.
    assert SpeculativeOptions(method="repeat-last").method == "repeat-last"


def test_a_plugin_drafter_is_lossless_through_the_engine(plugins, target):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    prompt = [5, 6, 7, 7, 7]
    plain = LLM(target, speculative=SpeculativeConfig(method="none")).generate(prompt, params)
    config = SpeculativeConfig(method="repeat-last", options={"copies": 3})
    out = LLM(target, speculative=config).generate(prompt, params)
    assert out.token_ids == plain.token_ids
    assert out.metrics.num_draft_tokens > 0 and out.metrics.num_accepted_tokens > 0


def test_the_cli_sees_installed_plugins(plugin_path, tiny_model_dir):
    path = os.pathsep.join([plugin_path, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    listing = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "drafters"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "repeat-last" in listing.stdout and "copies=2" in listing.stdout
    # a skipped plugin is one line in the CLI's own style
    assert "specdec: warning: skipped drafter plugin 'missing'" in listing.stderr
    assert "PluginWarning" not in listing.stderr
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "specdec.cli", "generate", "w1 w2 w3",
         "--model", tiny_model_dir, "--drafter", "repeat-last", "--max-new-tokens", "8",
         "--json"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout)
    assert record["drafter"] == "repeat-last" and record["metrics"]["num_draft_tokens"] > 0
