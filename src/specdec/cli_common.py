"""Command-line options shared by ``specdec generate`` and ``specdec bench``."""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec import registry
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.machine import busy_cores, threads_for
from specdec.machine import cores as machine_cores
from specdec.models.loading import (
    BACKENDS,
    DEFAULT_BACKEND,
    DEFAULT_DTYPE,
    DEFAULT_QUANTIZATION,
    QUANTIZATION_CHOICES,
    check_backend,
    check_dtype,
    check_quantization,
    check_source,
    parse_device,
)
from specdec.structured import StructuredOutputsParams
from specdec.trees.spec import TreeSpecError


def add_drafter_args(parser: argparse.ArgumentParser) -> None:
    """``--drafter --draft-model --num-speculative-tokens --tree``."""
    names = registry.drafter_names()
    parser.add_argument(
        "--drafter",
        default=None,
        metavar="NAME[:OPTS]",
        type=_drafter_spec,
        help=f"how draft tokens are proposed: {', '.join(names)}, optionally with options, "
        "e.g. ngram:min_n=1,max_n=3 or suffix:max_depth=32 (default: ngram, or draft-model "
        "when --draft-model is given; `specdec drafters` lists every drafter and option)",
    )
    parser.add_argument("--draft-model", help="draft model (implies --drafter draft-model)")
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=DEFAULT_K,
        metavar="K",
        help="draft tokens per verification step (default: 5)",
    )
    parser.add_argument(
        "--tree",
        metavar="SPEC",
        help="verify a token tree per step instead of a chain: "
        "static:<tree-8|tree-16|tree-32|chain-K|paths.json>[,draw=top|iid|wor], "
        "dynamic:top_k=4,depth=5,budget=16 (EAGLE-2), best-first:budget=16,depth=6 "
        "(DDTree), sequoia:budget=16,depth=6 (Sequoia); budget = draft nodes per step; "
        "adaptive=true on dynamic / best-first: verify only the nodes that pay this step",
    )
    parser.add_argument(
        "--controller",
        default="fixed",
        metavar="NAME[:OPTS]",
        type=_controller_spec,
        help=f"how many tokens each step drafts, at most K: "
        f"{', '.join(registry.controller_names())}, optionally with options, e.g. "
        "cost:decay=0.9 (default: fixed, always K; cost switches speculation off when it "
        "does not pay; `specdec controllers` lists every controller and option)",
    )
    parser.add_argument(
        "--verifier",
        default="rejection",
        metavar="NAME[:OPTS]",
        help="how sampled chains are verified: rejection (token by token, the default) or "
        "block (Sun et al. 2024: the whole block at once, keeps at least as many tokens per "
        "step; chains only), both lossless; or typical[:epsilon=E,delta=D] (Medusa-2's "
        "typical acceptance: LOSSY, sampled output no longer follows the model; needs "
        "--allow-lossy)",
    )
    parser.add_argument(
        "--allow-lossy",
        action="store_true",
        help="opt in to a lossy --verifier (typical)",
    )


