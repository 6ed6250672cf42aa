"""Benchmark suite: Spec-Bench / HumanEval / JSONL prompts, methods side by side, reports."""

from specdec.bench.datasets import BenchPrompt, load_humaneval, load_jsonl, load_spec_bench, select
from specdec.bench.harness import Record, run_benchmark
from specdec.bench.methods import Method, parse_method, parse_methods
from specdec.bench.report import Summary, markdown_tables, summarize, write_outputs

__all__ = [
    "BenchPrompt",
    "Method",
    "Record",
    "Summary",
    "load_humaneval",
    "load_jsonl",
    "load_spec_bench",
    "markdown_tables",
    "parse_method",
    "parse_methods",
    "run_benchmark",
    "select",
    "summarize",
    "write_outputs",
]
