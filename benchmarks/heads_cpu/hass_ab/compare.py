"""Teacher-forced acceptance per draft position of EAGLE head folders, side by side.

The measure of :func:`specdec.training.pipeline.head_acceptance` (each position given the
earlier ones right, on the target's own greedy answers, 96 new tokens) on the 20 everyday
questions of :data:`specdec.training.contamination.OUTSIDE_PROMPTS` and on Spec-Bench's
first turns (5 per group; ``$SPECDEC_SPEC_BENCH`` or the shared copy). ``shipped`` names
the EAGLE head shipped for the embedded model.

Run: .venv/bin/python benchmarks/heads_cpu/hass_ab/compare.py HEAD_DIR [HEAD_DIR ...]
"""

from __future__ import annotations

import sys

from specdec import LLM, SpeculativeConfig
from specdec.bench.datasets import load_spec_bench, select
from specdec.heads.format import load_head, shipped_head_path
from specdec.training.contamination import OUTSIDE_PROMPTS
from specdec.training.pipeline import answered, head_acceptance


def main(folders: list[str]) -> None:
    llm = LLM("smollm2-135m-instruct", speculative=SpeculativeConfig(method="none"))
    target = llm.target
    view = target.head_view()
    heads = {
        f: load_head(shipped_head_path(view, "eagle") if f == "shipped" else f, view, "eagle")
        for f in folders
    }
    bench = [p.turns[0] for p in select(load_spec_bench(None), 5)]
    for name, prompts in {"outside": list(OUTSIDE_PROMPTS), "spec-bench": bench}.items():
        conversations = answered(llm, prompts, 96)
        for folder, head in heads.items():
            result = head_acceptance(target, head, conversations, 4)
            rates = [round(a, 3) for a in result["acceptance"]]
            print(name, folder, rates, "tau", round(result["tau"], 3), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
