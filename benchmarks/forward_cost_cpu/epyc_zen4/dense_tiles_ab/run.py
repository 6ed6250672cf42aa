"""End-to-end A/B in one process (dense model, exact, one request at a time, 12 Spec-Bench
prompts, 96 new tokens, greedy): the tile formulations (``dpbf16`` / ``f32_tiles`` and the
fused decoding layers) against the choices this machine calibrated before them (bfloat16:
``stream`` and oneDNN; float32: oneDNN), alternated ABBA over 2 rounds.

Usage: ``python run.py bfloat16|float32`` (``SPECDEC_SPEC_BENCH`` or the shared data path;
output in results.txt).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import specdec.runtime.linear as L
from specdec.bench.datasets import load_spec_bench, select
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.llm import LLM
from specdec.runtime.model import NativeDecoder

SPEC_BENCH = os.environ.get("SPECDEC_SPEC_BENCH", "/work/shared/data/spec_bench/question.jsonl")


def old_choices(choices: dict, dtype: str) -> dict:
    """The choices without the tile formulations: fast per bucket re-chosen from the same
    measurements, exact as the machine's table held them before."""
    out = {}
    for name, c in choices.items():
        times = {k: v for k, v in c.times_ms.items() if k not in ("dpbf16", "f32_tiles")}
        fast, rows = L._fast_choice(times)
        if dtype == "bfloat16":
            exact = {"gate_up": ("onednn", 64, 1), "lm_head": ("onednn", 64, 1)}.get(
                name, ("stream", L.ANY_ROWS, 1)
            )
        else:
            exact = {"down": ("onednn", 64, 2)}.get(name, ("onednn", 64, 1))
        out[name] = L.KernelChoice(fast, *exact, times, rows)
    return out


def main(dtype: str) -> None:
    prompts = [p.turns[0] for p in select(load_spec_bench(SPEC_BENCH), 2)][:12]
    llm = LLM("smollm2-135m-instruct", quantization="none", dtype=dtype, backend="native")
    new = llm.target.decoder
    old = NativeDecoder(new.weights, True, old_choices(new.choices, dtype), new.prefill_plan)
    params = SamplingParams(max_new_tokens=96)
    methods = {
        "plain": SpeculativeConfig(method="none"),
        "ngram+cost": SpeculativeConfig(method="ngram", controller="cost"),
    }
    rates: dict[tuple[str, str], list[float]] = {}
    outputs = {}
    for r in range(2):
        for method, spec in methods.items():
            order = [("new", new), ("old", old)]
            for which, decoder in order if r % 2 == 0 else order[::-1]:
                llm.target.decoder = decoder
                tokens, wall, outs = 0, 0.0, []
                for prompt in prompts:
                    start = time.perf_counter()
                    out = llm.generate([prompt], params, speculative=spec)[0]
                    wall += time.perf_counter() - start
                    tokens += len(out.token_ids)
                    outs.append(out.token_ids)
                rates.setdefault((method, which), []).append(tokens / wall)
                outputs[(method, which)] = outs
                print(r, method, which, f"{tokens / wall:.1f} tok/s", flush=True)
    for method in methods:
        a = statistics.mean(rates[(method, "new")])
        b = statistics.mean(rates[(method, "old")])
        same = sum(
            x == y for x, y in zip(outputs[(method, "new")], outputs[("plain", "new")], strict=True)
        )
        print(
            dtype, method, f"new {a:.1f} old {b:.1f} tok/s ratio {a / b:.2f}",
            "identical to own plain:", same, "/", len(prompts),
        )  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
