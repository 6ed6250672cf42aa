"""``specdec bench --serving``: what the server is started with, and the report with
vLLM's server beside it (the measurement itself starts real servers; not run here)."""

from __future__ import annotations

import pytest

from specdec.bench.cli import serve_options, serving_config
from specdec.bench.methods import parse_methods
from specdec.bench.serving import Level, ServingResult, report_markdown
from specdec.cli import _build_parser


def _args(*extra: str):
    return _build_parser().parse_args(["bench", "--serving", *extra])


def _value(options: list[str], name: str) -> str:
    return options[options.index(name) + 1]


def test_serve_options_carry_the_controller_quantization_and_threads():
    args = _args("--method", "suffix:k=12+cost", "--quantization", "none")
    methods = parse_methods(args.methods, args.controller)
    speculative = serving_config(args, methods)
    options = serve_options(args, speculative, 2)
    assert _value(options, "--drafter") == "suffix"
    assert _value(options, "--num-speculative-tokens") == "12"
    assert _value(options, "--controller") == "cost"
    assert _value(options, "--quantization") == "none"
    assert _value(options, "--threads") == "2"
    # without a speculative method: ngram:k=5 with --controller
    args = _args("--controller", "cost")
    speculative = serving_config(args, parse_methods(["ar"], args.controller))
    options = serve_options(args, speculative, 1)
    assert _value(options, "--drafter") == "ngram"
    assert _value(options, "--controller") == "cost"


def test_serve_defaults_to_dense_weights_only_on_cpus_with_amx(monkeypatch):
    """``specdec serve --quantization``'s default follows the CPU: dense weights where AMX's
    matrix units batch them faster, the GGUF's own blocks (``auto``) elsewhere."""
    from specdec import cli_common
    from specdec.runtime import kernels

    assert cli_common.serve_quantization_default("avx512f amx_bf16 amx_tile") == "none"
    assert cli_common.serve_quantization_default("avx512f avx512_bf16 avx512_vnni") == "auto"
    assert cli_common.serve_quantization_default("") == "auto"
    for flags, default in (("amx_bf16 amx_tile", "none"), ("avx2 fma", "auto")):
        monkeypatch.setattr(kernels, "cpu_flags", lambda cpuinfo=None, f=flags: f)
        args = _build_parser().parse_args(["serve"])
        assert args.quantization == default


def _level(server: str, speculative: bool, c: int, rate: float, outputs: list[str]) -> Level:
    return Level(speculative, c, len(outputs), int(rate * 10), 10.0, rate, 100.0, 150.0, 20.0,
                 500.0, outputs, server)  # fmt: skip


def test_report_puts_vllm_beside_speculation_off_and_on():
    same, other = ["a", "b"], ["a", "c"]
    levels = [
        _level("specdec", False, 1, 20.0, same),
        _level("specdec", False, 32, 60.0, same),
        _level("specdec", True, 1, 30.0, same),
        _level("specdec", True, 32, 66.0, same),
        _level("vllm", False, 1, 10.0, other),
        _level("vllm", False, 32, 120.0, same),
    ]
    text = report_markdown(ServingResult(levels, 25.0, same, 48, 2, "0.32.0"))
    rows = [line for line in text.splitlines() if line.startswith("| 32 |")]
    assert rows[0].startswith("| 32 | 60.0 | 66.0 | 1.10x | - |")  # specdec off / on
    assert rows[1] == "| 32 | 120.0 | 0.50x | 0.55x | 100 | 20.0 | 2/2 |"  # vLLM
    assert "| 1 | 10.0 | 2.00x | 3.00x | 100 | 20.0 | 1/2 |" in text
    assert "vLLM 0.32.0's OpenAI server" in text
    # without vLLM: no second table
    alone = report_markdown(ServingResult(levels[:4], 25.0, same, 48, 2))
    assert "vLLM" not in alone


def test_levels_run_in_abba_order_and_pool_their_rounds():
    from specdec.bench.serving import _level as pooled
    from specdec.bench.serving import abba

    assert abba((False, True), 2) == [False, True, True, False]
    assert abba((False, True), 3) == [False, True, True, False, False, True]
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        abba((False,), 0)
    # (text, tokens, ttft s, tpot s, e2e s) per prompt; two rounds of two prompts
    first = (2.0, [("a", 10, 0.1, 0.01, 0.2), ("b", 30, 0.3, 0.03, 0.6)])
    second = (6.0, [("a", 10, 0.5, 0.05, 1.0), ("b", 30, 0.7, 0.07, 1.4)])
    level = pooled([first, second], True, 4)
    assert level.throughput == 80 / 8.0 and level.round_throughputs == [20.0, 40 / 6.0]
    assert (level.rounds, level.output_tokens, level.num_requests) == (2, 40, 2)
    assert level.ttft_ms == pytest.approx(400.0) and level.outputs == ["a", "b"]
    assert level.repeatable
    other = (6.0, [("a", 10, 0.5, 0.05, 1.0), ("c", 30, 0.7, 0.07, 1.4)])
    assert not pooled([first, other], True, 4).repeatable
    on = Level(True, 4, 2, 40, 8.0, 10.0, 1.0, 1.0, 1.0, 1.0, ["a", "b"], "specdec", 2,
               [22.0, 6.0], False)  # fmt: skip
    off = Level(False, 4, 2, 40, 8.0, 10.0, 1.0, 1.0, 1.0, 1.0, ["a", "b"], "specdec", 2,
                [20.0, 6.0])  # fmt: skip
    text = report_markdown(ServingResult([off, on], 25.0, ["a", "b"], 48, 2))
    assert "Each level ran 2 times" in text
    assert "| 4 | 10.0 | 10.0 | 1.00x | 1.10x, 1.00x |" in text
    assert "2/2 (a round differed) |" in text


def test_a_failing_vllm_server_keeps_specdecs_levels(monkeypatch, tmp_path, capsys, tiny_model_dir):
    """vLLM runs last: when its server fails to start, specdec's measured levels are still
    written and printed, the failure is said, and the exit code is 1."""
    from specdec.bench import peers, serving
    from specdec.cli import main

    same = ["a", "b"]

    def fake_run_serving(serve_args, make_llm, prompts, max_new_tokens, **kwargs):
        make_llm()
        levels = [_level("specdec", s, 1, 20.0, same) for s in (False, True)]
        return ServingResult(levels, 25.0, same, max_new_tokens, len(prompts))

    def fake_vllm(*args, **kwargs):
        raise RuntimeError("python -m vllm.entrypoints.openai.api_server exited: no weights")

    monkeypatch.setattr(serving, "run_serving", fake_run_serving)
    monkeypatch.setattr(serving, "run_vllm_serving", fake_vllm)
    monkeypatch.setattr(peers, "check_peer_python", lambda method, python: (python, "0.32.0"))
    out = str(tmp_path / "out")
    code = main(["bench", "--serving", "--model", tiny_model_dir, "--vllm-python", "python3",
                 "--spec-bench", _one_question(tmp_path), "--out", out])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    assert "vLLM's server failed, so the report has specdec's levels only" in err
    assert "no weights" in err
    assert (tmp_path / "out" / "serving.md").is_file()


def _one_question(tmp_path) -> str:
    import json

    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Hi."]}) + "\n")
    return str(path)
