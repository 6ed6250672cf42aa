"""Prefill (time to first token) of long prompts: the blocked prompt kernel against the
prompt attention the runtime chose before it (the library's ``scaled_dot_product_attention``
or the runtime's ragged kernel, whichever the prefill plan measured faster), same model,
same process, alternated.

Prompts: the long-context benchmark's documents (``run.py``: GNU licence texts and Python
standard-library modules found offline), cut to the given lengths of the embedded model's
tokenizer. Each prompt is prefilled by ``LLM.generate`` with one new token, so the time is
the engine's whole prompt path (chunked prefill, products, attention, LM head). Both plans
must give the same first token.

Run: .venv/bin/python benchmarks/long_context_cpu/prefill.py [--lengths ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from run import DOCUMENTS, build_prompts

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.models.loading import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", nargs="+", type=int, default=[960, 1984, 3968, 7936])
    ap.add_argument("--documents", nargs="+", default=["gpl-3", "argparse"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = load(
        "smollm2-135m-instruct", dtype=args.dtype, backend="native",
        quantization=args.quantization,
    )  # fmt: skip
    decoder = target.decoder
    measured = decoder.prefill_plan
    if measured.blocked_attention_from is None:
        raise SystemExit(f"the prefill plan does not choose the blocked kernel here: {measured}")
    plans = {
        "before": dataclasses.replace(measured, blocked_attention_from=None),
        "blocked": measured,
    }
    llm = LLM(target, speculative=SpeculativeConfig(method="none"))
    params = SamplingParams(max_new_tokens=1)
    prompts = build_prompts(target.tokenizer, args.lengths, args.documents)
    llm.generate(prompts[0]["ids"][:64], params)  # warm-up
    records = []
    for prompt in prompts:
        first = {}
        for _ in range(args.repeats):
            for name, plan in plans.items():
                decoder.prefill_plan = plan
                t0 = time.perf_counter()
                out = llm.generate(prompt["ids"], params)
                wall = time.perf_counter() - t0
                first.setdefault(name, out.token_ids)
                rec = {"plan": name, "prompt": prompt["id"], "prompt_tokens": len(prompt["ids"]),
                       "seconds": wall, "tokens_per_s": len(prompt["ids"]) / wall}  # fmt: skip
                records.append(rec)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in rec.items()}), flush=True)  # fmt: skip
        same = first["before"] == first["blocked"]
        for rec in records:
            if rec["prompt"] == prompt["id"]:
                rec["same_first_token"] = same
        if not same:
            print(f"{prompt['id']}: first tokens differ {first}", flush=True)
    decoder.prefill_plan = measured
    summary = {}
    for length in args.lengths:
        key = f"{round(length / 1024)}k"
        rows = {
            name: [r for r in records if r["plan"] == name and r["prompt"].endswith(key)]
            for name in plans
        }
        med = {name: statistics.median(r["seconds"] for r in rs) for name, rs in rows.items()}
        tokens = statistics.mean(r["prompt_tokens"] for r in rows["blocked"])
        summary[key] = {
            "prompt_tokens": tokens,
            "before_s": med["before"],
            "blocked_s": med["blocked"],
            "before_tok_s": tokens / med["before"],
            "blocked_tok_s": tokens / med["blocked"],
            "speedup": med["before"] / med["blocked"],
            "same_first_token": f"{sum(r['same_first_token'] for r in rows['blocked'])}"
            f"/{len(rows['blocked'])}",
        }
        print(key, {a: round(b, 3) if isinstance(b, float) else b
                    for a, b in summary[key].items()}, flush=True)  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {
            "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "dtype": args.dtype,
            "quantization": target.quantization,
            "plan": dataclasses.asdict(measured),
            "documents": {n: DOCUMENTS[n][0] for n in args.documents},
            "repeats": args.repeats,
        }
        (out / "prefill.json").write_text(
            json.dumps({"meta": meta, "summary": summary, "records": records}, indent=1)
        )


if __name__ == "__main__":
    main()
