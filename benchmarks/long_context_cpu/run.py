"""Long-context benchmark of sparse-KV self-speculation (issue 23).

Prompts: long documents found offline on any Debian/Ubuntu machine with Python 3.11 --
the GNU licence texts under /usr/share/common-licenses and modules of Python's standard
library (plain text and code) -- cut to ~4k and ~8k tokens of the embedded model's
tokenizer, each followed by a request to summarize (prose) or explain (code). Every
method decodes the same prompts, interleaved, greedy; a method's output must equal plain
decoding's token for token. Reported: decode speed (output tokens over the time after the
prompt's prefill, which is the same for every method), end-to-end speed, mean acceptance
length and the drafter's share of decode time.

Run: .venv/bin/python benchmarks/long_context_cpu/run.py [--methods ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.models.loading import load
from specdec.runtime import cache as kv_cache

#: A method name ending in this runs with no packed KV blocks (the attention kernel packs
#: every block it reads on every forward, as before NativeKVCache.pack_tiles).
UNPACKED = "@unpacked"

DOCUMENTS = {
    "gpl-3": (
        "/usr/share/common-licenses/GPL-3",
        "Summarize the licence above in a few sentences.",
    ),
    "gfdl-lgpl": (
        "/usr/share/common-licenses/GFDL-1.3+/usr/share/common-licenses/LGPL-2.1",
        "Summarize the licence texts above in a few sentences.",
    ),
    "argparse": (
        f"{sys.base_prefix}/lib/python3.11/argparse.py",
        "Explain what the code above does.",
    ),
    "typing": (f"{sys.base_prefix}/lib/python3.11/typing.py", "Explain what the code above does."),
}


def read(paths: str) -> str:
    texts = []
    for p in paths.split("+"):
        path = Path(p)
        if not path.exists():  # python installed elsewhere: fall back to this interpreter's
            import sysconfig

            path = Path(sysconfig.get_paths()["stdlib"]) / path.name
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "\n\n".join(texts)


def build_prompts(tokenizer, lengths, names):
    prompts = []
    for name in names:
        path, ask = DOCUMENTS[name]
        ids = tokenizer.encode(read(path), chat=False)
        for length in lengths:
            body = tokenizer.decode(ids[:length])
            text = f"{body}\n\n{ask}"
            prompt_ids = tokenizer.encode([{"role": "user", "content": text}])
            prompts.append(
                {"id": f"{name}-{round(length / 1024)}k", "length": length, "ids": prompt_ids}
            )
    return prompts


def load_target(dtype: str, quantization: str):
    """The embedded model on the native backend, in ``dtype``, with ``quantization``."""
    return load("smollm2-135m-instruct", dtype=dtype, backend="native", quantization=quantization)


def speculative_config(method: str) -> SpeculativeConfig:
    """``ar`` (plain decoding) or ``NAME:k=K,controller=C,OPTION=...`` (a drafter spec
    with the draft length and controller in it), either maybe ending in ``@unpacked``, as a
    :class:`SpeculativeConfig`."""
    method = method.removesuffix(UNPACKED)
    if method == "ar":
        return SpeculativeConfig(method="none")
    spec, _, rest = method.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    k = int(opts.pop("k", 4))
    controller = opts.pop("controller", "fixed")
    option_text = ",".join(f"{a}={b}" for a, b in opts.items())
    return SpeculativeConfig(
        method=f"{spec}:{option_text}" if option_text else spec,
        num_speculative_tokens=k,
        controller=controller,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--methods", nargs="+", default=["sparse-kv:k=4", "sparse-kv:k=4,skip=6+12+18+24"]
    )
    ap.add_argument("--lengths", nargs="+", type=int, default=[3968, 7936])
    ap.add_argument("--documents", nargs="+", default=list(DOCUMENTS))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--quantization", default="auto",
        help="the target's weights: auto (the GGUF's own blocks, as the CLI), none, q8_0, q4_1",
    )  # fmt: skip
    ap.add_argument(
        "--also-plain", default=None, metavar="QUANTIZATION",
        help="also time plain decoding of the target loaded with this --quantization (method "
        "'ar[QUANTIZATION]', e.g. the GGUF's own blocks beside a dense target: the fastest "
        "plain decoding of the model); its output is not compared",
    )  # fmt: skip
    ap.add_argument(
        "--repeats", type=int, default=1,
        help="run each prompt's methods in turn this many times (a method's speed is then "
        "summed over its runs: one slow moment of a shared machine weighs less)",
    )  # fmt: skip
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = load_target(args.dtype, args.quantization)
    prompts = build_prompts(target.tokenizer, args.lengths, args.documents)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    methods = ["ar", *args.methods]
    llms = {}
    if args.also_plain:
        other = load_target(args.dtype, args.also_plain)
        methods.insert(1, f"ar[{args.also_plain}]")
        llms[methods[1]] = LLM(other, speculative=SpeculativeConfig(method="none"))
    for m in methods:
        if m not in llms:
            llms[m] = LLM(target, speculative=speculative_config(m))
    for llm in llms.values():  # warm-up
        llm.generate(prompts[0]["ids"][:64], SamplingParams(max_new_tokens=8))
    records = []
    packed_from = kv_cache.TILES_FROM
    baseline: dict[str, list[int]] = {}  # per prompt, plain decoding's output
    for prompt, rep, m in (
        (p, r, m) for p in prompts for r in range(args.repeats) for m in methods
    ):  # per prompt, the methods in turn, `repeats` times
        kv_cache.TILES_FROM = 10**9 if m.endswith(UNPACKED) else packed_from
        t0 = time.perf_counter()
        out = llms[m].generate(prompt["ids"], params)
        wall = time.perf_counter() - t0
        s = out.metrics
        decode_s = s.elapsed_s - s.prefill_s
        rec = {
            "method": m,
            "prompt": prompt["id"],
            "repeat": rep,
            "prompt_tokens": len(prompt["ids"]),
            "output_tokens": len(out.token_ids),
            "wall_s": wall,
            "prefill_s": s.prefill_s,
            "decode_s": decode_s,
            "draft_s": s.draft_s,
            "decode_tok_s": len(out.token_ids) / decode_s,
            "e2e_tok_s": len(out.token_ids) / wall,
            "tau": s.num_output_tokens / max(s.num_steps, 1),
            "acceptance_rate": s.acceptance_rate,
            "identical": None,
        }
        if m == "ar":
            baseline.setdefault(prompt["id"], out.token_ids)
        elif not m.startswith("ar["):
            rec["identical"] = out.token_ids == baseline[prompt["id"]]
        records.append(rec)
        print(
            json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()}),
            flush=True,
        )
    summary = {}
    for m in methods:
        for length in args.lengths:
            rs = [
                r
                for r in records
                if r["method"] == m and r["prompt"].endswith(f"-{round(length / 1024)}k")
            ]
            ar = [
                r
                for r in records
                if r["method"] == "ar" and r["prompt"].endswith(f"-{round(length / 1024)}k")
            ]
            dec = sum(r["output_tokens"] for r in rs) / sum(r["decode_s"] for r in rs)
            dec_ar = sum(r["output_tokens"] for r in ar) / sum(r["decode_s"] for r in ar)
            e2e = sum(r["output_tokens"] for r in rs) / sum(r["wall_s"] for r in rs)
            e2e_ar = sum(r["output_tokens"] for r in ar) / sum(r["wall_s"] for r in ar)
            summary[f"{m} @ {round(length / 1024)}k"] = {
                "decode_tok_s": dec,
                "decode_speedup": dec / dec_ar,
                "e2e_tok_s": e2e,
                "e2e_speedup": e2e / e2e_ar,
                "tau": sum(r["tau"] for r in rs) / len(rs),
                "draft_share": sum(r["draft_s"] for r in rs) / sum(r["decode_s"] for r in rs),
                "identical": f"{sum(bool(r['identical']) for r in rs)}/{len(rs)}"
                if not (m == "ar" or m.startswith("ar["))
                else "-",
            }
    for key, v in summary.items():
        print(key, {a: (round(b, 3) if isinstance(b, float) else b) for a, b in v.items()})
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {
            "machine": platform.processor() or platform.machine(),
            "cpus": torch.get_num_threads(),
            "dtype": args.dtype,
            "quantization": target.quantization,
            "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats,
            "methods": methods,
            "lengths": args.lengths,
            "documents": {n: DOCUMENTS[n][0] for n in args.documents},
        }
        (out / "results.json").write_text(
            json.dumps({"meta": meta, "summary": summary, "records": records}, indent=1)
        )


if __name__ == "__main__":
    main()
