"""specdec's suffix drafter inside vLLM against vLLM's own n-gram proposer, same machine,
same prompts, same run.

Three vLLM engines, each in its own process, decode the same prompts one request at a
time (greedy, the chat template applied by the model's tokenizer):

* ``vllm-ar``: vLLM's plain decoding;
* ``vllm-ngram``: vLLM's built-in prompt lookup (``method: ngram``, k = 8,
  ``prompt_lookup_min`` 1, ``prompt_lookup_max`` 4);
* ``vllm+specdec-suffix``: ``method: custom_class``,
  ``specdec.integrations.vllm.SuffixProposer`` (SuffixDecoding with specdec's
  cross-request cache, its defaults), k = 8.

The prompts are the first turns of Spec-Bench (``--per-category`` per category, in file
order). Each engine first decodes two warm-up prompts (a repetitive one, so the
speculative paths compile), then the timed prompts; tokens/s = output tokens / wall
seconds of the ``generate`` calls. Mean acceptance length is vLLM's definition,
1 + accepted / drafts, from its own ``spec_decode`` counters; acceptance rate = accepted /
draft tokens. Identity is against ``vllm-ar``'s output for the same prompt.

Runs under an interpreter with vLLM and specdec installed (``make test-vllm`` builds one):

    .venv-vllm/bin/python benchmarks/vllm_proposer_cpu/run.py

Writes ``results.json`` and ``report.md`` beside this file (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUESTIONS = Path(__file__).resolve().parents[2].parent / "shared/data/spec_bench/question.jsonl"
K = 8
METHODS = {
    "vllm-ar": None,
    "vllm-ngram": {
        "method": "ngram", "num_speculative_tokens": K,
        "prompt_lookup_min": 1, "prompt_lookup_max": 4,
    },
    "vllm+specdec-suffix": {
        "method": "custom_class", "model": "specdec.integrations.vllm.SuffixProposer",
        "num_speculative_tokens": K,
    },
}  # fmt: skip
WARMUP = [
    "Repeat this line five times: alpha beta gamma delta epsilon.",
    "Write a short paragraph about the sea.",
]


def child(args: argparse.Namespace) -> None:
    """One engine: decode the prompts, print one JSON line."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm.inputs import TokensPrompt

    prompts = json.loads(Path(args.prompts).read_text())
    start = time.perf_counter()
    llm = vllm.LLM(
        model=args.model, dtype=args.dtype, max_model_len=4096, seed=0,
        enable_prefix_caching=False, disable_log_stats=False,
        speculative_config=METHODS[args.child],
    )  # fmt: skip
    load_s = time.perf_counter() - start
    tok = llm.get_tokenizer()

    def ids(text):
        chat = [{"role": "user", "content": text}]
        rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return tok(rendered, add_special_tokens=False).input_ids

    params = vllm.SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)

    def counters():
        return {
            m.name.split(":")[-1]: m.value
            for m in llm.get_metrics()
            if "spec_decode" in m.name and hasattr(m, "value")
        }

    for text in WARMUP:
        llm.generate([TokensPrompt(prompt_token_ids=ids(text))], params, use_tqdm=False)
    before = counters()
    rows = []
    for p in prompts:
        prompt = TokensPrompt(prompt_token_ids=ids(p["text"]))
        t = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        rows.append({"elapsed_s": time.perf_counter() - t, "token_ids": list(out.token_ids)})
    after = counters()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    print(json.dumps({"method": args.child, "version": vllm.__version__, "load_s": load_s,
                      "rows": rows, "counters": delta}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--child", choices=list(METHODS), help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.model is None:
        from specdec.models.loading import cached_gguf_conversion, embedded_gguf_path

        args.model = str(cached_gguf_conversion(embedded_gguf_path("smollm2-135m-instruct")))
    taken: dict[str, int] = {}
    prompts = []
    for line in QUESTIONS.read_text().splitlines():
        q = json.loads(line)
        if taken.get(q["category"], 0) < args.per_category:
            taken[q["category"]] = taken.get(q["category"], 0) + 1
            prompts.append({"id": q["question_id"], "category": q["category"],
                            "text": q["turns"][0]})  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompt_file = out / "prompts.tmp.json"
    prompt_file.write_text(json.dumps(prompts))
    results = {}
    for method in METHODS:
        cmd = [sys.executable, __file__, "--child", method, "--prompts", str(prompt_file),
               "--model", args.model, "--dtype", args.dtype,
               "--max-new-tokens", str(args.max_new_tokens)]  # fmt: skip
        print(f"running {method} ...", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{method} failed:\n{done.stderr[-3000:]}")
        results[method] = json.loads(done.stdout.strip().splitlines()[-1])
    prompt_file.unlink()
    record = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "dtype": args.dtype, "k": K, "max_new_tokens": args.max_new_tokens,
        "prompts": prompts, "results": results,
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(record, indent=1))
    (out / "report.md").write_text(report(record))
    print(report(record))


def summary(record: dict, method: str) -> dict:
    res = record["results"][method]
    plain = record["results"]["vllm-ar"]["rows"]
    tokens = sum(len(r["token_ids"]) for r in res["rows"])
    seconds = sum(r["elapsed_s"] for r in res["rows"])
    c = res["counters"]
    drafts = c.get("spec_decode_num_drafts", 0)
    draft_tokens = c.get("spec_decode_num_draft_tokens", 0)
    accepted = c.get("spec_decode_num_accepted_tokens", 0)
    same = sum(r["token_ids"] == p["token_ids"] for r, p in zip(res["rows"], plain, strict=True))
    return {
        "tokens_per_s": tokens / seconds,
        "tau": 1 + accepted / drafts if drafts else None,
        "acceptance": accepted / draft_tokens if draft_tokens else None,
        "identical": f"{same}/{len(plain)}",
        "tokens": tokens,
        "seconds": seconds,
    }


def report(record: dict) -> str:
    base = summary(record, "vllm-ar")["tokens_per_s"]
    version = record["results"]["vllm-ar"]["version"]
    lines = [
        "# specdec's suffix drafter inside vLLM vs vLLM's n-gram proposer",
        "",
        f"vLLM {version} (CPU build), {record['machine']}, {record['date']}; SmolLM2-135M "
        f"(the embedded model's weights), {record['dtype']}, greedy, one request at a time, "
        f"{len(record['prompts'])} Spec-Bench first turns (the first "
        f"{len(record['prompts']) // 13} of each of its 13 categories), up to "
        f"{record['max_new_tokens']} new tokens, k = {record['k']}. One run; "
        "`benchmarks/vllm_proposer_cpu/run.py` made it.",
        "",
        "| method | tokens/s | vs vllm-ar | mean acceptance length | acceptance rate "
        "| identical to vllm-ar |",
        "|---|---|---|---|---|---|",
    ]
    for method in record["results"]:
        s = summary(record, method)
        tau = f"{s['tau']:.2f}" if s["tau"] else "-"
        acc = f"{s['acceptance']:.0%}" if s["acceptance"] is not None else "-"
        lines.append(
            f"| {method} | {s['tokens_per_s']:.1f} | {s['tokens_per_s'] / base:.2f}x | {tau} "
            f"| {acc} | {s['identical'] if method != 'vllm-ar' else '-'} |"
        )
    lines += [
        "",
        "Mean acceptance length is vLLM's (1 + accepted / drafts, over steps that drafted); "
        "acceptance rate = accepted / draft tokens, from vLLM's own counters.",
        "",
        "Identity: in bfloat16 vLLM's CPU kernels give a verification forward over several "
        "tokens slightly different logits from a one-token step, so any speculative method "
        "in vLLM, its own n-gram included, can leave its plain decoding at a near-tie; "
        "specdec's proposer only chooses which tokens vLLM verifies. In float32 "
        "(`make test-vllm`) vLLM with specdec's proposer equals vLLM's plain decoding "
        "and specdec's, token for token.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
