"""How well the shipped draft heads generalize: teacher-forced acceptance per draft position
on prompts outside their training data, beside the held-out figure of their training report.

A head's training report measures acceptance on a held-out 5% of its own conversations.
Those come from the same sources as the training ones (the target's Magpie-style
queries, chitchat, templated tasks), so they say little about prompts a user sends. This
script measures the same quantity (:func:`specdec.training.train.evaluate`: the head's
greedy chain, each position given the earlier ones right, on the target's own greedy
answers) on two sets the heads never saw:

* ``outside``: the 20 everyday questions of
  :data:`specdec.training.contamination.OUTSIDE_PROMPTS` (``train-head`` reports the
  same measure on them since 2026-12-05; the shipped heads were trained before);
* ``spec-bench``: the first turns of Spec-Bench, ``--per-group`` per group (the project's
  test set: evaluated here, never trained on).

The answers are the target's own plain greedy decoding (``--max-new-tokens``), so the
labels are what a verification would accept. It takes about two minutes on 2 cores.

Run: .venv/bin/python benchmarks/heads_cpu/generalization.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from specdec import LLM, SpeculativeConfig
from specdec.bench.datasets import load_spec_bench, select
from specdec.heads.format import load_head, shipped_head_path
from specdec.training.contamination import OUTSIDE_PROMPTS
from specdec.training.pipeline import answered, head_acceptance

KINDS = ("eagle", "medusa", "parallel")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec-bench", default=None, help="Spec-Bench question.jsonl")
    ap.add_argument("--per-group", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    start = time.perf_counter()
    llm = LLM("smollm2-135m-instruct", speculative=SpeculativeConfig(method="none"))
    target = llm.target
    view = target.head_view()
    bench = [p.turns[0] for p in select(load_spec_bench(args.spec_bench), args.per_group)]
    sets = {"outside": list(OUTSIDE_PROMPTS), "spec-bench": bench}
    heads = {kind: load_head(shipped_head_path(view, kind), view, kind) for kind in KINDS}
    results: dict = {}
    for name, prompts in sets.items():
        conversations = answered(llm, prompts, args.max_new_tokens)
        for kind, head in heads.items():
            steps = {"eagle": 4, "medusa": head.config.medusa_heads}.get(
                kind, getattr(head.config, "block_size", 4)
            )
            ev = head_acceptance(target, head, conversations, steps)
            results.setdefault(kind, {})[name] = {
                "prompts": len(prompts),
                "answer_tokens": ev["answer_tokens"],
                "acceptance": [round(a, 3) for a in ev["acceptance"]],
                "tau": round(ev["tau"], 3),
            }
            print(kind, name, results[kind][name], flush=True)
    report = Path(__file__).parent
    for kind in KINDS:
        path = report / f"train_{kind}" / "report.json"
        if path.exists():
            held = json.loads(path.read_text())["held_out"]
            results[kind]["held-out (training report)"] = {
                "acceptance": [round(a, 3) for a in held["acceptance"]],
                "tau": round(held["tau"], 3),
            }
    meta = {
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "target": f"smollm2-135m-instruct ({target.quantization} weights, {target.dtype})",
        "max_new_tokens": args.max_new_tokens,
        "spec_bench_per_group": args.per_group,
        "seconds": round(time.perf_counter() - start, 1),
    }
    lines = [
        "| head | prompts | acceptance per position (each given the earlier ones) | tau |",
        "|---|---|---|---|",
    ]
    for kind in KINDS:
        for name, r in results[kind].items():
            rates = ", ".join(f"{a:.2f}" for a in r["acceptance"])
            lines.append(f"| {kind} | {name} | {rates} | {r['tau']:.2f} |")
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "generalization.json").write_text(
            json.dumps({"meta": meta, "results": results}, indent=1)
        )
        (out / "generalization.md").write_text(
            "# Shipped heads on prompts outside their training data\n\n"
            + "".join(f"- {k}: {v}\n" for k, v in meta.items())
            + "\n"
            + "\n".join(lines)
            + "\n"
        )


if __name__ == "__main__":
    main()
