"""Prefill (time to first token) of long prompts: the blocked prompt kernel against the
prompt attention the runtime chose before it (the library's ``scaled_dot_product_attention``
or the runtime's ragged kernel, whichever the prefill plan measured faster), same model,
same process, alternated. Where the plan chose the kernel's AMX variant, its pair-dot-
product variant runs too (``pairs``).

Prompts: the long-context benchmark's documents (``run.py``: GNU licence texts and Python
standard-library modules found offline), cut to the given lengths of the embedded model's
tokenizer. Each prompt is prefilled by ``LLM.generate`` with one new token, so the time is
the engine's whole prompt path (chunked prefill, products, attention, LM head). Both plans
must give the same first token.

With ``--llama-python PY`` (an interpreter with ``llama-cpp-python``), llama.cpp prefills
the same token ids from the same GGUF file in its own process, between specdec's runs
(``Llama.eval`` of the prompt: its prompt processing, no sampling), with flash attention
off and on (``flash_attn``), ``n_batch`` = ``n_ubatch`` = 512 (its defaults) and the same
threads.

Run: .venv/bin/python benchmarks/long_context_cpu/prefill.py [--lengths ...] [--out DIR]
     [--llama-python /path/to/venv/bin/python]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: Prefix of the llama.cpp worker's answer lines.
ANSWER = "@@answer "


def llama_worker(job_path: str) -> None:
    """llama.cpp's part, in its own interpreter: loads the GGUF with flash attention off and
    on, then answers one ``{"flash", "index"}`` request per line with the seconds its
    prompt processing took."""
    from llama_cpp import Llama

    job = json.loads(Path(job_path).read_text())
    n_ctx = max(len(p) for p in job["prompts"]) + 64
    models = {
        flash: Llama(model_path=job["gguf"], n_ctx=n_ctx, n_threads=job["threads"],
                     n_threads_batch=job["threads"], flash_attn=flash, verbose=False)
        for flash in (False, True)
    }  # fmt: skip
    for llm in models.values():
        llm.reset()
        llm.eval(job["prompts"][0][:64])  # warm-up
    print(ANSWER + "ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        llm = models[request["flash"]]
        llm.reset()
        start = time.perf_counter()
        llm.eval(job["prompts"][request["index"]])
        print(ANSWER + json.dumps({"seconds": time.perf_counter() - start}), flush=True)


class LlamaWorker:
    def __init__(self, python: str, job: Path, threads: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.process = subprocess.Popen(
            [python, __file__, "--llama-job", str(job)], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._answer()

    def _answer(self) -> str:
        for line in self.process.stdout:
            if line.startswith(ANSWER):
                return line[len(ANSWER) :]
        raise RuntimeError(f"the llama.cpp worker exited ({self.process.wait()})")

    def seconds(self, flash: bool, index: int) -> float:
        self.process.stdin.write(json.dumps({"flash": flash, "index": index}) + "\n")
        self.process.stdin.flush()
        return json.loads(self._answer())["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", nargs="+", type=int, default=[960, 1984, 3968, 7936])
    ap.add_argument("--documents", nargs="+", default=["gpl-3", "argparse"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--out", default=None)
    ap.add_argument("--llama-python", default=None, help="an interpreter with llama-cpp-python")
    ap.add_argument("--llama-job", default=None, help=argparse.SUPPRESS)  # the worker
    args = ap.parse_args()
    if args.llama_job:  # in llama.cpp's interpreter: no torch, no specdec
        llama_worker(args.llama_job)
        return
    import torch
    from run import DOCUMENTS, build_prompts

    from specdec import LLM, SamplingParams, SpeculativeConfig
    from specdec.models.loading import load

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
    if measured.blocked_amx:
        plans["pairs"] = dataclasses.replace(measured, blocked_amx=False)
    llm = LLM(target, speculative=SpeculativeConfig(method="none"))
    params = SamplingParams(max_new_tokens=1)
    prompts = build_prompts(target.tokenizer, args.lengths, args.documents)
    llm.generate(prompts[0]["ids"][:64], params)  # warm-up
    worker = None
    if args.llama_python:
        from specdec.models.loading import embedded_gguf_path

        job = Path(args.out or ".") / "llama_job.json"
        job.parent.mkdir(parents=True, exist_ok=True)
        job.write_text(json.dumps({
            "gguf": str(embedded_gguf_path("smollm2-135m-instruct")),
            "prompts": [p["ids"] for p in prompts], "threads": torch.get_num_threads(),
        }))  # fmt: skip
        worker = LlamaWorker(args.llama_python, job, torch.get_num_threads())
        plans = {**plans, "llama.cpp": None, "llama.cpp flash_attn": None}
    records = []
    for index, prompt in enumerate(prompts):
        first = {}
        for _ in range(args.repeats):
            for name, plan in plans.items():
                if name.startswith("llama.cpp"):
                    wall = worker.seconds(name.endswith("flash_attn"), index)
                    records.append({"plan": name, "prompt": prompt["id"],
                                    "prompt_tokens": len(prompt["ids"]), "seconds": wall,
                                    "tokens_per_s": len(prompt["ids"]) / wall})  # fmt: skip
                    print(json.dumps(records[-1]), flush=True)
                    continue
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
        same = all(first[name] == first["before"] for name in first)
        for rec in records:
            if rec["prompt"] == prompt["id"]:
                rec["same_first_token"] = same
        if not same:
            print(f"{prompt['id']}: first tokens differ {first}", flush=True)
    decoder.prefill_plan = measured
    if worker is not None:
        worker.close()
        job.unlink()
    summary = {}
    for length in args.lengths:
        key = f"{round(length / 1024)}k"
        rows = {
            name: [r for r in records if r["plan"] == name and r["prompt"].endswith(key)]
            for name in plans
        }
        med = {name: statistics.median(r["seconds"] for r in rs) for name, rs in rows.items()}
        tokens = statistics.mean(r["prompt_tokens"] for r in rows["blocked"])
        others = [name for name in plans if name.startswith("llama.cpp") or name == "pairs"]
        peers = {f"{name}_s": med[name] for name in others}
        summary[key] = {
            **peers,
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
