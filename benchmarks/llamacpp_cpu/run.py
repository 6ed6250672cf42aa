"""specdec against llama.cpp on llama.cpp's own turf: the embedded model's 4-bit GGUF
(SmolLM2-135M-Instruct Q4_1, Q8_0 embedding / LM head), one request at a time, greedy,
same prompts, same machine, same run.

Both engines get the same prompt token ids (the first turns of Spec-Bench questions, two
per category, chat template applied by specdec's tokenizer) and decode up to
``--max-new-tokens`` greedily, stopping at the end-of-turn token. Speed = generated tokens /
wall seconds of the whole request (prompt processing included), and decoding speed after
the prompt (tokens / (seconds - prompt seconds); llama.cpp's prompt seconds end with its
first token, specdec's with its prefill forwards), after one warm-up request per method.
llama.cpp (``llama-cpp-python``) runs the GGUF file itself with ``n_threads`` = specdec's
thread count; its prompt-lookup decoding (``LlamaPromptLookupDecoding``) is measured too.
specdec runs the file's own Q4_1 / Q8_0 blocks (``quantization gguf``), native backend,
exact mode, activations in the dtype ``auto`` picks (bfloat16 on CPUs with bfloat16
matrix hardware where calibration finds it faster, else float32; the report says which),
plain and with its lossless drafters, with each of its
quantized kernels (``fma``: float32 FMAs, fastest for one row; ``amx``: integer weights on
AMX tiles, about as fast from 4 rows and far cheaper for verification; ``dpbf16``: the
same arithmetic on AVX512-BF16's pair dot products, for CPUs without AMX; ``q8``:
activations rounded to 8 bits per block and integer dot products, llama.cpp's own
arithmetic, opt-in; see ``specdec.runtime.quant``; forced with ``SPECDEC_QUANT_KERNEL``,
the ``amx`` rows only where the CPU has AMX-BF16, the ``dpbf16`` ones where it has
AVX512-BF16); the dense copy is the reference line.

Methods are interleaved: every method decodes prompt 1, then every method prompt 2, and so
on (llama.cpp in a worker process that keeps both of its configurations loaded), so a
change in the machine's speed during the run (a shared VM) hits all of them alike.

Identity: every specdec method's output is compared with specdec's plain decoding on the
same target and kernel ("its own plain": greedy speculative decoding must not change a
token) and with the first specdec plain row; llama.cpp's outputs with specdec's plain
decoding (different arithmetic: equal only where neither rounding flips a choice) and
llama.cpp's prompt lookup with llama.cpp's plain decoding.

llama-cpp-python builds from source; on CPUs whose AMX path crashes it, build without it
(see the README's peers section):

    python -m venv /work/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON ... -DGGML_AMX_TILE=OFF ..." \\
        /work/llama-venv/bin/pip install llama-cpp-python
    .venv/bin/python benchmarks/llamacpp_cpu/run.py --llama-python /work/llama-venv/bin/python

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

#: specdec configurations: (label, target, method, k, controller); target: "dense" (the
#: dense copy in the activations' dtype) or the quantized kernel on the GGUF's blocks
#: ("fma", "amx", "dpbf16", "q8").
SPECDEC_METHODS = (
    ("specdec plain (dense)", "dense", "none", 0, "fixed"),
    ("specdec plain, fma kernel", "fma", "none", 0, "fixed"),
    ("specdec prompt lookup k=10, fma kernel", "fma", "ngram", 10, "fixed"),
    ("specdec prompt lookup, cost controller, fma kernel", "fma", "ngram", 10, "cost"),
    ("specdec suffix, cost controller, fma kernel", "fma", "suffix", 10, "cost"),
    ("specdec plain, amx kernel", "amx", "none", 0, "fixed"),
    ("specdec prompt lookup k=10, amx kernel", "amx", "ngram", 10, "fixed"),
    ("specdec prompt lookup, cost controller, amx kernel", "amx", "ngram", 10, "cost"),
    ("specdec suffix, cost controller, amx kernel", "amx", "suffix", 10, "cost"),
    ("specdec plain, dpbf16 kernel", "dpbf16", "none", 0, "fixed"),
    ("specdec prompt lookup k=10, dpbf16 kernel", "dpbf16", "ngram", 10, "fixed"),
    ("specdec prompt lookup, cost controller, dpbf16 kernel", "dpbf16", "ngram", 10, "cost"),
    ("specdec suffix, cost controller, dpbf16 kernel", "dpbf16", "suffix", 10, "cost"),
    ("specdec plain, q8 kernel", "q8", "none", 0, "fixed"),
    ("specdec prompt lookup k=10, q8 kernel", "q8", "ngram", 10, "fixed"),
    ("specdec prompt lookup, cost controller, q8 kernel", "q8", "ngram", 10, "cost"),
    ("specdec suffix, cost controller, q8 kernel", "q8", "suffix", 10, "cost"),
)


def prompt_ids(per_category: int) -> tuple[list[list[int]], list[str], int, str]:
    """Chat prompt token ids of the first turns of ``per_category`` Spec-Bench questions
    per category, their categories, the end-of-turn id, and the GGUF file."""
    from specdec.bench.datasets import load_spec_bench, select
    from specdec.models.loading import embedded_gguf_path, load

    model = load("smollm2-135m-instruct")
    prompts = select(load_spec_bench(), limit_per_category=per_category)
    ids = [model.tokenizer.encode(p.turns[0], chat=True) for p in prompts]
    eos = sorted(model.tokenizer.eos_token_ids)
    return ids, [p.category for p in prompts], eos, str(embedded_gguf_path("smollm2-135m-instruct"))


#: llama.cpp configurations: (label, prompt-lookup draft length or None).
LLAMA_METHODS = (("llama.cpp plain", None), ("llama.cpp prompt lookup k=10", 10))
#: Prefix of the llama.cpp worker's answer lines (anything else it prints is ignored).
ANSWER = "@@answer "


def run_llama(args) -> None:
    """llama.cpp's part, a worker in its own environment: loads both configurations, warms
    each up, then answers one ``{"label", "index"}`` request per line on standard input
    (a greedy decoding of that prompt) with one :data:`ANSWER` line on standard output."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    job = json.loads(Path(args.job).read_text())
    models = {}
    for label, draft in LLAMA_METHODS:
        models[label] = Llama(
            model_path=job["gguf"], n_ctx=4096, n_threads=job["threads"],
            n_threads_batch=job["threads"], n_batch=512, verbose=False,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=draft) if draft else None,
        )  # fmt: skip

    def decode(llm, ids):
        tokens, start, first = [], time.perf_counter(), None
        for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            first = first or time.perf_counter() - start
            if token in job["eos"]:
                break
            tokens.append(token)
            if len(tokens) >= job["max_new_tokens"]:
                break
        return tokens, first

    for llm in models.values():
        decode(llm, job["prompts"][0])  # warm-up
    print(ANSWER + "ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        ids = job["prompts"][request["index"]]
        start = time.perf_counter()
        try:
            (tokens, first), error = decode(models[request["label"]], ids), None
        except Exception as exc:  # reported, not hidden
            tokens, first, error = [], None, f"{type(exc).__name__}: {exc}"[:200]
        row = {
            "seconds": time.perf_counter() - start, "tokens": tokens, "error": error,
            "prompt_s": first,  # prompt processing and the first token's step
        }  # fmt: skip
        print(ANSWER + json.dumps(row), flush=True)


class LlamaWorker:
    """The llama.cpp worker process (:func:`run_llama`), asked one decoding at a time."""

    def __init__(self, python: str, job: Path, threads: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.process = subprocess.Popen(
            [python, __file__, "--part", "llama", "--job", str(job)], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._answer()  # loaded and warmed up

    def _answer(self) -> str:
        for line in self.process.stdout:
            if line.startswith(ANSWER):
                return line[len(ANSWER) :]
        raise RuntimeError(f"the llama.cpp worker exited ({self.process.wait()})")

    def decode(self, label: str, index: int) -> dict:
        self.process.stdin.write(json.dumps({"label": label, "index": index}) + "\n")
        self.process.stdin.flush()
        return json.loads(self._answer())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def specdec_models() -> dict:
    """specdec's targets: the dense copy (dtype ``auto``), and the GGUF file's own blocks
    with each quantized kernel available here for that dtype."""
    from specdec import LLM
    from specdec.runtime.quant import available_quant_kernels

    models = {"dense": LLM(backend="native", quantization="none")}
    for kernel in available_quant_kernels(models["dense"].target.dtype):
        os.environ["SPECDEC_QUANT_KERNEL"] = kernel
        try:
            models[kernel] = LLM(backend="native", quantization="gguf")
        finally:
            del os.environ["SPECDEC_QUANT_KERNEL"]
    return models


def run_specdec_one(models: dict, method: tuple, ids: list[int], max_new_tokens: int) -> dict:
    """One prompt with one configuration of :data:`SPECDEC_METHODS`."""
    from specdec import SamplingParams, SpeculativeConfig

    _, target, name, k, controller = method
    config = SpeculativeConfig(method=name, num_speculative_tokens=max(k, 1), controller=controller)
    start = time.perf_counter()
    result = models[target].generate(
        ids, SamplingParams(max_new_tokens=max_new_tokens), speculative=config
    )
    return {
        "seconds": time.perf_counter() - start, "tokens": list(result.token_ids),
        "tau": result.metrics.mean_acceptance_length if name != "none" else None,
        "prompt_s": result.metrics.prefill_s,  # the prompt's prefill forwards
    }  # fmt: skip


def run_interleaved(prompts, max_new_tokens: int, worker: LlamaWorker) -> dict:
    """Every method on prompt 1, then every method on prompt 2, ...: drift in the
    machine's speed (a shared VM) hits every method alike. One warm-up per method first."""
    models = specdec_models()
    methods = [m for m in SPECDEC_METHODS if m[1] in models]
    for method in methods:
        run_specdec_one(models, method, prompts[0], max_new_tokens)  # warm-up
    labels = [label for label, _ in LLAMA_METHODS] + [m[0] for m in methods]
    out: dict = {label: [] for label in labels}
    for index, ids in enumerate(prompts):
        for label, _ in LLAMA_METHODS:
            out[label].append(worker.decode(label, index))
        for method in methods:
            out[method[0]].append(run_specdec_one(models, method, ids, max_new_tokens))
        print(f"prompt {index + 1}/{len(prompts)}", file=sys.stderr)
    out["_dtype"] = str(models["dense"].target.dtype).replace("torch.", "")
    #: each specdec method's own plain decoding (same target and kernel)
    out["_own"] = {
        m[0]: next(p[0] for p in methods if p[1] == m[1] and p[2] == "none") for m in methods
    }
    return out


def summarize(
    results: dict, reference: str, llama_reference: str, own: dict | None = None
) -> list[dict]:
    """Per method: speeds, identity with ``reference`` and with its own plain decoding
    (``own[label]``, else ``reference``; llama.cpp's: ``llama_reference``)."""
    rows = []
    own = own or {}
    ref = results[reference]
    for label, runs in results.items():
        if label.startswith("_"):
            continue
        tokens = sum(len(r["tokens"]) for r in runs)
        seconds = sum(r["seconds"] for r in runs)
        same = sum(r["tokens"] == b["tokens"] for r, b in zip(runs, ref, strict=True))
        mine = results[
            llama_reference if label.startswith("llama.cpp") else own.get(label, reference)
        ]
        same_own = sum(r["tokens"] == b["tokens"] for r, b in zip(runs, mine, strict=True))
        taus = [r["tau"] for r in runs if r.get("tau")]
        ok = [r for r in runs if r.get("prompt_s") is not None and r["tokens"]]
        decode_s = sum(r["seconds"] - r["prompt_s"] for r in ok)
        rows.append({
            "method": label,
            "tok_per_s": tokens / seconds,
            "decode_tok_per_s": sum(len(r["tokens"]) for r in ok) / decode_s,
            "prompt_s": sum(r["prompt_s"] for r in ok),
            "tokens": tokens,
            "seconds": seconds,
            "identical_to_specdec_plain": same,
            "identical_to_own_plain": same_own,
            "errors": sum(1 for r in runs if r.get("error")),
            "mean_acceptance_length": sum(taus) / len(taus) if taus else None,
            "prompts": len(runs),
        })  # fmt: skip
    return rows


def report(summary: list[dict], config: dict) -> str:
    llama = next(r for r in summary if r["method"] == "llama.cpp plain")
    base, dbase = llama["tok_per_s"], llama["decode_tok_per_s"]
    lines = [
        "# specdec vs llama.cpp on the embedded model's Q4_1 GGUF (one request at a time)",
        "",
        f"Machine: {config['machine']}, {config['threads']} threads. "
        f"{config['prompts']} Spec-Bench prompts ({config['per_category']} per category), "
        f"greedy, up to {config['max_new_tokens']} new tokens, stop at end of turn; "
        f"tok/s = generated tokens / wall seconds including prompt processing; decoding tok/s "
        f"excludes it. "
        f"specdec: native backend, exact mode, {config['dtype']} activations.",
        "",
        "| method | tok/s | vs llama.cpp plain | decoding tok/s (after the prompt) | vs "
        "llama.cpp plain | prompt seconds (all prompts) | "
        f"identical to {config.get('reference', 'specdec plain')} | "
        "identical to its own plain | mean acceptance length | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        tau = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "-"
        lines.append(
            f"| {r['method']} | {r['tok_per_s']:.1f} | {r['tok_per_s'] / base:.2f}x | "
            f"{r['decode_tok_per_s']:.1f} | {r['decode_tok_per_s'] / dbase:.2f}x | "
            f"{r['prompt_s']:.1f} | "
            f"{r['identical_to_specdec_plain']}/{r['prompts']} | "
            f"{r['identical_to_own_plain']}/{r['prompts']} | {tau} | {r['errors']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", help="python of the environment with llama-cpp-python")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--part", choices=["llama"], help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "llama":
        run_llama(args)
        return 0
    if not args.llama_python:
        parser.error("--llama-python is required (an environment with llama-cpp-python)")
    import torch

    torch.set_num_threads(args.threads)
    ids, categories, eos, gguf = prompt_ids(args.per_category)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    job = out / "llama_job.json"
    job.write_text(json.dumps({
        "gguf": gguf, "prompts": ids, "eos": eos, "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
    }))  # fmt: skip
    worker = LlamaWorker(args.llama_python, job, args.threads)
    try:
        results = run_interleaved(ids, args.max_new_tokens, worker)
    finally:
        worker.close()
        job.unlink()
    dtype = results.pop("_dtype")
    own = results.pop("_own")
    plain = next(label for label in own if label.startswith("specdec plain,"))
    summary = summarize(results, plain, "llama.cpp plain", own)
    from specdec.runtime.linear import cpu_name

    config = {
        "machine": f"{cpu_name()} ({platform.machine()}), {os.cpu_count()} cores",
        "threads": args.threads, "prompts": len(ids), "per_category": args.per_category,
        "max_new_tokens": args.max_new_tokens, "dtype": dtype, "categories": categories,
        "reference": plain,
    }  # fmt: skip
    (out / "results.json").write_text(
        json.dumps({"config": config, "summary": summary, "runs": results}, indent=1)
    )
    text = report(summary, config)
    (out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
