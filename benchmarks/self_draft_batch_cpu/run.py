"""Self-drafts in a batch: one draft forward per draft step for every sequence
(``propose_batch``) against each sequence drafting alone, same machine, same prompts, same
run.

For each batch size c in ``--sizes`` the same Spec-Bench first turns (chat template
applied; the first c of 66 taken round-robin over the category groups) are generated as
one ``LLM.generate(list)`` (greedy, ``--max-new-tokens`` new tokens, ``ignore_eos``) by:

* plain decoding (``none``);
* each ``--method`` (a self-drafting drafter spec with ``k``, optionally ``+controller``),
  with the engine's batched drafting (the default);
* the same method with every sequence drafting alone (the engine's batched path turned
  off in this process: what the engine did before ``propose_batch``).

The configurations are interleaved per batch size (``--rounds`` rounds, the best round
kept), after a warm-up of each. throughput = output tokens / wall seconds of the batch
(prefill included). Every output is compared with plain decoding's.

    .venv/bin/python benchmarks/self_draft_batch_cpu/run.py --quantization none \\
        --method quantized:k=5 --out benchmarks/self_draft_batch_cpu/dense

Writes ``results.json`` and ``report.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path


def prompt_ids(llm, count: int) -> list[list[int]]:
    """The first turns of ``count`` Spec-Bench questions, round-robin over the groups."""
    from specdec.bench.datasets import load_spec_bench, select

    prompts = select(load_spec_bench(), limit_per_category=11)
    groups: dict[str, list] = {}
    for p in prompts:
        groups.setdefault(p.group, []).append(p)
    ordered = [g[i] for i in range(11) for g in groups.values() if i < len(g)]
    return [llm.tokenizer.encode(p.turns[0], chat=True) for p in ordered[:count]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", action="append", required=True)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch

    from specdec import LLM, SamplingParams, SpeculativeConfig
    from specdec.engine.engine import Engine

    torch.set_num_threads(2)
    llm = LLM(backend="native", dtype=args.dtype, quantization=args.quantization)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    batched_chains = Engine._batched_chains

    def run(prompts, method: str, batched: bool):
        Engine._batched_chains = batched_chains if batched else (lambda self, s, p: {})
        drafter, _, controller = method.partition("+")
        spec, _, options = drafter.partition(":")
        k = int(dict(o.split("=") for o in options.split(",") if o).get("k", 0) or 0)
        options = ",".join(o for o in options.split(",") if o and not o.startswith("k="))
        config = SpeculativeConfig(
            method=spec + (":" + options if options else ""),
            num_speculative_tokens=k or 1,
            controller=controller or "fixed",
        )
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, speculative=config)
        seconds = time.perf_counter() - t0
        Engine._batched_chains = batched_chains
        return seconds, [o.token_ids for o in outs], outs

    configs = [("none", True)] + [(m, b) for m in args.method for b in (True, False)]
    rows = []
    for size in args.sizes:
        prompts = prompt_ids(llm, size)
        for method, batched in configs:  # warm-up
            run(prompts[: min(2, size)], method, batched)
        best: dict = {}
        for _ in range(args.rounds):
            for method, batched in configs:
                seconds, ids, outs = run(prompts, method, batched)
                key = (method, batched)
                if key not in best or seconds < best[key][0]:
                    best[key] = (seconds, ids, outs)
        plain_ids = best[("none", True)][1]
        for method, batched in configs:
            seconds, ids, outs = best[(method, batched)]
            tokens = sum(len(t) for t in ids)
            drafted = sum(o.metrics.num_draft_tokens for o in outs)
            accepted = sum(o.metrics.num_accepted_tokens for o in outs)
            rows.append({
                "batch": size, "method": method if method != "none" else "plain",
                "drafting": "-" if method == "none" else "batched" if batched else "alone",
                "seconds": round(seconds, 3), "tok_per_s": round(tokens / seconds, 1),
                "speedup": round(best[("none", True)][0] / seconds, 2),
                "acceptance": round(accepted / drafted, 3) if drafted else None,
                "identical": sum(a == b for a, b in zip(ids, plain_ids, strict=True)),
                "of": size,
            })  # fmt: skip
            print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.processor() or platform.machine(),
        "cpu_count": torch.get_num_threads(),
        "quantization": args.quantization, "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }  # fmt: skip
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "| batch | method | drafting | tok/s | vs plain | acceptance | identical to plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.1f}%"
        lines.append(
            f"| {r['batch']} | `{r['method']}` | {r['drafting']} | {r['tok_per_s']} | "
            f"{r['speedup']:.2f}x | {acc} | {r['identical']}/{r['of']} |"
        )
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
