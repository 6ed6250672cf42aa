"""``specdec serve``: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import socket
import threading
import time

from specdec.cli_common import (
    choose_threads,
    describe_target,
    llm_from_args,
    note_unused_options,
    target_meta,
)
from specdec.server.options import add_serve_arguments, apply_max_model_len, check_serve_args

logger = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, /reset_prefix_cache) with batched speculative "
        "decoding.",
    )
    add_serve_arguments(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from specdec.engine.engine import check_tree_drafter, prefix_block_size
    from specdec.server.app import create_app

    speculative, config = check_serve_args(args)
    listener = bind(args.host, args.port)  # before the model loads: a busy port fails now
    note_unused_options(args, speculative)
    threads = choose_threads(args, adapt=False)  # --threads or OMP_NUM_THREADS; else all
    llm = llm_from_args(args, speculative, engine_config=config)
    apply_max_model_len(llm, args.max_model_len)
    if speculative.tree is not None:  # refused now, not on every request
        check_tree_drafter(llm.drafter(speculative))
    app = create_app(
        llm, args.served_model_name or args.model, args.max_waiting, engine_thread=False,
        stats_interval=None if args.disable_log_stats else args.log_stats_interval,
        api_key=args.api_key, tool_call_parser=args.tool_call_parser,
    )  # fmt: skip
    ran_on = describe_target(target_meta(llm.target, threads.num_threads))
    if config.enable_prefix_caching:
        ran_on += (
            f", prefix caching on ({config.prefix_cache_bytes / (1 << 30):g} GiB, blocks of "
            f"{prefix_block_size(config)} tokens)"
        )
    if config.invariant_prefill:
        ran_on += ", invariant prefill"
    served = args.served_model_name
    name = f"{args.model} as '{served}'" if served and served != args.model else args.model
    print(f"specdec: serving {name} ({ran_on}) on http://{args.host}:{args.port}/v1", flush=True)
    print(f"specdec: {describe_speculation(speculative)}", flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30)
    server = uvicorn.Server(config)
    # HTTP on a thread, the model on the main thread (see AsyncEngine.run); SIGTERM and
    # SIGINT start uvicorn's graceful shutdown, whose end stops the engine loop.
    http = threading.Thread(
        target=server.run, kwargs={"sockets": [listener]}, name="specdec-http", daemon=True
    )

    def stop(signum, frame):
        server.should_exit = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    http.start()
    while not server.started:
        if not http.is_alive():
            raise OSError(f"could not serve on {args.host}:{args.port}")
        time.sleep(0.05)
    app.state.engine.run()
    http.join(60)
    print("specdec: server stopped", flush=True)
    return 0


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6), handed to uvicorn, so the
    address is taken before the model loads and nobody can take it in between.

    Raises:
        OSError: the address is in use or cannot be bound (the message names it).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise OSError(f"cannot serve on {host}:{port}: unknown host ({error.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        sock.close()
        in_use = error.errno == errno.EADDRINUSE
        reason = "the address is in use (another server?)" if in_use else error.strerror
        raise OSError(f"cannot serve on {host}:{port}: {reason}") from None
    sock.set_inheritable(True)
    return sock


def describe_speculation(speculative) -> str:
    """What a request runs unless it asks otherwise (the line after the start line).

    Example:
        >>> from specdec.config import SpeculativeConfig
        >>> describe_speculation(SpeculativeConfig(method="suffix", controller="cost"))
        'speculation: suffix, up to 5 draft tokens a step, cost controller'
        >>> describe_speculation(SpeculativeConfig(method="none"))
        'speculation: off (plain decoding)'
    """
    if speculative.method == "none":
        return "speculation: off (plain decoding)"
    parts = [speculative.method]
    if speculative.tree is not None:
        parts.append(f"token tree {speculative.tree}")
    else:
        parts.append(f"up to {speculative.num_speculative_tokens} draft tokens a step")
    parts.append(f"{speculative.controller} controller")
    return "speculation: " + ", ".join(parts)