def _drafter_spec(text: str) -> str:
    """argparse type of ``--drafter``: checks the name and options now."""
    try:
        SpeculativeConfig(method=text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _controller_spec(text: str) -> str:
    """argparse type of ``--controller``: checks the name and options now."""
    try:
        SpeculativeConfig(method="none", controller=text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


#: ``--num-speculative-tokens``'s default.
DEFAULT_K = 5

#: Drafters that draft with the target's own decoder on the native runtime.
SELF_DRAFTERS = ("layer-skip", "sparse-kv", "quantized")


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    """:class:`SpeculativeConfig` from the options of :func:`add_drafter_args`.

    Raises:
        ValueError: ``--draft-model`` with another drafter, a self-draft with ``--backend
            hf``, or an invalid setting.
    """
    drafter = args.drafter or ("draft-model" if args.draft_model else "ngram")
    name, values = registry.parse_spec(drafter)
    needs_draft = registry.needs_draft_model(name, values)
    if args.draft_model and not needs_draft:
        raise ValueError(
            f"--draft-model is only used with --drafter draft-model (or hybrid:model=draft-model), "
            f"not {name}"
        )
    if needs_draft and not args.draft_model:
        raise ValueError(
            f"--drafter {name} needs a draft model: add --draft-model NAME_OR_PATH (a "
            "smaller model, best one sharing the target's tokenizer; for a cheaper copy of "
            "the target itself use --drafter quantized instead)"
        )
    if name in SELF_DRAFTERS and getattr(args, "backend", None) == "hf":
        raise ValueError(  # refused before the model loads, not after
            f"--drafter {name} needs the native backend (--backend native or auto): it "
            "drafts with the target's own decoder over the runtime's KV cache"
        )
    try:
        config = SpeculativeConfig(
            method=drafter,
            num_speculative_tokens=args.num_speculative_tokens,
            draft_model=args.draft_model,
            tree=args.tree,
            controller=args.controller,
            verifier=getattr(args, "verifier", "rejection"),
            allow_lossy=getattr(args, "allow_lossy", False),
        )
    except ValueError as error:
        kind = type(error) if isinstance(error, TreeSpecError) else ValueError
        raise kind(str(error).replace("allow_lossy=True", "--allow-lossy")) from None
    return config


def note_unused_options(args: argparse.Namespace, config: SpeculativeConfig) -> None:
    """A line on standard error for each valid option that does nothing beside the others
    (K beside a token tree, a controller beside ``--drafter none``). Called once every
    option is checked, so that an invalid setting's error stays the only line."""
    if config.tree is not None and args.num_speculative_tokens != DEFAULT_K:
        print(
            "specdec: note: --num-speculative-tokens is not used with --tree: the tree "
            "spec's depth and budget size each step's draft",
            file=sys.stderr,
        )
    controller = (getattr(args, "controller", None) or "fixed").partition(":")[0]
    if config.method.partition(":")[0] == "none" and controller != "fixed":
        print(
            f"specdec: note: --controller {controller} does nothing with --drafter none: "
            "nothing is drafted",
            file=sys.stderr,
        )


def add_sampling_args(parser: argparse.ArgumentParser, max_new_tokens: int, seed) -> None:
    """``--max-new-tokens --temperature --top-p --top-k --min-p --repetition-penalty
    --presence-penalty --frequency-penalty --logit-bias --min-tokens --bad-word``, one of
    ``--json-schema --json-object --regex --choice --grammar``, ``--seed --dtype --device
    --backend --exact``."""
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=max_new_tokens,
        metavar="N",
        help=f"most tokens to generate (default: {max_new_tokens})",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default: 1, off)")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables (default)")
    parser.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens less probable than MIN_P x the most probable (default: 0, off)",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="CTRL's penalty on prompt and output tokens (default: 1, off; > 1 repeats less)",
    )
    parser.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="OpenAI's, subtracted once per token already in the output (-2..2; default: 0)",
    )
    parser.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="OpenAI's, subtracted per occurrence in the output (-2..2; default: 0)",
    )
    parser.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit (repeatable)",
    )
    parser.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        metavar="N",
        help="no EOS or stop token before N output tokens, and no --stop string ending inside "
        "their text (vLLM's rule; default: 0)",
    )
    parser.add_argument(
        "--bad-word",
        action="append",
        default=[],
        metavar="WORD",
        help="never generate WORD (vLLM's bad_words; repeatable)",
    )
    structured = parser.add_argument_group("structured output (one of)")
    structured.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        help="the output is JSON valid against SCHEMA (JSON text, or @FILE)",
    )
    structured.add_argument(
        "--json-object", action="store_true", help="the output is a JSON object"
    )
    structured.add_argument(
        "--regex", metavar="REGEX", help="the output matches REGEX in full (Rust regex syntax)"
    )
    structured.add_argument(
        "--choice",
        action="append",
        metavar="TEXT",
        help="the output is one of these strings (repeat the flag for each)",
    )
    structured.add_argument(
        "--grammar",
        metavar="LARK",
        help="the output matches this Lark grammar (llguidance's dialect; text, or @FILE)",
    )
    parser.add_argument("--seed", type=int, default=seed, help=f"sampling seed (default: {seed})")
    parser.add_argument(
        "--dtype",
        default=DEFAULT_DTYPE,
        help="auto (default: bfloat16 where this machine runs it faster, else float32), "
        "float32, bfloat16, float16 (on CPU: transformers only, slow), int8-dynamic",
    )
    parser.add_argument(
        "--draft-dtype",
        default=None,
        help="dtype of --draft-model (default: --dtype); int8-dynamic quantizes its "
        "decoder linear layers to int8 (CPU)",
    )
    add_device_args(parser)
    parser.add_argument(
        "--backend",
        default=DEFAULT_BACKEND,
        choices=BACKENDS,
        help="who runs the model's forward (target and draft): auto (default: native where "
        "supported, else transformers, logged), native (specdec's runtime: Llama, Mistral, "
        "Qwen2, Qwen3), hf (transformers); an int8-dynamic draft always runs on transformers",
    )
    parser.add_argument(
        "--exact",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="native backend: batch-invariant forwards, so greedy speculative output is "
        "bit-identical to plain decoding in any dtype (default: on)",
    )
    add_quantization_arg(parser)
    add_threads_arg(parser)


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--draft-device``."""
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument(
        "--draft-device",
        default=None,
        help="torch device of --draft-model (default: --device), e.g. cpu beside a cuda target",
    )


def serve_quantization_default(flags: str | None = None) -> str:
    """``specdec serve``'s ``--quantization`` default for this CPU (``flags``: its
    instruction-set flags, default this machine's, see
    :func:`specdec.runtime.kernels.cpu_flags`): ``none`` where it has AMX-BF16, whose
    matrix units run a batch of many sequences faster on dense bfloat16 weights (measured
    on a 2-core Xeon), else ``auto`` (a GGUF's own blocks: on a 2-core AMD EPYC Zen 4, 32
    Spec-Bench prompts at once decoded at the same speed as on dense weights, 8 at once
    1.35x faster, 2026-12-05)."""
    from specdec.runtime.kernels import cpu_flags

    return "none" if "amx_bf16" in (cpu_flags() if flags is None else flags).split() else "auto"


def add_quantization_arg(
    parser: argparse.ArgumentParser, default: str = DEFAULT_QUANTIZATION, why: str = ""
) -> None:
    """``--quantization`` (see :func:`specdec.models.load`); ``why`` follows the default
    in the help."""
    parser.add_argument(
        "--quantization",
        default=default,
        choices=QUANTIZATION_CHOICES,
        help=f"native backend, weight-only quantized products (default: {default}{why}): "
        "auto = a GGUF model (like the embedded one) runs its own Q4_1 / Q8_0 blocks, others "
        "run dense; none = dense; gguf = the GGUF's own blocks; q8_0 / q4_1 = quantize the "
        "loaded (for a GGUF: dequantized) weights again at load. Products use the quantized "
        "weights exactly (kernel fma, amx or dpbf16, measured per machine; "
        "SPECDEC_QUANT_KERNEL=fma|amx|dpbf16 forces one); exact mode holds. "
        "SPECDEC_QUANT_KERNEL=q8 (opt-in) rounds the activations to 8 bits instead, as "
        "llama.cpp does: faster on CPUs, a slightly different model, still lossless "
        "speculation on it",
    )


def add_threads_arg(parser: argparse.ArgumentParser, adapt: bool = True) -> None:
    """``--threads`` (``adapt``: the default lowers the count on a busy machine, see
    :func:`choose_threads`)."""
    default = (
        "PyTorch's one per core, fewer when other processes keep cores busy"
        if adapt
        else "PyTorch's one per core; a warning says when other processes keep cores busy"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help=f"CPU threads for PyTorch (default: OMP_NUM_THREADS if set, else {default})",
    )


def sampling_params(args: argparse.Namespace, stop: tuple[str, ...] = ()) -> SamplingParams:
    """:class:`SamplingParams` from the options added by :func:`add_sampling_args`; also
    checks ``--dtype`` and ``--draft-dtype`` (whether or not a draft is used), so every
    such mistake is refused before a model loads.

    Raises:
        ValueError: a bad value (the message names it).
    """
    for flag, value in (("--dtype", args.dtype), ("--draft-dtype", args.draft_dtype)):
        if value is not None:
            try:
                check_dtype(value)
            except ValueError as error:
                raise ValueError(f"{flag}: {error}") from None
    check_backend(args.backend, args.dtype)
    check_quantization(args.quantization, args.backend)
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        stop=stop,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=parse_logit_bias(args.logit_bias),
        min_tokens=args.min_tokens,
        bad_words=tuple(getattr(args, "bad_word", ())),
        structured_outputs=structured_outputs(args),
    )


def structured_outputs(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The output constraint of ``--json-schema``, ``--json-object``, ``--regex``,
    ``--choice`` or ``--grammar`` (``None`` without one); ``@FILE`` reads a schema or
    grammar from a file.

    Raises:
        ValueError: more than one flag, an unreadable file or an invalid constraint
            (naming the flag).
    """
    given = [
        "--" + flag.replace("_", "-")
        for flag in ("json_schema", "json_object", "regex", "choice", "grammar")
        if getattr(args, flag, None)
    ]
    if len(given) > 1:
        raise ValueError(f"give one output constraint, got {', '.join(given)}")
    for flag, kind in (("json_schema", "json"), ("regex", "regex"), ("grammar", "grammar")):
        value = getattr(args, flag, None)
        if value is None:
            continue
        name = "--" + flag.replace("_", "-")
        if value.startswith("@"):
            try:
                value = Path(value[1:]).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                raise ValueError(f"{name}: cannot read {value[1:]}: {error}") from None
        try:
            return StructuredOutputsParams(**{kind: value})
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
    if getattr(args, "choice", None):
        try:
            return StructuredOutputsParams(choice=args.choice)
        except ValueError as error:
            raise ValueError(f"--choice: {error}") from None
    if getattr(args, "json_object", False):
        return StructuredOutputsParams(json_object=True)
    return None


