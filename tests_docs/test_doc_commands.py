"""Every shell command of the README and the docs runs as written (``make docs``).

Commands that take more than about a minute, or that install software, are listed in
:data:`NOT_RUN` with the reason; each of them is run elsewhere (CI's ``make test`` /
``make test-vllm``) or by hand when its results were committed. A block that starts
``specdec serve`` runs the server in the background while the block's other commands (the
clients) run against it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_commands import ROOT, Command, commands  # noqa: E402

#: command prefix (after ``.venv/bin/`` is dropped) -> why this test does not run it
NOT_RUN = {
    "make test-vllm": "builds vLLM's environment and tests it: CI runs it after make test",
    "make test": "CI runs it",
    "make bench": "benchmarks take 20-80 minutes; their results are committed",
    "make train-setup": "installs packages (pip)",
    "specdec train-head": "trains for minutes (--max-minutes); the shipped heads were made so",
    "specdec bench --limit-per-category 10": "the committed 70-turn run (~1 hour)",
    "specdec bench --forward-cost": "1-2 minutes on an idle machine; committed result",
    "specdec bench --method vllm-ar": "needs vLLM and llama.cpp environments; committed",
    "python -m venv": "creates environments and installs packages",
    ".venv/bin/pip install": "installs packages",
    "specdec serve --replicas": "needs Ray Serve: make test-ray tests the replicas; run by hand",
    "M=$(.venv-vllm": "needs make test-vllm's environment",
    ".venv-vllm/bin/python -m vllm.entrypoints": "a vLLM server (minutes to start); run by hand",
    "specdec generate --model PATH_OR_HUB_ID": "a placeholder for your model",
}
TIMEOUT_S = 240


def _key(text: str) -> str:
    return " ".join(text.replace("\\\n", " ").split()).replace(".venv/bin/", "")


def _skip_reason(command: Command) -> str | None:
    key = _key(command.text)
    for prefix, reason in NOT_RUN.items():
        if key.startswith(prefix.replace(".venv/bin/", "")):
            return reason
    return None


def _blocks() -> dict[tuple[str, int], list[Command]]:
    blocks: dict[tuple[str, int], list[Command]] = {}
    seen: set[str] = set()
    for command in commands():
        key = _key(command.text)
        if key in seen and not key.startswith("specdec serve"):
            continue  # the same command on two pages runs once (a server once per block)
        seen.add(key)
        blocks.setdefault((command.page, command.block), []).append(command)
    return blocks


BLOCKS = _blocks()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env['PATH']}"
    return env


def _run(text: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", text], cwd=ROOT, env=_env(),
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip


def _wait_for(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited: {server.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError("the server did not answer /health in time")


@pytest.mark.parametrize("where", list(BLOCKS), ids=[f"{p}#{b}" for p, b in BLOCKS])
def test_commands_run_as_written(where):
    block = BLOCKS[where]
    runnable = [c for c in block if _skip_reason(c) is None]
    if not runnable:
        pytest.skip("; ".join(sorted({_skip_reason(c) for c in block})))
    server = None
    try:
        for command in runnable:
            if _key(command.text).startswith("specdec serve"):
                port = int(re.search(r"--port (\d+)", command.text).group(1))
                server = subprocess.Popen(
                    ["bash", "-c", f"exec {command.text}"], cwd=ROOT, env=_env(),
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                )  # fmt: skip
                _wait_for(port, server)
                continue
            done = _run(command.text)
            output = f"{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
            assert done.returncode == 0, f"{command.id}\n{output}"
            if command.text.lstrip().startswith("curl"):
                assert '"choices"' in done.stdout, done.stdout[-1500:]
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=60) == 0


def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) < 15_000
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target
