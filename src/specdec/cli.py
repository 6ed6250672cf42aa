"""Command line: ``specdec generate PROMPT [options]``, ``specdec bench``, ``specdec serve``."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from specdec import __version__
from specdec.cli_common import (
    add_drafter_args,
    add_sampling_args,
    llm_from_args,
    sampling_params,
    speculative_config,
)
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.llm import LLM, GenerationOutput
from specdec.models.loading import DEFAULT_MODEL

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


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="specdec: %(message)s")
    _quiet_transformers()
    try:
        return args.func(args)
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
        return 0
    except (ValueError, OSError) as error:
        message = " ".join(str(error).split())  # always one line
        print(f"specdec: error: {message}", file=sys.stderr)
        return 2


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, like every other refusal of the command line."""

    def error(self, message: str):
        self.exit(2, f"specdec: error: {message} (see '{self.prog} --help')\n")


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
    import dataclasses

    for name in names:
        entry = entry_of(name)
        print(f"{name:<12} {entry.summary}")
        for f in dataclasses.fields(entry.options):
            default = f.default
            text = str(default).lower() if isinstance(default, bool) else default
            print(f"{'':<12}   {f.name}={text}")


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _cmd_generate(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)
    speculative = speculative_config(args)
    drafter = speculative.spec
    params = sampling_params(args, stop=tuple(args.stop))
    llm = llm_from_args(args, speculative)
    width = speculative.tree.num_nodes if speculative.tree else speculative.num_speculative_tokens
    # Warm up the shapes a step can use: never more draft tokens than could be generated.
    width = min(width, params.max_new_tokens - 1, llm.target.max_context - 1)
    llm.target.warmup((1, width + 1) if width > 0 else (1,))
    if args.json:
        output = llm.generate(prompt, params, chat=args.chat)
    else:
        if args.demo_prompt:
            tree = f", tree {speculative.tree}" if speculative.tree else ""
            print(f"prompt:\n{DEMO_PROMPT}\n\nspeculative output ({drafter}{tree}):")
        output = _print_stream(llm, prompt, params, args.chat)
    baseline = None
    if args.compare:
        baseline = llm.generate(
            prompt, params, chat=args.chat, speculative=SpeculativeConfig(method="none")
        )
    if args.json:
        record = _json_record(output, baseline)
        record["tree"] = str(speculative.tree) if speculative.tree else None
        record["backend"] = llm.target.backend
        record["dtype"] = str(llm.target.dtype).replace("torch.", "")
        record["exact"] = bool(getattr(llm.target, "exact", False))
        print(json.dumps(record))
    else:
        _print_metrics(output, baseline, params, speculative.tree)
    return 0


def _read_prompt(args: argparse.Namespace) -> str:
    if args.demo_prompt:
        if args.prompt is not None:
            raise ValueError("give either PROMPT or --demo-prompt, not both")
        return DEMO_PROMPT
    if args.prompt is None:
        raise ValueError("give a PROMPT (or '-' to read standard input, or --demo-prompt)")
    return sys.stdin.read() if args.prompt == "-" else args.prompt


def _print_stream(llm: LLM, prompt: str, params: SamplingParams, chat) -> GenerationOutput:
    output = None
    for chunk in llm.stream(prompt, params, chat=chat):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        output = chunk.output or output
    sys.stdout.write("\n")
    return output


def _json_record(output: GenerationOutput, baseline: GenerationOutput | None) -> dict:
    record = output.to_dict()
    if baseline is not None:
        record["baseline"] = {
            "text": baseline.text,
            "token_ids": baseline.token_ids,
            "elapsed_s": baseline.metrics.elapsed_s,
            "tokens_per_s": baseline.metrics.tokens_per_s,
        }
        record["speedup"] = _speedup(output, baseline)
        record["identical"] = output.token_ids == baseline.token_ids
    return record


def _speedup(output: GenerationOutput, baseline: GenerationOutput) -> float:
    """Speculative tokens/s over baseline tokens/s, measured in this run.

    Equal to the ratio of wall times when both produced the same tokens (greedy); with
    sampling the two outputs differ in length, so throughput is what compares.
    """
    base = baseline.metrics.tokens_per_s
    return output.metrics.tokens_per_s / base if base else 0.0


def _print_metrics(output: GenerationOutput, baseline, params: SamplingParams, tree=None) -> None:
    m = output.metrics
    per_position = ", ".join(f"{r:.2f}" for r in m.per_position_acceptance_rate) or "-"
    print("-" * 60)
    print(f"finish reason            {output.finish_reason}")
    print(f"tokens / steps           {m.num_output_tokens} / {m.num_steps}")
    print(f"mean acceptance length   {m.mean_acceptance_length:.2f} tokens/step")
    rate = f"{m.acceptance_rate:.1%}" if m.num_draft_tokens else "n/a"
    print(f"acceptance rate          {rate} ({m.num_accepted_tokens}/{m.num_draft_tokens} drafted)")
    label = "per-depth acceptance    " if tree else "per-position acceptance "
    print(f"{label} {per_position}")
    if tree:
        depths = " ".join(f"{d}:{n}" for d, n in enumerate(m.accepted_length_counts))
        nodes = m.num_draft_tokens / max(m.num_steps, 1)
        print(f"tree                     {tree} ({nodes:.1f} nodes/step)")
        print(f"accepted depth histogram {depths} (depth:steps)")
    if m.chosen_k_counts:
        chosen = " ".join(f"{k}:{n}" for k, n in enumerate(m.chosen_k_counts) if n)
        print(f"speculation off          {m.num_steps_off} of {sum(m.chosen_k_counts)} steps")
        print(f"chosen k histogram       {chosen} (k:steps)")
    print(f"time                     {m.elapsed_s:.2f} s ({m.tokens_per_s:.1f} tokens/s)")
    if baseline is None:
        return
    b = baseline.metrics
    identical = output.token_ids == baseline.token_ids
    print(f"autoregressive baseline  {b.elapsed_s:.2f} s ({b.tokens_per_s:.1f} tokens/s)")
    print(f"speedup                  {_speedup(output, baseline):.2f}x")
    if params.greedy:
        print(f"identical to baseline    {'yes' if identical else 'NO'}")
    elif identical:
        print("identical to baseline    yes")
    else:
        print(
            "identical to baseline    no (expected with sampling: the random draws differ; "
            "the distribution is the same)"
        )


if __name__ == "__main__":
    sys.exit(main())
