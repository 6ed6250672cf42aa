"""Long-context self-speculation in a batch (MagicDec's regime, issue 23).

MagicDec (Chen et al. 2025, arXiv:2408.11049) argues that at long contexts a decoding
step of a batch reads every sequence's KV cache, so a self-draft over a small KV window
saves more as the batch grows, where speculation usually loses. This script measures it:
the same long prompts (run.py's documents, cut to ``--length`` tokens) decoded one at a
time and all together (``LLM.generate(list)``, the batched engine), plain and with each
method; every output must equal plain decoding's, token for token.

Decode time is isolated from the prompts' prefill by running each configuration twice,
once for 1 new token and once for ``--max-new-tokens``: decode throughput = sequences x
(max_new_tokens - 1) / (wall time of the long run - wall time of the short one). Methods
run interleaved (for each mode, every method in turn) so that the machine's drift falls
on all of them alike.

Run: .venv/bin/python benchmarks/long_context_cpu/batch.py [--methods ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from run import DOCUMENTS, build_prompts, load_target, speculative_config

from specdec import LLM, SamplingParams


def _timed(llm: LLM, prompts: list[list[int]], params: SamplingParams, batched: bool):
    """(wall seconds, outputs): the prompts together (batched) or one after another."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params) if batched else [llm.generate(p, params) for p in prompts]
    return time.perf_counter() - t0, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", nargs="+", default=["sparse-kv:k=3,quantization=auto"])
    ap.add_argument("--length", type=int, default=3968)
    ap.add_argument("--documents", nargs="+", default=list(DOCUMENTS))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="auto", help="the target's weights, as run.py")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = load_target(args.dtype, args.quantization)
    prompts = [p["ids"] for p in build_prompts(target.tokenizer, [args.length], args.documents)]
    methods = ["ar", *args.methods]
    llms = {m: LLM(target, speculative=speculative_config(m)) for m in methods}
    for llm in llms.values():  # warm-up
        llm.generate(prompts[0][:64], SamplingParams(max_new_tokens=8))
    short = SamplingParams(max_new_tokens=1, ignore_eos=True)
    full = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    records, plain = [], None
    for batched in (False, True):
        for m in methods:
            prefill_s, _ = _timed(llms[m], prompts, short, batched)
            wall_s, outs = _timed(llms[m], prompts, full, batched)
            ids = [o.token_ids for o in outs]
            if m == "ar" and not batched:
                plain = ids
            decode_tokens = len(prompts) * (args.max_new_tokens - 1)
            rec = {
                "method": m,
                "mode": "batched" if batched else "one at a time",
                "sequences": len(prompts),
                "prefill_run_s": prefill_s,
                "wall_s": wall_s,
                "decode_s": wall_s - prefill_s,
                "decode_tok_s": decode_tokens / (wall_s - prefill_s),
                "tau": sum(o.metrics.num_output_tokens for o in outs)
                / max(sum(o.metrics.num_steps for o in outs), 1),
                "identical": f"{sum(a == b for a, b in zip(ids, plain, strict=True))}/{len(ids)}",
            }
            records.append(rec)
            print(
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}),
                flush=True,
            )
    print("\n| method | mode | decode tok/s | speedup over plain, same mode | τ | identical |")
    print("|---|---|---|---|---|---|")
    for rec in records:
        base = next(r for r in records if r["method"] == "ar" and r["mode"] == rec["mode"])
        rec["speedup"] = rec["decode_tok_s"] / base["decode_tok_s"]
        print(
            f"| `{rec['method']}` | {rec['mode']} | {rec['decode_tok_s']:.1f} | "
            f"{rec['speedup']:.2f}x | {rec['tau']:.2f} | {rec['identical']} |"
        )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {k: v for k, v in vars(args).items() if k != "out"}
        meta["quantization"] = target.quantization
        (out / "results_batch.json").write_text(
            json.dumps({"meta": meta, "records": records}, indent=1)
        )


if __name__ == "__main__":
    main()
