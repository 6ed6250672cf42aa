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
    add_drafter_args,
    add_quantization_arg,
    add_threads_arg,
    check_model_args,
    choose_threads,
    llm_from_args,
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

logger = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics) with batched speculative decoding.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"target (default: {DEFAULT_MODEL})")
    p.add_argument("--served-model-name", help="the id clients send as 'model' (default: --model)")
    add_drafter_args(p)
    p.add_argument(
        "--dtype", default=DEFAULT_DTYPE,
        help="auto (default: bfloat16 where this machine runs it faster, else float32), "
        "float32, bfloat16, float16, or int8-dynamic (runs on transformers)",
    )  # fmt: skip
    p.add_argument("--draft-dtype", default=None, help="dtype of --draft-model (default: --dtype)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument(
        "--backend",
        default=DEFAULT_BACKEND,
        choices=BACKENDS,
        help="auto (default: the native runtime, which batches, when it supports the model), "
        "native or hf",
    )
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True,
                   help="native backend: batch-invariant forwards (default: on)")  # fmt: skip
    add_quantization_arg(p, default="none")
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
        help="KV cache slots over all sequences (default: 65536)",
    )  # fmt: skip
    p.add_argument(
        "--max-waiting", type=int, default=256,
        help="queued requests beyond which new ones get HTTP 429 (default: 256)",
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
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from specdec.server.app import create_app

    speculative, config = _checked(args)
    if args.replicas > 1:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ValueError("--replicas needs Ray Serve: pip install 'specdec[ray]'")
        from specdec.integrations.ray import serve_replicated

        bind(args.host, args.port).close()  # a busy port fails now, not in Ray's proxy
        return serve_replicated(args)
    listener = bind(args.host, args.port)  # before the model loads: a busy port fails now
    choose_threads(args, adapt=False)  # --threads or OMP_NUM_THREADS; else every core
    llm = llm_from_args(args, speculative, engine_config=config)
    app = create_app(
        llm, args.served_model_name or args.model, args.max_waiting, engine_thread=False
    )
    print(
        f"specdec: serving {args.model} ({llm.target.backend} backend) on "
        f"http://{args.host}:{args.port}/v1",
        flush=True,
    )
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


def _checked(args: argparse.Namespace):
    """Every option checked before anything loads: the speculative settings and the
    engine's limits.

    Raises:
        ValueError: the message names the option.
    """
    from specdec.engine import EngineConfig

    check_dtype(args.dtype)
    check_backend(args.backend, args.dtype)
    check_quantization(args.quantization, args.backend)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    if getattr(args, "replicas", 1) < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if getattr(args, "cpus_per_replica", 1) < 1:
        raise ValueError(f"--cpus-per-replica must be >= 1, got {args.cpus_per_replica}")
    speculative = speculative_config(args)
    check_model_args(args)
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_kv_tokens=args.max_kv_tokens,
    )
    return speculative, config


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
