"""``specdec serve`` replicated on Ray Serve (optional extra ``specdec[ray]``).

Each replica is a Ray actor running one whole specdec server (the FastAPI app of
:func:`specdec.server.app.create_app`: its own model, engine, KV cache and drafter state);
Ray Serve's HTTP proxy spreads requests over the replicas (its default router: the less
loaded of two random replicas) and restarts a replica that dies. The same code runs on a
laptop (``ray.init(num_cpus=N)``, what ``specdec serve --replicas N`` does unless
``RAY_ADDRESS`` names a cluster) and on a cluster.

* **Drain.** On shutdown (SIGTERM / Ctrl-C of ``specdec serve --replicas``, or
  ``serve.shutdown()``) Ray stops routing to a replica, waits up to
  ``graceful_shutdown_timeout_s`` for its in-flight requests, then runs the app's own
  shutdown, which finishes or aborts what is left (as ``specdec serve`` does on SIGTERM).
* **A replica that dies** (killed, out of memory): requests in flight on it fail (the
  client sees an HTTP 5xx from Ray's proxy, or a stream that ends without ``[DONE]``);
  requests accepted afterwards go to the surviving replicas while Ray restarts it. Nothing
  hangs. Ray does not retry a request a replica had started (retrying a non-idempotent
  generation is the client's choice; the ``openai`` client retries 5xx by default).
* **Routing.** Ray's default router balances load; it has no session or prefix affinity
  for plain HTTP ingress (Ray's ``PrefixCacheAffinityRouter`` reads Ray LLM's own request
  objects), so each replica's cross-request suffix cache learns from the requests it
  happens to serve.

In Python:

```python
from ray import serve
from specdec.integrations.ray import build_app

serve.run(build_app(["--model", "smollm2-135m-instruct", "--drafter", "suffix"],
                    replicas=2))
```

(the list holds ``specdec serve``'s own options: every replica builds its server from
them).
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["DEPLOYMENT_NAME", "build_app", "parse_serve_args", "serve_replicated"]

#: The Ray Serve deployment's name.
DEPLOYMENT_NAME = "specdec"


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """``specdec serve``'s options from ``argv``, checked as the command checks them.

    Raises:
        ValueError: an option is invalid (the message names it).
        SystemExit: an unknown option (argparse's usage error).
    """
    from specdec.server.options import add_serve_arguments, check_serve_args

    parser = argparse.ArgumentParser(prog="specdec serve")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    check_serve_args(args)
    return args


def _replica_app(args: argparse.Namespace, cpus: int) -> Any:
    """Build one replica's FastAPI app (runs inside the replica's actor)."""
    import torch

    from specdec.cli_common import llm_from_args
    from specdec.server.app import create_app
    from specdec.server.options import apply_max_model_len, check_serve_args

    if args.threads is None:
        torch.set_num_threads(max(1, cpus))
    else:
        torch.set_num_threads(args.threads)
    speculative, config = check_serve_args(args)
    llm = llm_from_args(args, speculative, engine_config=config)
    apply_max_model_len(llm, getattr(args, "max_model_len", None))
    return create_app(
        llm, args.served_model_name or args.model, args.max_waiting,
        stats_interval=None if args.disable_log_stats else args.log_stats_interval,
        api_key=getattr(args, "api_key", None),
        tool_call_parser=getattr(args, "tool_call_parser", None),
    )  # fmt: skip


def build_app(
    serve_args: list[str] | argparse.Namespace,
    replicas: int = 2,
    cpus_per_replica: int = 1,
    graceful_shutdown_timeout_s: float = 30.0,
) -> Any:
    """A Ray Serve application of ``replicas`` specdec servers.

    Args:
        serve_args: ``specdec serve``'s options (``--model``, ``--drafter``, ...; ``--host``
            and ``--port`` are Ray Serve's HTTP options instead and are ignored here), as
            a list of strings or as parsed by ``specdec serve``.
        replicas: number of replicas (>= 1).
        cpus_per_replica: CPUs Ray reserves for each replica (>= 1); its PyTorch threads
            unless ``--threads`` is given.
        graceful_shutdown_timeout_s: seconds a stopping replica lets in-flight requests
            finish.

    Returns:
        a ``ray.serve.Application`` for ``serve.run``.

    Raises:
        ValueError: an invalid option or count.
        ImportError: Ray Serve is not installed (``pip install 'specdec[ray]'``).
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    if (
        isinstance(cpus_per_replica, bool)
        or not isinstance(cpus_per_replica, int)
        or (cpus_per_replica < 1)
    ):
        raise ValueError(f"cpus_per_replica must be an integer >= 1, got {cpus_per_replica!r}")
    if isinstance(serve_args, argparse.Namespace):
        from specdec.server.options import check_serve_args

        check_serve_args(serve_args)
        args = serve_args
    else:
        args = parse_serve_args(list(serve_args))
    try:
        from ray import serve
    except ImportError as exc:
        raise ImportError(
            "replicas need Ray Serve: pip install 'specdec[ray]' (or 'ray[serve]')"
        ) from exc

    def app_builder():
        return _replica_app(args, cpus_per_replica)

    @serve.deployment(
        name=DEPLOYMENT_NAME,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus_per_replica},
        max_ongoing_requests=args.max_waiting + args.max_num_seqs,
        graceful_shutdown_timeout_s=graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=1.0,
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
    )
    @serve.ingress(app_builder)
    class SpecdecServer:
        """One replica: a whole specdec server."""

    return SpecdecServer.bind()


def serve_replicated(args: argparse.Namespace) -> int:
    """``specdec serve --replicas N``: start (or join, with ``RAY_ADDRESS``) Ray, run the
    replicas behind Ray Serve's proxy on ``--host``/``--port``, and on SIGTERM / Ctrl-C
    drain them (:func:`build_app`'s ``graceful_shutdown_timeout_s``) and exit 0.

    Raises:
        ImportError: Ray Serve is not installed.
        ValueError: an invalid option.
    """
    import os
    import signal
    import threading

    app = build_app(args, replicas=args.replicas, cpus_per_replica=args.cpus_per_replica)
    import ray
    from ray import serve

    address = os.environ.get("RAY_ADDRESS")
    needed = args.replicas * args.cpus_per_replica
    if address:
        ray.init(address=address, include_dashboard=False)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=DEPLOYMENT_NAME, route_prefix="/")
        print(
            f"specdec: serving {args.model} on {args.replicas} Ray Serve replicas at "
            f"http://{args.host}:{args.port}/v1",
            flush=True,
        )
        stop.wait()
        print("specdec: draining the replicas", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print("specdec: server stopped", flush=True)
    return 0
