"""Typical acceptance (LOSSY) against lossless rejection sampling on Spec-Bench, sampled.

For each method, every prompt (first turn, chat template) is sampled at temperature 1 with
seeds 0 .. SEEDS-1 on the native backend (bf16, exact, the embedded model). Reported per
method: mean acceptance length and how the output's law moved: the
mean log-probability of the emitted tokens under the target's own (raw, temperature 1)
distribution, with its standard error over prompts x seeds. A lossless method samples from
the target, so its mean matches plain sampling's up to noise; a verifier that keeps
high-probability draft tokens more often than the target would choose them pushes it up
(outputs sharper than the model's distribution).

    .venv/bin/python benchmarks/typical_cpu/run.py [--limit-per-category 3] [--seeds 2]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.bench.datasets import load_spec_bench, select

METHODS = {
    "plain sampling": SpeculativeConfig("none"),
    "suffix, rejection (lossless)": SpeculativeConfig("suffix", 8),
    "suffix, typical (LOSSY)": SpeculativeConfig("suffix", 8, verifier="typical", allow_lossy=True),
    "eagle, rejection (lossless)": SpeculativeConfig("eagle", 8),
    "eagle, typical (LOSSY)": SpeculativeConfig("eagle", 8, verifier="typical", allow_lossy=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-per-category", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(Path(__file__).parent))
    parser.add_argument("--render", action="store_true", help="only rewrite report.md")
    args = parser.parse_args()
    if args.render:
        out = Path(args.out)
        render(json.loads((out / "results.json").read_text()), out)
        return
    prompts = select(load_spec_bench(), args.limit_per_category)
    llm = LLM(backend="native", dtype="bfloat16")
    llm.generate("warm up", SamplingParams(max_new_tokens=8))
    rows = {}
    for name, config in METHODS.items():
        logps, steps, tokens, seconds = [], 0, 0, 0.0
        for prompt in prompts:
            for seed in range(args.seeds):
                params = SamplingParams(
                    temperature=1.0, seed=seed, max_new_tokens=args.max_new_tokens, logprobs=0
                )
                t0 = time.perf_counter()
                out = llm.generate(prompt.turns[0], params, speculative=config)
                seconds += time.perf_counter() - t0
                steps += out.metrics.num_steps
                tokens += len(out.token_ids)
                logps.append(statistics.fmean(t.logprob for t in out.logprobs))
        mean = statistics.fmean(logps)
        stderr = statistics.stdev(logps) / math.sqrt(len(logps))
        rows[name] = {
            "mean_acceptance_length": tokens / steps,
            "tokens_per_s": tokens / seconds,
            "mean_logprob": mean,
            "stderr": stderr,
            "generations": len(logps),
            "tokens": tokens,
        }
        print(name, rows[name], flush=True)
    result = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "prompts": len(prompts),
        "limit_per_category": args.limit_per_category,
        "seeds": args.seeds,
        "max_new_tokens": args.max_new_tokens,
        "methods": rows,
    }
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    render(result, out)


def render(result: dict, out: Path) -> None:
    """``report.md`` from ``results.json``'s contents. Tokens per second stay in the JSON
    only: this run measures acceptance and the output's law, not speed (other work may
    share the machine)."""
    rows = result["methods"]
    plain = rows["plain sampling"]
    lines = [
        "# Typical acceptance (LOSSY) vs rejection sampling, Spec-Bench, temperature 1",
        "",
        f"Machine: {result['machine']}; {result['prompts']} Spec-Bench prompts (first turns, "
        f"{result.get('limit_per_category', 3)} per category group) x {result['seeds']} seeds, "
        f"up to {result['max_new_tokens']} new tokens, native backend, bf16, exact; one run. "
        "Mean log-prob: of the emitted tokens under the target's raw distribution, averaged "
        "per generation, +- its standard error; lossless methods match plain sampling up to "
        "noise, a higher value means outputs sharper than the model's distribution.",
        "",
        "| method | mean acceptance length | mean log-prob per token | "
        "change vs plain (in standard errors) |",
        "|---|---|---|---|",
    ]
    for name, r in rows.items():
        z = (r["mean_logprob"] - plain["mean_logprob"]) / math.hypot(r["stderr"], plain["stderr"])
        lines.append(
            f"| {name} | {r['mean_acceptance_length']:.2f} | {r['mean_logprob']:.3f} "
            f"+- {r['stderr']:.3f} | {'-' if r is plain else f'{z:+.1f}'} |"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