def parse_logit_bias(items: list[str]) -> dict[int, float]:
    """``--logit-bias ID=BIAS`` values as ``{id: bias}``.

    Raises:
        ValueError: an item not of the form ``ID=BIAS`` (integer id, number bias).
    """
    bias = {}
    for item in items:
        token, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(
                f"--logit-bias takes ID=BIAS (a token id and a number), got {item!r}"
            ) from None
    return bias


def llm_from_args(args: argparse.Namespace, speculative: SpeculativeConfig, **kwargs):
    """An :class:`~specdec.LLM` for ``--model`` with the model options (``--dtype``,
    ``--device``, ``--draft-dtype``, ``--draft-device``, ``--backend``, ``--exact``);
    ``kwargs`` go to ``LLM``."""
    from specdec.llm import LLM

    return LLM(
        args.model,
        speculative=speculative,
        dtype=args.dtype,
        device=args.device,
        draft_dtype=args.draft_dtype,
        draft_device=args.draft_device,
        backend=args.backend,
        exact=args.exact,
        quantization=args.quantization,
        **kwargs,
    )


def check_model_args(args: argparse.Namespace) -> None:
    """Check ``--model`` and ``--draft-model`` (paths, folders, embedded packages) and
    ``--draft-device`` without loading anything, so a mistake is refused before the
    expensive part.

    Raises:
        FileNotFoundError, ValueError: the message names the path and what was expected.
    """
    check_source(args.model, "--model")
    if getattr(args, "draft_model", None):
        check_source(args.draft_model, "--draft-model")
    if getattr(args, "draft_device", None):
        if not getattr(args, "draft_model", None):
            raise ValueError("--draft-device places --draft-model: give --draft-model too")
        parse_device(args.draft_device, "--draft-device")


