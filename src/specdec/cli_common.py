"""Command-line options shared by ``specdec generate`` and ``specdec bench``."""

from __future__ import annotations

import argparse

from specdec import registry
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.models.loading import BACKENDS, DEFAULT_BACKEND, check_backend, check_dtype


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
        default=5,
        metavar="K",
        help="draft tokens per verification step (default: 5)",
    )
    parser.add_argument(
        "--tree",
        metavar="SPEC",
        help="verify a token tree per step instead of a chain: "
        "static:<tree-8|tree-16|tree-32|chain-K|paths.json>[,draw=top|iid|wor], "
        "dynamic:top_k=4,depth=5,budget=16 (EAGLE-2), best-first:budget=16,depth=6 "
        "(DDTree), sequoia:budget=16,depth=6 (Sequoia); budget = draft nodes per step",
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


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    """:class:`SpeculativeConfig` from the options of :func:`add_drafter_args`.

    Raises:
        ValueError: ``--draft-model`` with another drafter, or an invalid setting.
    """
    drafter = args.drafter or ("draft-model" if args.draft_model else "ngram")
    name = registry.parse_spec(drafter)[0]
    if args.draft_model and not registry.drafter_entry(name).needs_draft_model:
        raise ValueError(f"--draft-model is only used with --drafter draft-model, not {name}")
    return SpeculativeConfig(
        method=drafter,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_model=args.draft_model,
        tree=args.tree,
        controller=args.controller,
    )


def add_sampling_args(parser: argparse.ArgumentParser, max_new_tokens: int, seed) -> None:
    """``--max-new-tokens --temperature --top-p --top-k --seed --dtype --device --backend
    --exact``."""
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
    parser.add_argument("--seed", type=int, default=seed, help=f"sampling seed (default: {seed})")
    parser.add_argument(
        "--dtype", default="float32", help="float32 (default), bfloat16, float16, int8-dynamic"
    )
    parser.add_argument(
        "--draft-dtype",
        default=None,
        help="dtype of --draft-model (default: --dtype); int8-dynamic quantizes its "
        "decoder linear layers to int8 (CPU)",
    )
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument(
        "--backend",
        default=DEFAULT_BACKEND,
        choices=BACKENDS,
        help="who runs the model's forward (target and draft): hf (transformers; default), "
        "native (specdec's runtime: Llama, Mistral, Qwen2, Qwen3), auto (native when "
        "supported); an int8-dynamic draft always runs on transformers",
    )
    parser.add_argument(
        "--exact",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="native backend: batch-invariant forwards, so greedy speculative output is "
        "bit-identical to plain decoding in any dtype (default: on)",
    )


def sampling_params(args: argparse.Namespace, stop: tuple[str, ...] = ()) -> SamplingParams:
    """:class:`SamplingParams` from the options added by :func:`add_sampling_args`; also
    checks ``--dtype`` and ``--draft-dtype`` (whether or not a draft is used), so every
    such mistake is refused before a model loads.

    Raises:
        ValueError: a bad value (the message names it).
    """
    check_dtype(args.dtype)
    check_backend(args.backend, args.dtype)
    if args.draft_dtype is not None:
        check_dtype(args.draft_dtype)
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        stop=stop,
    )


def llm_from_args(args: argparse.Namespace, speculative: SpeculativeConfig, **kwargs):
    """An :class:`~specdec.LLM` for ``--model`` with the model options (``--dtype``,
    ``--device``, ``--draft-dtype``, ``--backend``, ``--exact``); ``kwargs`` go to ``LLM``."""
    from specdec.llm import LLM

    return LLM(
        args.model,
        speculative=speculative,
        dtype=args.dtype,
        device=args.device,
        draft_dtype=args.draft_dtype,
        backend=args.backend,
        exact=args.exact,
        **kwargs,
    )
