"""``specdec train-head``: train an EAGLE, Medusa or parallel (block) drafting head for a
target on this machine.

One command does every stage of :mod:`specdec.training.pipeline` into ``--out``; run it
again to continue an interrupted run. Its defaults are those of the head shipped for the
embedded model.
"""

from __future__ import annotations

import argparse
import math

from specdec.models.loading import DEFAULT_MODEL


def add_parser(sub) -> None:
    """Add ``train-head`` to the CLI's subcommands."""
    from specdec.training.pipeline import HeadRecipe
    from specdec.training.train import TrainConfig

    recipe, tc = HeadRecipe(), TrainConfig()
    p = sub.add_parser(
        "train-head",
        help="train an EAGLE, Medusa, Hydra or parallel draft head for a target (CPU is enough)",
        description="Train a draft head against a target: prompts from offline corpora and "
        "from the target itself (Magpie), the target's own greedy answers, its hidden "
        "states, then the head (EAGLE-3 with training-time test, Medusa, Hydra, or a "
        "parallel head proposing a block of tokens per forward, PARD/DFlash-style). Every "
        "stage is kept under OUT/work and resumed by running the same command again "
        "(other training settings in the same work folder train afresh). Writes "
        "OUT/config.json and OUT/head.safetensors (use with --drafter KIND:head=OUT), "
        "OUT/report.json and OUT/training.png. Needs: pip install chitchat-dataset "
        "chatterbot-corpus (make train-setup).",
    )
    p.add_argument(
        "--kind",
        choices=("eagle", "medusa", "parallel", "hydra"),
        default="eagle",
        help="head type (default: eagle)",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the target (default: {DEFAULT_MODEL})")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the head to")
    p.add_argument(
        "--backend", choices=("native", "hf"), default="native",
        help="runs the target (default: native)",
    )  # fmt: skip
    p.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float32"),
        help="the target's dtype for answers and features (default: bfloat16)",
    )  # fmt: skip
    from specdec.cli_common import add_quantization_arg

    add_quantization_arg(p)
    p.add_argument(
        "--num-prompts", type=int, default=recipe.num_prompts, metavar="N",
        help=f"prompts the target answers (default: {recipe.num_prompts})",
    )  # fmt: skip
    p.add_argument(
        "--magpie-share", type=float, default=recipe.magpie_share, metavar="F",
        help="share of the prompts the target writes itself, Magpie-style (default: "
        f"{recipe.magpie_share})",
    )  # fmt: skip
    p.add_argument(
        "--max-new-tokens", type=int, default=recipe.max_new_tokens, metavar="N",
        help=f"longest answer (default: {recipe.max_new_tokens})",
    )  # fmt: skip
    p.add_argument(
        "--steps", type=int, default=tc.steps, metavar="N",
        help=f"optimizer steps (default: {tc.steps})",
    )  # fmt: skip
    p.add_argument(
        "--max-minutes", type=float, default=tc.max_minutes, metavar="M",
        help="stop training after M minutes (default: 0, no limit); the report says so",
    )  # fmt: skip
    p.add_argument("--lr", type=float, default=tc.lr, help=f"peak learning rate (default: {tc.lr})")
    p.add_argument(
        "--batch-tokens", type=int, default=tc.batch_tokens, metavar="N",
        help=f"padded tokens per optimizer step (default: {tc.batch_tokens})",
    )  # fmt: skip
    p.add_argument(
        "--ttt-steps", type=int, default=tc.ttt_steps, metavar="N",
        help=f"EAGLE training-time-test depth (default: {tc.ttt_steps})",
    )  # fmt: skip
    p.add_argument(
        "--distill-top-k", type=int, default=tc.distill_top_k, metavar="K",
        help="HASS's harmonized objective distillation: also learn the target's K most "
        "probable tokens per row, weighted by their probabilities (HASS used 10; default: "
        f"{tc.distill_top_k}, off: the greedy token only)",
    )  # fmt: skip
    p.add_argument(
        "--distill-weight", type=float, default=None, metavar="W",
        help=f"weight of the distillation term (with --distill-top-k; default: "
        f"{tc.distill_weight})",
    )  # fmt: skip
    p.add_argument(
        "--medusa-heads", type=int, default=recipe.medusa_heads, metavar="K",
        help=f"Medusa or Hydra heads (default: {recipe.medusa_heads})",
    )  # fmt: skip
    p.add_argument(
        "--block-size", type=int, default=recipe.block_size, metavar="K",
        help=f"draft tokens a parallel head proposes per forward (default: {recipe.block_size})",
    )  # fmt: skip
    p.add_argument(
        "--init-from", default=None, metavar="DIR",
        help="start from a head trained for the same target (its matching weights and draft "
        "vocabulary; e.g. an EAGLE head for a parallel one)",
    )  # fmt: skip
    p.add_argument(
        "--layers",
        default=None,
        metavar="I,J,K",
        help="hidden-state indices the head reads (default: EAGLE-3's low, middle and high "
        "layers; Medusa and Hydra: the last, and only one)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="draft vocabulary size (default: the smallest of "
        f"{', '.join(str(v) for v in recipe.vocab_sizes)} covering "
        f"{recipe.coverage * 100:.0f}%% of the answer tokens)",
    )
    p.add_argument(
        "--spec-bench", default=None, metavar="PATH",
        help="Spec-Bench's question.jsonl, which the contamination check keeps out of the "
        "training data (default: $SPECDEC_SPEC_BENCH, else shared/data/spec_bench/"
        "question.jsonl beside the checkout); checked before anything runs",
    )  # fmt: skip
    p.add_argument(
        "--work", default=None, metavar="DIR",
        help="folder for data, features and checkpoints (default: OUT/work); give heads of "
        "both kinds the same one to build the data once",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=recipe.seed, help="seed of every random choice")
    from specdec.cli_common import add_threads_arg

    add_threads_arg(p, adapt=False)
    p.set_defaults(func=_cmd_train)


def _positive(name: str, value, allow_zero: bool = False) -> None:
    bound = ">= 0" if allow_zero else "> 0"
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number {bound}, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {bound}, got {value}")


def recipe_from_args(args: argparse.Namespace):
    """The :class:`HeadRecipe` of the command line (checked before any model loads).

    Raises:
        ValueError: a count below 1, a negative time, or malformed ``--layers``.
    """
    from specdec.training.pipeline import HeadRecipe
    from specdec.training.train import TrainConfig

    for name in ("num_prompts", "max_new_tokens", "steps", "batch_tokens", "ttt_steps",
                 "medusa_heads"):  # fmt: skip
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    if not 2 <= args.block_size <= 16:
        raise ValueError(f"--block-size must be in [2, 16], got {args.block_size}")
    if args.init_from is not None:
        from specdec.heads.format import read_config

        read_config(args.init_from)  # a bad folder fails before the model loads
    if args.draft_vocab is not None:
        _positive("--draft-vocab", args.draft_vocab)
    _positive("--max-minutes", args.max_minutes, allow_zero=True)
    from specdec.models.loading import check_quantization

    check_quantization(args.quantization, args.backend)
    _positive("--lr", args.lr)
    _positive("--distill-top-k", args.distill_top_k, allow_zero=True)
    distill_weight = TrainConfig.distill_weight
    if args.distill_weight is not None:
        if not (math.isfinite(args.distill_weight) and args.distill_weight >= 0):
            raise ValueError(
                f"--distill-weight must be a finite number >= 0, got {args.distill_weight}"
            )
        if not args.distill_top_k:
            raise ValueError("--distill-weight has no effect without --distill-top-k K")
        distill_weight = args.distill_weight
    if not 0 <= args.seed < 2**32:  # numpy's range (the data stage seeds it)
        raise ValueError(f"--seed must be in [0, 2**32), got {args.seed}")
    if not 0.0 <= args.magpie_share <= 1.0:
        raise ValueError(f"--magpie-share must be in [0, 1], got {args.magpie_share}")
    capture = None
    if args.layers:
        try:
            capture = [int(x) for x in args.layers.split(",")]
        except ValueError:
            raise ValueError(
                f"--layers must be integers like 2,15,27, got {args.layers!r}"
            ) from None
        from specdec.heads.modules import SINGLE_STATE_KINDS

        if args.kind in SINGLE_STATE_KINDS and len(capture) != 1:
            raise ValueError(
                f"a {args.kind} head reads one hidden state; --layers {args.layers} names "
                f"{len(capture)}"
            )
    train = TrainConfig(
        steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr, ttt_steps=args.ttt_steps,
        max_minutes=args.max_minutes, seed=args.seed, warmup=min(100, max(1, args.steps // 10)),
        distill_top_k=args.distill_top_k, distill_weight=distill_weight,
    )  # fmt: skip
    recipe = HeadRecipe(
        kind=args.kind, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        magpie_share=args.magpie_share, capture=capture, medusa_heads=args.medusa_heads,
        block_size=args.block_size, init_from=args.init_from, seed=args.seed, train=train,
    )  # fmt: skip
    if args.draft_vocab is not None:
        recipe.vocab_sizes = (args.draft_vocab,)
    return recipe


def _cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdec.cli_common import choose_threads

    recipe = recipe_from_args(args)
    if not args.out.strip():
        raise ValueError("--out is empty; give a folder to write the head to")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder")
    if not out.parent.is_dir():
        raise ValueError(f"cannot write {out}: folder {out.parent} does not exist")
    from specdec.training.data import _package_dir

    for package in ("chitchat_dataset", "chatterbot_corpus"):
        _package_dir(package)  # a missing corpus fails before the model loads
    from specdec.training.contamination import benchmark_items

    try:  # the contamination check's test sets, needed after the answers stage
        benchmark_items(args.spec_bench)
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"{str(error).split(';')[0]}; train-head keeps Spec-Bench's questions out of its "
            "training data, so it needs them: get question.jsonl from Spec-Bench "
            "(data/spec_bench/question.jsonl) and pass --spec-bench PATH or set "
            "SPECDEC_SPEC_BENCH"
        ) from None
    recipe.spec_bench = args.spec_bench
    choose_threads(args, adapt=False)
    from specdec import LLM
    from specdec.models import load
    from specdec.training.pipeline import train_head

    # the target users run by default (the embedded GGUF: its own Q4_1 blocks), so the
    # head learns that model's hidden states and greedy tokens
    target = load(args.model, args.dtype, "cpu", args.backend, quantization=args.quantization)
    if recipe.capture is not None:
        from specdec.models.base import check_capture

        check_capture(recipe.capture, target.num_layers)
    if args.draft_vocab is not None and args.draft_vocab > target.vocab_size:
        raise ValueError(
            f"--draft-vocab {args.draft_vocab} exceeds the target's vocabulary "
            f"({target.vocab_size} tokens)"
        )
    if recipe.train.distill_top_k > target.vocab_size:
        raise ValueError(
            f"--distill-top-k {recipe.train.distill_top_k} exceeds the target's vocabulary "
            f"({target.vocab_size} tokens)"
        )
    llm = LLM(target)
    report = train_head(target, llm, out, recipe, args.work)
    held = report["held_out"]
    rates = ", ".join(f"{a:.2f}" for a in held["acceptance"])
    print(
        f"wrote {out}: {report['kind']} head, {report['vocabulary']['size']}-token draft "
        f"vocabulary ({report['vocabulary']['coverage']:.1%} coverage); held-out "
        f"acceptance per position {rates} (tau {held['tau']:.2f}); "
        f"{report['wall_s'] / 60:.1f} min. Use it: specdec generate --backend native "
        f"--drafter {report['kind']}:head={out}"
    )
    return 0