@dataclass(frozen=True)
class ThreadChoice:
    """The CPU threads PyTorch runs on, and why.

    Attributes:
        num_threads: threads set (``torch.get_num_threads()`` after the choice).
        cores: cores this process may run on.
        load: cores other processes kept busy when the choice was made
            (:func:`machine_load`).
        reason: ``"--threads"``, ``"OMP_NUM_THREADS"``, ``"idle"`` or ``"busy"``.
    """

    num_threads: int
    cores: int
    load: float
    reason: str


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_load() -> float:
    """:func:`busy_cores` (the seam tests replace to read an idle or a busy machine)."""
    return busy_cores()


def choose_threads(args: argparse.Namespace, adapt: bool = True) -> ThreadChoice:
    """Set PyTorch's thread count: ``--threads``, else ``OMP_NUM_THREADS`` (PyTorch read it
    already), else (with ``adapt``) :func:`threads_for` the cores and the busy ones, with
    a line on standard error when the machine is busy. ``adapt=False`` (a long-running
    server, which a passing load at its start should not pin to fewer threads) keeps every
    core.

    Raises:
        ValueError: ``--threads`` below 1.
    """
    import torch

    from specdec import machine

    machine.load_checked = True  # what LLM would warn about, this says itself
    cores = machine_cores()
    requested = getattr(args, "threads", None)
    load = 0.0 if requested is not None or os.environ.get("OMP_NUM_THREADS") else machine_load()
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be >= 1, got {requested}")
        reason = "--threads"
        if cores and requested > cores:
            # more threads than logical CPUs only wait for each other (--threads 1000 ran
            # 1000 OpenMP threads on 2 cores: the machine stalled for minutes)
            print(
                f"specdec: warning: --threads {requested} is more than this machine's {cores} "
                f"cores, where the threads would wait for each other: running on {cores}",
                file=sys.stderr,
            )
            requested = cores
        torch.set_num_threads(requested)
    elif os.environ.get("OMP_NUM_THREADS"):
        reason = "OMP_NUM_THREADS"
    else:
        usual = torch.get_num_threads()
        fewer = threads_for(usual, cores, load)
        threads = fewer if adapt else usual
        reason = "busy" if threads < usual else "idle"
        torch.set_num_threads(threads)
        if fewer < usual and not adapt:
            print(
                f"specdec: warning: other processes keep this machine busy ({load:.1f} of "
                f"{cores} cores busy) and {usual} threads wait for each other there; "
                f"if it is slow, restart with --threads {fewer}",
                file=sys.stderr,
            )
        if reason == "busy":
            print(
                f"specdec: other processes keep this machine busy ({load:.1f} of {cores} cores "
                f"busy): running on {threads} thread(s) so timings stay meaningful; the "
                f"kernels chosen for {threads} may give other greedy text than {usual} threads "
                f"(each equal to its own plain decoding): --threads {usual} for the idle "
                "machine's text",
                file=sys.stderr,
            )
    return ThreadChoice(torch.get_num_threads(), cores, load, reason)


