"""Grammar-forced drafts on tool calls: speculation with and without them, beside plain
decoding, on the embedded model (greedy; every output checked equal to plain decoding's).

Ten chat requests (five questions, twice) with two tools, ``tool_choice`` "required" and
a named function, 96 tokens at most, the ``fixed`` and ``cost`` controllers. The ablation
swaps the engine's ``_with_forced`` and ``_forced_k`` for the identity (the drafter's chain
and the controller's k as they were), in the same process, interleaved.

    .venv/bin/python benchmarks/grammar_cpu/forced_drafts.py --out benchmarks/grammar_cpu
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import specdec.engine.engine as engine_module
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.tools import ToolChoice, check_tools, tool_constraint

TOOLS = check_tools([
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                       "required": ["timezone"], "additionalProperties": False}}},
])  # fmt: skip
QUESTIONS = [
    "What is the weather like in Paris today?", "What time is it in Tokyo?",
    "Is it raining in London?", "Tell me the temperature in Berlin in fahrenheit.",
    "What's the time in New York right now?",
] * 2  # fmt: skip
CHOICES = {"required": ToolChoice("required"), "named": ToolChoice("named", "get_weather")}


def run(llm, choice, method: str, forced: bool, controller: str = "fixed") -> dict:
    """One pass over the questions; tokens, steps, seconds and the outputs."""
    real, real_k = engine_module._with_forced, engine_module._forced_k
    if not forced:
        engine_module._with_forced = lambda draft, tokens: draft
        engine_module._forced_k = lambda seq, k, cap: k
    try:
        params = SamplingParams(
            max_new_tokens=96, temperature=0, structured_outputs=tool_constraint(TOOLS, choice)
        )
        tokens = steps = 0
        seconds = 0.0
        outputs = []
        for question in QUESTIONS:
            ids = llm.encode([{"role": "user", "content": question}], tools=TOOLS)
            t0 = time.perf_counter()
            spec = SpeculativeConfig(method, controller=controller if method != "none" else "fixed")
            out = llm.generate(ids, params, speculative=spec)
            seconds += time.perf_counter() - t0
            tokens += len(out.token_ids)
            steps += out.metrics.num_steps
            outputs.append(out.token_ids)
        return {"tokens": tokens, "steps": steps, "seconds": seconds, "outputs": outputs}
    finally:
        engine_module._with_forced, engine_module._forced_k = real, real_k


def _cpu() -> str:
    for line in (
        Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    ):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/grammar_cpu"))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    llm = LLM("smollm2-135m-instruct")
    for question in QUESTIONS[:2]:  # warm-up: kernels, grammar compiler
        llm.generate(question, SamplingParams(max_new_tokens=8))
    configs = [("none", False, "fixed"), ("ngram", False, "fixed"), ("ngram", True, "fixed"),
               ("suffix", False, "fixed"), ("suffix", True, "fixed"),
               ("ngram", False, "cost"), ("ngram", True, "cost"),
               ("suffix", False, "cost"), ("suffix", True, "cost")]  # fmt: skip
    rows = []
    for name, choice in CHOICES.items():
        totals: dict = {}
        for _ in range(args.rounds):  # interleaved: the machine's speed drifts
            for method, forced, controller in configs:
                result = run(llm, choice, method, forced, controller)
                empty = {"tokens": 0, "steps": 0, "seconds": 0.0, "outputs": None}
                total = totals.setdefault((method, forced, controller), empty)
                for key in ("tokens", "steps", "seconds"):
                    total[key] += result[key]
                total["outputs"] = total["outputs"] or result["outputs"]
                assert result["outputs"] == total["outputs"]
        plain = totals[("none", False, "fixed")]
        for (method, forced, controller), total in totals.items():
            rows.append({
                "tool_choice": name, "method": method, "controller": controller,
                "forced_drafts": forced,
                "tokens": total["tokens"], "steps": total["steps"],
                "tokens_per_s": total["tokens"] / total["seconds"],
                "speedup": (total["tokens"] / total["seconds"])
                / (plain["tokens"] / plain["seconds"]),
                "identical_to_plain": total["outputs"] == plain["outputs"],
            })  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": _cpu(), "rounds": args.rounds,
            "requests": len(QUESTIONS), "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    (args.out / "forced_drafts.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "# Grammar-forced drafts on tool calls (embedded model, greedy)",
        "",
        f"{meta['requests']} chat requests x {meta['rounds']} interleaved rounds, two tools, "
        f"96 tokens at most; {meta['machine']}, {meta['date']}. The suffix drafter's "
        "cross-request cache lives through the whole run (later passes find earlier outputs).",
        "",
        "| tool_choice | method | controller | forced drafts | tokens | steps | tokens/s | "
        "vs plain | identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tool_choice']} | {r['method']} | {r['controller']} | "
            f"{'yes' if r['forced_drafts'] else 'no'} | "
            f"{r['tokens']} | {r['steps']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
            f"{'yes' if r['identical_to_plain'] else 'NO'} |"
        )
    (args.out / "forced_drafts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
