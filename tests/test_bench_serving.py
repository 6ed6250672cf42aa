"""``specdec bench --serving``: what the server is started with, and the report with
vLLM's server beside it (the measurement itself starts real servers; not run here)."""

from __future__ import annotations

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
    assert rows[0].startswith("| 32 | 60.0 | 66.0 | 1.10x")  # specdec off / on
    assert rows[1] == "| 32 | 120.0 | 0.50x | 0.55x | 100 | 20.0 | 2/2 |"  # vLLM
    assert "| 1 | 10.0 | 2.00x | 3.00x | 100 | 20.0 | 1/2 |" in text
    assert "vLLM 0.32.0's OpenAI server" in text
    # without vLLM: no second table
    alone = report_markdown(ServingResult(levels[:4], 25.0, same, 48, 2))
    assert "vLLM" not in alone