#: Below this share of its threads' time on a CPU, a run was starved by other processes.
MIN_CPU_SHARE = 0.75


class CpuMeter:
    """The share of wall time this process's threads ran on a CPU since :meth:`start`:
    process CPU seconds / (wall seconds x threads). Near 1 while PyTorch computes on an idle
    machine (its threads spin while they wait), well below 1 when other processes take
    their cores."""

    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self.start()

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), _cpu_seconds()

    def share(self) -> float:
        wall = time.perf_counter() - self._wall
        if wall <= 0:
            return 1.0
        return (_cpu_seconds() - self._cpu) / (wall * self.num_threads)


def warn_if_busy(share: float, num_threads: int, what: str = "the speedup above") -> bool:
    """After a timed comparison: warn on standard error when other processes took this
    run's cores, as the ratio printed is then unreliable.

    Args:
        share: :meth:`CpuMeter.share` over the timed runs.
        num_threads: the threads they ran on.

    Returns:
        whether it warned (``share`` < :data:`MIN_CPU_SHARE`).
    """
    if share >= MIN_CPU_SHARE:
        return False
    print(
        f"specdec: warning: this run's {num_threads} thread(s) had a CPU only "
        f"{share:.0%} of the time (other processes were busy), so {what} is "
        "unreliable; rerun on an idle machine",
        file=sys.stderr,
    )
    return True


