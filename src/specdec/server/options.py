"""``specdec serve``'s options: defined and checked in one place, for the command
(:mod:`specdec.server.cli`) and for its replicas on Ray Serve
(:mod:`specdec.integrations.ray`)."""

from __future__ import annotations

import argparse
import os

from specdec.cli_common import (
    add_device_args,
    add_drafter_args,
    add_quantization_arg,
    add_threads_arg,
    check_model_args,
    serve_quantization_default,
    speculative_config,
)
from specdec.models.loading import (
    BACKENDS,
    DEFAULT_BACKEND,
    DEFAULT_DTYPE,
    DEFAULT_MODEL,
    check_backend,
    check_dtype,
    check_quantization,
)
from specdec.tools import TOOL_CALL_PARSERS


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Add every ``specdec serve`` option to ``p``."""
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"target (default: {DEFAULT_MODEL})")
    p.add_argument("--served-model-name", help="the id clients send as 'model' (default: --model)")
    add_drafter_args(p)
    p.add_argument(
        "--dtype", default=DEFAULT_DTYPE,
        help="auto (default: bfloat16 where this machine runs it faster, else float32), "
        "float32, bfloat16, float16, or int8-dynamic (runs on transformers)",
    )  # fmt: skip
    p.add_argument("--draft-dtype", default=None, help="dtype of --draft-model (default: --dtype)")
    add_device_args(p)
    p.add_argument(
        "--backend",
        default=DEFAULT_BACKEND,
        choices=BACKENDS,
        help="auto (default: the native runtime, which batches, when it supports the model), "
        "native or hf",
    )
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True,
                   help="native backend: batch-invariant forwards (default: on)")  # fmt: skip
    quantization = serve_quantization_default()
    add_quantization_arg(p, quantization, why=(
        " on this CPU with AMX: a batch of many sequences runs faster on dense weights, "
        "whose products use its matrix units" if quantization == "none" else
        " on this CPU without AMX; none on CPUs with AMX, whose matrix units run a batch "
        "of many sequences faster on dense weights"
    ))  # fmt: skip
    add_threads_arg(p, adapt=False)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument(
        "--max-num-seqs", type=int, default=64, help="sequences decoding at once (default: 64)"
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=4096,
        help="tokens per forward, draft tokens included (default: 4096)",
    )  # fmt: skip
    p.add_argument(
        "--max-kv-tokens", type=int, default=1 << 16,
        help="KV cache slots over all sequences (default: 65536); a sequence of 2,048 "
        "tokens or more also keeps its blocks packed for the attention kernel (bfloat16 with "
        "AVX512-BF16), twice its slots' bytes: SPECDEC_PACKED_KV=off turns that off",
    )  # fmt: skip
    p.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
        help="reuse the KV of full prompt chunks across requests whose prompts begin alike "
        "(a system prompt, a document asked about again): their first token comes sooner, "
        "with the output of a cold run in the same chunks (native backend; vLLM's flag; "
        "default: off). Prompts then run in chunks of 256 tokens, the cache's block",
    )  # fmt: skip
    p.add_argument(
        "--prefix-cache-gib", type=float, default=None, metavar="GIB",
        help="with --enable-prefix-caching: most GiB of KV it keeps, least recently used "
        "blocks dropped first (default: 1)",
    )  # fmt: skip
    p.add_argument(
        "--invariant-prefill", action=argparse.BooleanOptionalAction, default=False,
        help="compute prompts with decoding's batch-invariant arithmetic: a token's KV is "
        "then the same whatever computed it, so outputs no longer depend on --prefill-chunk, "
        "and with --enable-prefix-caching the cache shares blocks of 16 tokens, answers "
        "included (a conversation's next turn reuses the previous answer); prompts cost "
        "1.3-1.5x to compute (native backend, exact mode; default: off)",
    )  # fmt: skip
    p.add_argument(
        "--prefill-chunk", type=int, default=None, metavar="TOKENS",
        help="prompt tokens per prefill forward (default: 2048; 256 with "
        "--enable-prefix-caching, whose block it then is). Outputs depend on it bit for bit, "
        "unless --invariant-prefill",
    )  # fmt: skip
    p.add_argument(
        "--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
        help="seconds between lines of load on standard output while requests run: prompt "
        "and generation tokens/s, running and waiting requests, KV cache use, mean "
        "acceptance length (default: 10)",
    )  # fmt: skip
    p.add_argument(
        "--disable-log-stats", action="store_true",
        help="no periodic lines of load (vLLM's flag)",
    )  # fmt: skip
    p.add_argument(
        "--max-model-len", type=int, default=None, metavar="TOKENS",
        help="longest sequence (prompt + output) a request may reach, at most the model's "
        "own (vLLM's flag; default: the model's): longer prompts get HTTP 400",
    )  # fmt: skip
    p.add_argument(
        "--api-key", default=None,
        help="requests to /v1/* must send 'Authorization: Bearer KEY', else HTTP 401 "
        "(vLLM's flag; default: $SPECDEC_API_KEY, else no key); /health, /metrics open",
    )  # fmt: skip
    p.add_argument(
        "--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
        help="read tool calls out of the model's text in this format: makes tool_choice "
        '"auto" work (vLLM\'s flag; default: none, "auto" with tools is a 400)',
    )  # fmt: skip
    p.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="vLLM's flag, accepted: tool_choice auto is on whenever --tool-call-parser is given",
    )  # fmt: skip
    p.add_argument(
        "--max-waiting", type=int, default=256,
        help="queued sequences (a prompt's n choices count apart) beyond which new requests "
        "get HTTP 429; a request needing more alone gets 400 (default: 256)",
    )  # fmt: skip
    p.add_argument(
        "--replicas", type=int, default=1,
        help="servers behind one endpoint, on Ray Serve (needs pip install 'specdec[ray]'; "
        "RAY_ADDRESS joins a cluster; default: 1, no Ray)",
    )  # fmt: skip
    p.add_argument(
        "--cpus-per-replica", type=int, default=1,
        help="with --replicas: CPUs Ray reserves per replica, its threads (default: 1)",
    )  # fmt: skip


def apply_max_model_len(llm, max_model_len: int | None) -> None:
    """Lower the longest sequence the server admits to ``max_model_len`` (``--max-model-len``;
    ``None``: the model's own). Prompts reaching it are refused (HTTP 400), outputs stop at it.

    Raises:
        ValueError: more than the model's own limit.
    """
    if max_model_len is None:
        return
    own = llm.target.max_context
    if max_model_len > own:
        raise ValueError(
            f"--max-model-len {max_model_len} is more than {llm.target.name}'s own limit of "
            f"{own} tokens"
        )
    llm.target.max_context = max_model_len


def check_serve_args(args: argparse.Namespace):
    """Every option checked before anything loads: the speculative settings and the
    engine's limits.

    Raises:
        ValueError: the message names the option.
    """
    from specdec.engine import EngineConfig

    check_dtype(args.dtype)
    check_backend(args.backend, args.dtype)
    if getattr(args, "api_key", None) is None:
        args.api_key = os.environ.get("SPECDEC_API_KEY") or None
    max_len = getattr(args, "max_model_len", None)
    if max_len is not None and max_len < 2:
        raise ValueError(f"--max-model-len must be >= 2 (a prompt and an output), got {max_len}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty: give a key, or leave the option out")
    check_quantization(args.quantization, args.backend)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if not args.log_stats_interval > 0 or args.log_stats_interval == float("inf"):
        raise ValueError(
            f"--log-stats-interval must be a number of seconds > 0, got {args.log_stats_interval}"
        )
    if args.enable_prefix_caching and args.backend == "hf":
        raise ValueError(
            "--enable-prefix-caching needs the native backend (--backend native or auto): "
            "its blocks are exact only where prompt chunks are computed the same way every time"
        )
    gib = args.prefix_cache_gib
    if gib is not None and not args.enable_prefix_caching:
        raise ValueError("--prefix-cache-gib sets the prefix cache: add --enable-prefix-caching")
    if gib is not None and not 0 < gib < float("inf"):
        raise ValueError(f"--prefix-cache-gib must be a number > 0, got {gib}")
    if args.invariant_prefill and args.backend == "hf":
        raise ValueError("--invariant-prefill needs the native backend (--backend native or auto)")
    if args.invariant_prefill and getattr(args, "exact", True) is False:
        raise ValueError("--invariant-prefill needs exact mode: drop --no-exact")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(
        args, "tool_call_parser", None
    ):
        raise ValueError(
            f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}): "
            "the format the model writes its tool calls in"
        )
    if args.max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    if getattr(args, "replicas", 1) < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if getattr(args, "cpus_per_replica", 1) < 1:
        raise ValueError(f"--cpus-per-replica must be >= 1, got {args.cpus_per_replica}")
    if getattr(args, "cpus_per_replica", 1) != 1 and getattr(args, "replicas", 1) == 1:
        raise ValueError(
            "--cpus-per-replica applies to Ray Serve replicas: add --replicas N (N >= 2), "
            "or use --threads for one server"
        )
    speculative = speculative_config(args)
    check_model_args(args)
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_kv_tokens=args.max_kv_tokens,
        prefill_chunk=args.prefill_chunk,
        invariant_prefill=args.invariant_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_cache_bytes=int((1.0 if gib is None else gib) * (1 << 30)),
    )
    return speculative, config
