"""Command line: ``specdec generate PROMPT [options]``, ``specdec bench``, ``specdec serve``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time

from specdec import __version__
from specdec.cli_common import (
    MIN_CPU_SHARE,
    CpuMeter,
    add_drafter_args,
    add_sampling_args,
    check_model_args,
    choose_threads,
    describe_target,
    llm_from_args,
    note_unused_options,
    sampling_params,
    speculative_config,
    target_meta,
    warn_if_busy,
)
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.engine.engine import check_prompt_fits
from specdec.interrupt import watched
from specdec.llm import LLM, GenerationOutput
from specdec.metrics import SpecStats
from specdec.models.loading import DEFAULT_MODEL
from specdec.trees.spec import TreeSpecError
from specdec.unicode import check_text, decode_utf8, printable

#: Built-in prompt for ``--demo-prompt``: rewriting a paragraph with a small change, where
#: most of the output is copied from the prompt and prompt lookup shines.
DEMO_PROMPT = (
    "Rewrite the following paragraph, changing only the name of the town from Millbrook "
    "to Ashford. Keep every other word exactly the same.\n\n"
    "Millbrook is a small town in the hills, known for its old stone bridge and its weekly "
    "farmers' market. Every Saturday morning, people from the nearby villages come to "
    "Millbrook to buy fresh bread, honey, cheese and vegetables. The town library, built "
    "more than a hundred years ago, still opens its doors every day, and the children of "
    "Millbrook spend their afternoons reading there after school. In the autumn, the hills "
    "around the town turn red and gold, and visitors walk along the river to see the "
    "leaves fall into the water."
)


#: Exit status after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 refused, 130 interrupted)."""
    _printable_output()
    _plugin_warnings_as_lines()
    parser, code = watched(_build_parser)  # the subcommands' parsers import their libraries
    if code is not None:
        return code
    args = None
    try:
        args = parser.parse_args(argv)
        logging.basicConfig(level=logging.WARNING, format="specdec: %(message)s")
        _quiet_transformers()
        if getattr(args, "replicas", 1) > 1:  # specdec serve --replicas N
            return _serve_replicated(args)
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C while loading or outside a generation
        print("\nspecdec: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
        return 0
    except (ValueError, OSError) as error:
        message = printable(" ".join(str(error).split()))  # always one line
        if isinstance(error, TreeSpecError):  # the spec's option names, not flags
            message = "--" + message if message.startswith("tree ") else message
        elif isinstance(error, ValueError) and args is not None:
            message = _as_flags(message, parser, args.command)
        print(f"specdec: error: {message}", file=sys.stderr)
        return 2


def _as_flags(message: str, parser: argparse.ArgumentParser, command: str) -> str:
    """``message`` with the library's field names that are also flags of ``command``
    written as those flags (``num_speculative_tokens must be ...`` -> ``--num-speculative-
    tokens must be ...``): a field name with an underscore anywhere, a one-word name only
    at the start of the message."""
    import re

    flags = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            for option in action.choices[command]._actions:
                for text in option.option_strings:
                    if text == "--" + option.dest.replace("_", "-"):
                        flags[option.dest] = text
    for dest, flag in flags.items():
        if "_" in dest:
            message = re.sub(rf"(?<![\w\-.=]){dest}(?![\w\-=(])", flag, message)
        elif message.startswith(dest + " "):
            message = flag + message[len(dest) :]
    return message


def _serve_replicated(args: argparse.Namespace) -> int:
    """``specdec serve --replicas N`` on Ray Serve, every option checked first."""
    import importlib.util

    from specdec.server.cli import bind
    from specdec.server.options import check_serve_args

    check_serve_args(args)
    if importlib.util.find_spec("ray") is None:
        raise ValueError("--replicas needs Ray Serve: pip install 'specdec[ray]'")
    bind(args.host, args.port).close()  # a busy port fails now, not in Ray's proxy
    from specdec.integrations.ray import serve_replicated

    return serve_replicated(args)


def _plugin_warnings_as_lines() -> None:
    """A skipped drafter plugin is one ``specdec: warning:`` line on standard error (not
    Python's warning format pointing into specdec's own source)."""
    import warnings

    from specdec.registry import PluginWarning

    shown = warnings.showwarning
    if getattr(shown, "specdec_plugin_lines", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, PluginWarning):
            print(f"specdec: warning: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    show.specdec_plugin_lines = True
    warnings.showwarning = show


def _printable_output() -> None:
    """Anything printed that is not encodable (a path given as non-UTF-8 bytes) comes out
    backslash-escaped instead of raising mid-output."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, like every other refusal of the command line."""

    def error(self, message: str):
        see = f"{self.prog} --help"
        # the options of a drafter or controller are listed by their own command
        if message.startswith("argument --drafter"):
            see = "specdec drafters"
        elif message.startswith("argument --controller"):
            see = "specdec controllers"
        hint = "" if f"`{see}`" in message else f" (see '{see}')"  # named once
        self.exit(2, f"specdec: error: {message}{hint}\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="specdec", description="Speculative decoding: faster generation, identical output."
    )
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="generate text for one prompt",
        description="Generate text for one prompt with speculative decoding.",
    )
    gen.add_argument("prompt", nargs="?", help="the prompt ('-' reads standard input)")
    gen.add_argument(
        "--demo-prompt",
        action="store_true",
        help="use the built-in paragraph-rewrite prompt instead of PROMPT",
    )
    gen.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"target: embedded name, .gguf file, HF directory or hub id "
        f"(default: {DEFAULT_MODEL})",
    )
    add_drafter_args(gen)
    add_sampling_args(gen, max_new_tokens=256, seed=None)
    gen.add_argument(
        "--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)"
    )
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the model's chat template (default: when it has one)",
    )
    gen.add_argument(
        "--compare",
        action="store_true",
        help="also run plain autoregressive decoding; report speedup and identity",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.set_defaults(func=_cmd_generate)
    from specdec.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    from specdec.server.cli import add_parser as add_serve_parser

    add_serve_parser(sub)
    from specdec.datastore_cli import add_parser as add_datastore_parser

    add_datastore_parser(sub)
    from specdec.training.cli import add_parser as add_train_parser

    add_train_parser(sub)
    drafters = sub.add_parser(
        "drafters",
        help="list the drafters and their options",
        description="List every registered drafter with its options and their defaults.",
    )
    drafters.set_defaults(func=_cmd_drafters)
    controllers = sub.add_parser(
        "controllers",
        help="list the speculation controllers and their options",
        description="List every registered speculation controller (--controller) with its "
        "options and their defaults.",
    )
    controllers.set_defaults(func=_cmd_controllers)
    return parser


def _cmd_drafters(args: argparse.Namespace) -> int:
    from specdec import registry

    _print_entries(registry.drafter_names(), registry.drafter_entry)
    return 0


def _cmd_controllers(args: argparse.Namespace) -> int:
    from specdec import registry

    _print_entries(registry.controller_names(), registry.controller_entry)
    return 0


def _print_entries(names, entry_of) -> None:
    """Print each entry's summary, then ``name=default  description`` per option."""
    from specdec.registry import option_docs

    for name in names:
        entry = entry_of(name)
        print(f"{name:<12} {entry.summary}")
        docs = option_docs(entry.options)
        settings = [f"{doc.name}={doc.default_text}" for doc in docs]
        width = max(map(len, settings), default=0)
        for setting, doc in zip(settings, docs, strict=True):
            print(f"{'':<12}   {setting:<{width}}  {doc.help}")


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _cmd_generate(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)
    speculative = speculative_config(args)
    params = sampling_params(args, stop=tuple(args.stop))
    check_model_args(args)  # everything checkable is checked before loading
    note_unused_options(args, speculative)
    threads = choose_threads(args)
    llm = llm_from_args(args, speculative)
    prompt_ids = llm.encode(prompt, args.chat)
    check_prompt_fits(llm.target, prompt_ids)  # an over-long prompt: before any forward
    _warm_up(llm, speculative, params, len(prompt_ids))
    meta = {  # what every --json record carries, an interrupted one too
        "model": llm.target.name,
        "drafter": speculative.method,
        "drafter_options": options_record(speculative.options),
        "draft_model": llm.loaded_draft.name if llm.loaded_draft is not None else None,
        "tree": str(speculative.tree) if speculative.tree else None,
        **head_meta(llm.drafter(speculative)),
        **target_meta(llm.target, threads.num_threads),
    }
    run = _Run()
    meter = CpuMeter(threads.num_threads)  # did other processes take our cores while timed?
    try:
        output = _generate(llm, prompt, params, args, speculative, run)
    except KeyboardInterrupt:
        return _interrupted(run, args, meta)
    baseline, interrupted = None, False
    if args.compare:
        try:
            plain = SpeculativeConfig(method="none")
            baseline = llm.generate(prompt, params, chat=args.chat, speculative=plain)
        except KeyboardInterrupt:  # the speculative output is whole: report it
            interrupted = True
    share = meter.share()
    if args.json:
        record = {**_json_record(output, baseline), **meta}
        if baseline is not None:
            record["cpu_share"] = round(share, 3)
            record["busy"] = share < MIN_CPU_SHARE
        if interrupted:
            record["interrupted"] = "baseline"  # the speculative output above is whole
        print(json.dumps(record))
    else:
        busy = baseline is not None and share < MIN_CPU_SHARE
        _print_metrics(output, baseline, params, speculative.tree, meta, busy)
    if baseline is not None:
        warn_if_busy(
            share,
            threads.num_threads,
            "the speedup in the JSON record" if args.json else "the speedup above",
        )
    if interrupted:
        print("specdec: interrupted during the plain-decoding baseline", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _warm_up(
    llm: LLM, speculative: SpeculativeConfig, params: SamplingParams, prompt_rows: int = 0
) -> None:
    """Warm up the shapes a step can use (never more draft tokens than could be
    generated) and the prompt's first chunk (``prompt_rows``: the prompt's length), so
    that neither the speculative run nor the ``--compare`` baseline after it pays a
    first call (without the prompt's: plain decoding measured 0.80x itself in float32)."""
    width = speculative.tree.num_nodes if speculative.tree else speculative.num_speculative_tokens
    width = min(width, params.max_new_tokens - 1, llm.target.max_context - 1)
    llm.target.warmup(sorted({1, min(2, width + 1), width + 1}))
    chunk = min(prompt_rows - 1, llm.engine_config.prefill_chunk, llm.target.max_context - 1)
    if chunk > 0:  # the prompt's first chunk, as a prompt only (warmup also runs it as rows
        llm.target.forward([0] * chunk, llm.target.new_cache(chunk + 1))  # after a token)


class _Run:
    """What a generation produced so far, kept for an interrupted run's report."""

    def __init__(self) -> None:
        self.text, self.ids, self.metrics, self.streamed = [], [], None, False
        self.prompt_ids: list[int] = []  # the prompt as the target sees it, once encoded
        self.started: float | None = None  # perf_counter() when the generation began


def _generate(llm, prompt, params, args, speculative, run: _Run) -> GenerationOutput:
    """The speculative generation, streamed to standard output unless ``--json``."""
    if args.demo_prompt and not args.json:
        tree = f", tree {speculative.tree}" if speculative.tree else ""
        print(f"prompt:\n{DEMO_PROMPT}\n\nspeculative output ({speculative.spec}{tree}):")
    run.streamed = not args.json
    output = None
    run.prompt_ids = llm.encode(prompt, args.chat)
    run.metrics = SpecStats()  # a Ctrl-C before the first token reports an empty run
    run.started = time.perf_counter()
    try:
        for chunk in llm.stream(run.prompt_ids, params, chat=args.chat):
            run.text.append(chunk.text)
            run.ids.extend(chunk.token_ids)
            run.metrics = chunk.metrics.snapshot()  # what these chunks hold, for Ctrl-C
            if run.streamed:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            output = chunk.output or output
    except ValueError:  # e.g. no allowed token: end the streamed line before the error
        if run.streamed and any(run.text):
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    if run.streamed:
        sys.stdout.write("\n")
    return output


def _interrupted(run: _Run, args: argparse.Namespace, meta: dict) -> int:
    """Ctrl-C during generation: a clean line, the metrics so far, exit 130."""
    if run.streamed:
        sys.stdout.write("\n")
    partial = None
    if run.metrics is not None and not run.ids and run.started is not None:
        # nothing came back yet: the time so far went to the prompt's prefill
        run.metrics.elapsed_s = run.metrics.prefill_s = time.perf_counter() - run.started
    if run.metrics is not None:
        partial = GenerationOutput("".join(run.text), run.ids, run.prompt_ids, "abort", run.metrics)
    if partial is not None and args.json:
        print(json.dumps({**partial.to_dict(), **meta, "interrupted": True}))
    elif partial is not None and run.ids:
        _print_metrics(partial, None, SamplingParams())
    sys.stdout.flush()
    print(f"specdec: interrupted after {len(run.ids)} tokens", file=sys.stderr)
    return EXIT_INTERRUPTED


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt: argv text, standard input (``-``, read as UTF-8 bytes, without one final
    line end, so ``echo TEXT | specdec generate -`` is ``specdec generate TEXT``) or the
    demo's.

    Raises:
        ValueError: none or two given, or text (the prompt, a stop string) that is not
            valid UTF-8.
    """
    for i, stop in enumerate(args.stop):
        check_text(stop, f"stop string {i}", from_argv=True)
    if args.demo_prompt:
        if args.prompt is not None:
            raise ValueError("give either PROMPT or --demo-prompt, not both")
        return DEMO_PROMPT
    if args.prompt is None:
        raise ValueError("give a PROMPT (or '-' to read standard input, or --demo-prompt)")
    if args.prompt == "-":
        raw = getattr(sys.stdin, "buffer", None)  # bytes: decoded by our rule, not the locale's
        text = (
            check_text(sys.stdin.read(), "standard input")
            if raw is None
            else decode_utf8(raw.read(), "standard input")
        )
        if text.endswith("\n"):  # the line end `echo` and editors add, as $(cat FILE) drops it
            text = text[:-2] if text.endswith("\r\n") else text[:-1]
    else:
        text = check_text(args.prompt, "the prompt", from_argv=True)
    if not text.strip():
        raise ValueError("prompt is empty" + (" (standard input)" if args.prompt == "-" else ""))
    return text


def options_record(options) -> dict | None:
    """The drafter's options as a JSON-ready dict (e.g. a hybrid's ``model``), or
    ``None`` for a drafter without registered options."""
    if not dataclasses.is_dataclass(options):
        return None
    return json.loads(json.dumps(dataclasses.asdict(options), default=str))


def head_meta(drafter) -> dict:
    """A head drafter's head and the format its weights run in (``head``: its folder,
    ``head_weights``: ``float32`` / ``q8_0`` / ``q4_1``); a quantized self-draft's blocks
    and kernel (``draft_weights``, e.g. ``gguf blocks on the q8 kernel``); for a ``hybrid``,
    its model drafter's (``hybrid_model``: its spec, with those of the model drafter);
    ``{}`` for other drafters."""
    from specdec.drafters.hybrid import HybridDrafter

    if isinstance(drafter, HybridDrafter):
        return {"hybrid_model": drafter.options.model, **head_meta(drafter.model)}
    kernels = getattr(drafter, "kernels", None)
    if kernels is not None and getattr(drafter, "quantization", None):
        blocks = "the target's" if drafter.quantization == "target" else drafter.quantization
        kernel = "/".join(sorted(set(kernels.values())))
        return {"draft_weights": f"{blocks} blocks on the {kernel} kernel"}
    head = getattr(drafter, "head", None)
    if head is None:
        return {}
    quantization = getattr(head, "quantization", "none")
    weights = str(head.dtype).replace("torch.", "") if quantization == "none" else quantization
    return {"head": str(getattr(head, "source", "")), "head_weights": weights}


def _json_record(output: GenerationOutput, baseline: GenerationOutput | None) -> dict:
    record = output.to_dict()
    if baseline is not None:
        record["baseline"] = {
            "text": baseline.text,
            "token_ids": baseline.token_ids,
            "elapsed_s": baseline.metrics.elapsed_s,
            "prefill_s": baseline.metrics.prefill_s,
            "tokens_per_s": baseline.metrics.tokens_per_s,
            "decode_tokens_per_s": baseline.metrics.decode_tokens_per_s,
        }
        record["speedup"] = _speedup(output, baseline)
        record["decode_speedup"] = _speedup(output, baseline, decode=True)
        record["identical"] = output.token_ids == baseline.token_ids
    return record


def _speedup(output: GenerationOutput, baseline: GenerationOutput, decode: bool = False) -> float:
    """Speculative tokens/s over baseline tokens/s, measured in this run (``decode``: after
    the prompt, its prefill left out of both).

    Equal to the ratio of wall times when both produced the same tokens (greedy); with
    sampling the two outputs differ in length, so throughput is what compares.
    """
    rate = "decode_tokens_per_s" if decode else "tokens_per_s"
    base = getattr(baseline.metrics, rate)
    return getattr(output.metrics, rate) / base if base else 0.0


#: From this share of the wall time in the prompt's prefill (either run), ``generate
#: --compare`` also prints the speedup after the prompt.
PREFILL_SHARE = 0.2


#: Below this many generated tokens, ``generate --compare`` says its speedup is timing noise.
NOISY_TOKENS = 32


def _print_metrics(
    output: GenerationOutput, baseline, params: SamplingParams, tree=None, meta=None, busy=False
) -> None:
    """``generate``'s report; ``busy``: other processes took the run's cores (the
    speedup lines then say they are unreliable, beside the figure a reader sees first)."""
    m = output.metrics
    per_position = ", ".join(f"{r:.2f}" for r in m.per_position_acceptance_rate) or "-"
    print("-" * 60)
    if meta:  # what ran: the defaults (backend auto, dtype auto) resolve per machine
        print(f"ran on                   {describe_target(meta)}")
        if meta.get("head"):
            print(f"draft head               {meta['head']} ({meta['head_weights']} weights)")
        if meta.get("draft_weights"):
            print(f"quantized draft          {meta['draft_weights']}")
    if meta and meta.get("hybrid_model"):
        print(f"hybrid model drafter     {meta['hybrid_model']}")
    if m.draft_sources:  # a hybrid's choice per step
        chosen = ", ".join(f"{name} {n}" for name, n in sorted(m.draft_sources.items()))
        note = "steps each drafted; a model may propose nothing"
        print(f"draft sources            {chosen} ({note})")
    print(f"finish reason            {output.finish_reason}")
    if m.lossy:
        print(f"verifier                 {m.verifier}: LOSSY, the output does not follow the "
              "model's distribution")  # fmt: skip
    elif m.verifier not in ("rejection", "greedy"):
        print(f"verifier                 {m.verifier} (lossless)")
    print(f"tokens / steps           {m.num_output_tokens} / {m.num_steps}")
    print(f"mean acceptance length   {m.mean_acceptance_length:.2f} tokens/step")
    rate = f"{m.acceptance_rate:.1%}" if m.num_draft_tokens else "n/a"
    print(f"acceptance rate          {rate} ({m.num_accepted_tokens}/{m.num_draft_tokens} drafted)")
    print(f"steps with a draft       {m.num_drafts} of {m.num_steps}")
    label = "per-depth acceptance    " if tree else "per-position acceptance "
    print(f"{label} {per_position}")
    if tree:
        depths = " ".join(f"{d}:{n}" for d, n in enumerate(m.accepted_length_counts))
        nodes = m.num_draft_tokens / max(m.num_steps, 1)
        print(f"tree                     {tree} ({nodes:.1f} nodes/step)")
        print(f"accepted depth histogram {depths} (depth:steps)")
    if m.chosen_k_counts:
        chosen = " ".join(f"{k}:{n}" for k, n in enumerate(m.chosen_k_counts) if n)
        choices = sum(m.chosen_k_counts)  # the steps that could draft (not the last one)
        if m.num_steps_off:
            print(
                f"speculation off          {m.num_steps_off} of {choices} steps "
                "(the controller chose k = 0)"
            )
        print(
            f"chosen k histogram       {chosen} (k:steps; k is capped by the tokens left, "
            "steps with none left to draft are not counted; a drafter may propose fewer)"
        )
    print(f"time                     {m.elapsed_s:.2f} s ({m.tokens_per_s:.1f} tokens/s)")
    if m.prefill_s > 0:
        prompt = len(getattr(output, "prompt_token_ids", None) or [])
        what = f"{prompt} tokens, " if prompt else ""
        print(f"prompt                   {what}first token after {m.prefill_s:.2f} s")
        print(f"after the prompt         {m.decode_tokens_per_s:.1f} tokens/s")
    if baseline is None:
        return
    b = baseline.metrics
    identical = output.token_ids == baseline.token_ids
    after = f", {b.decode_tokens_per_s:.1f} after the prompt" if b.prefill_s > 0 else ""
    print(f"autoregressive baseline  {b.elapsed_s:.2f} s ({b.tokens_per_s:.1f} tokens/s{after})")
    note = ""
    if min(m.num_output_tokens, b.num_output_tokens) < NOISY_TOKENS:
        counts = (
            f"{m.num_output_tokens} tokens"
            if m.num_output_tokens == b.num_output_tokens
            else f"{m.num_output_tokens} and {b.num_output_tokens} (baseline) tokens"
        )
        note = f" (only {counts}: timing noise)"
    if m.num_draft_tokens == 0 and m.num_output_tokens > 1:
        note += " (nothing was drafted: the difference is timing noise)"
    if busy:
        note += " (UNRELIABLE: the machine was busy, see the warning below)"
    print(f"speedup                  {_speedup(output, baseline):.2f}x{note}")
    share = max(x.prefill_s / x.elapsed_s if x.elapsed_s > 0 else 0.0 for x in (m, b))
    if share >= PREFILL_SHARE:
        print(
            f"speedup after the prompt {_speedup(output, baseline, decode=True):.2f}x "
            f"(the prompt's prefill took {share:.0%} of the time)"
        )
    if params.greedy:
        print(f"identical to baseline    {'yes' if identical else 'NO'}")
        if not identical and meta and not meta.get("exact"):
            print(
                "                         (without exact mode a batched verification can "
                "round differently from a one-token step and flip a near-tie; "
                "`--backend native` keeps greedy output identical in any dtype)"
            )
    elif identical:
        print("identical to baseline    yes")
    else:
        print(
            "identical to baseline    no (expected with sampling: the random draws differ; "
            "the distribution is the same)"
        )


if __name__ == "__main__":
    sys.exit(main())