#: How :func:`describe_target` names the native kernels' instruction set.
_SIMD_NOTE = {
    "avx512": " (AVX-512 kernels)",
    "avx2": " (AVX2 kernels)",
    "portable": " (portable kernels: no AVX2 here, slow)",
}


def target_meta(target, threads: int) -> dict:
    """What runs a target, as ``generate --json`` records it: ``backend``, ``dtype``,
    ``exact``, ``quantization``, ``quant_kernel`` (the quantized product kernel(s) of a
    native target: ``fma``, ``amx``, or both names for a mix; ``None`` on dense weights),
    ``dense_kernel`` (the formulation(s) the native target's dense products run in its
    mode, one decoding row: ``dpbf16``, ``f32_tiles``, ``onednn``, ...; ``None`` without
    dense products or on transformers), ``simd`` (the C++ kernels' instruction set on the
    native backend: ``avx512``, ``avx2``, ``portable``; ``None`` on transformers or without
    the kernels), ``prefill_plan`` (where a native target's prompt chunks change
    arithmetic, :class:`~specdec.runtime.prefill.PrefillPlan`'s fields without its timings:
    measured per machine, it can differ between two runs on a busy machine, and so can the
    greedy text; ``None`` on transformers) and ``threads``."""
    decoder = getattr(target, "decoder", None)
    simd = None
    if decoder is not None:
        from specdec.runtime.kernels import simd as kernels_simd

        simd = kernels_simd()
    kernels = getattr(decoder, "quant_kernels", None) or {}
    exact = bool(getattr(target, "exact", False))
    choices = (getattr(decoder, "choices", None) or {}).values()
    dense = sorted({c.exact if exact else c.fast[0] for c in choices})
    return {
        "backend": target.backend,
        "dtype": str(target.dtype).replace("torch.", ""),
        "exact": exact,
        "quantization": getattr(target, "quantization", "none"),
        "quant_kernel": ",".join(sorted(set(kernels.values()))) or None,
        "dense_kernel": ",".join(dense) or None,
        "simd": simd,
        "prefill_plan": _prefill_fields(getattr(decoder, "prefill_plan", None)),
        "threads": threads,
    }


def _prefill_fields(plan) -> dict | None:
    if plan is None:
        return None
    fields = asdict(plan)
    fields.pop("times_ms", None)
    return fields


def describe_target(meta: dict) -> str:
    """One line from :func:`target_meta`'s fields, e.g. ``native backend (AVX2 kernels),
    float32, exact, gguf weights (fma kernel), 2 threads`` (``generate``'s ``ran on`` line,
    ``serve``'s start line)."""
    mode = ", exact" if meta["exact"] else ""
    quant = meta.get("quantization", "none")
    weights = f", {quant} weights" if quant != "none" else ", dense weights"
    if meta.get("quant_kernel"):
        weights += f" ({meta['quant_kernel']} kernel)"
    if meta.get("dense_kernel"):
        products = "dense products" if meta.get("quant_kernel") else "products"
        weights += f" ({meta['dense_kernel']} {products})"
    plural = "s" if meta["threads"] != 1 else ""
    simd = _SIMD_NOTE.get(meta.get("simd"), "")
    return (
        f"{meta['backend']} backend{simd}, {meta['dtype']}{mode}{weights}, "
        f"{meta['threads']} thread{plural}"
    )
