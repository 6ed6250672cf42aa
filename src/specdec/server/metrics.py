"""Prometheus metrics of the server (``/metrics``), in their own registry (no globals).

The speculative-decoding counters use the names vLLM and llama.cpp share, with a
``specdec:`` prefix, so existing dashboards work: ``specdec:spec_decode_num_drafts``,
``specdec:spec_decode_num_draft_tokens``, ``specdec:spec_decode_num_accepted_tokens`` and
``specdec:spec_decode_num_accepted_tokens_per_pos{position}`` (counters, exposed with the
``_total`` suffix). Acceptance rate = accepted / draft tokens; mean acceptance length =
1 + accepted / drafts (vLLM's definitions).

``specdec:request_success{finished_reason}`` counts each choice once when it ends:
``stop``, ``length``, or ``abort`` (its client disconnected, the server shut down before it
finished, or the engine failed).

The load gauges are also exposed under vLLM's own names and labels
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, and with prefix caching the counters
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` in prompt tokens, labelled
``model_name`` and ``engine``), beside the
``specdec:`` ones, so tools that scrape a vLLM server unchanged (the Gateway API inference
extension and llm-d's endpoint picker, AIPerf, vLLM's Grafana dashboards) read a specdec
server too.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    """Counters, gauges and histograms of one server."""

    def __init__(self, model_name: str = "specdec") -> None:
        """Args:
        model_name: the served model's id, the ``model_name`` label of the vLLM-named
            gauges.
        """
        self.registry = r = CollectorRegistry()
        self.request_success = Counter(
            "specdec:request_success", "Finished requests.", ["finished_reason"], registry=r
        )
        self.prompt_tokens = Counter("specdec:prompt_tokens", "Prompt tokens.", registry=r)
        self.generation_tokens = Counter(
            "specdec:generation_tokens", "Generated tokens.", registry=r
        )
        self.num_requests_running = Gauge(
            "specdec:num_requests_running", "Requests admitted (prefilling or decoding).",
            registry=r,
        )  # fmt: skip
        self.num_requests_waiting = Gauge(
            "specdec:num_requests_waiting", "Requests queued for admission.", registry=r
        )
        self.kv_cache_usage = Gauge(
            "specdec:kv_cache_usage_perc", "Fraction of the KV slot budget in use.", registry=r
        )
        # vLLM's names and labels (vllm/v1/metrics/loggers.py), one engine per server.
        labels = {"model_name": model_name, "engine": "0"}

        def vllm(kind, name: str, text: str):
            return kind(name, text, list(labels), registry=r).labels(**labels)

        self.vllm_num_requests_running = vllm(
            Gauge, "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.vllm_num_requests_waiting = vllm(
            Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.vllm_kv_cache_usage = vllm(
            Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prefix_cache_queries = Counter(
            "specdec:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            registry=r,
        )  # fmt: skip
        self.prefix_cache_hits = Counter(
            "specdec:prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r
        )
        self.vllm_prefix_cache_queries = vllm(
            Counter, "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )  # fmt: skip
        self.vllm_prefix_cache_hits = vllm(
            Counter, "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
        )  # fmt: skip
        self._prefix_seen = (0, 0)
        self.num_drafts = Counter(
            "specdec:spec_decode_num_drafts", "Steps that drafted at least one token.",
            registry=r,
        )  # fmt: skip
        self.num_draft_tokens = Counter(
            "specdec:spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r
        )
        self.num_accepted_tokens = Counter(
            "specdec:spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r
        )
        self.accepted_per_position = Counter(
            "specdec:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, per draft position (tree depth for trees).",
            ["position"],
            registry=r,
        )
        self.num_steps_off = Counter(
            "specdec:spec_decode_num_steps_off",
            "Steps whose speculation controller switched drafting off (chose 0 tokens).",
            registry=r,
        )
        self.chosen_k = Counter(
            "specdec:spec_decode_chosen_k",
            "Steps per number of draft tokens chosen by the speculation controller.",
            ["k"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "specdec:time_to_first_token_seconds", "Time to first token.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e_latency = Histogram(
            "specdec:e2e_request_latency_seconds", "Request latency.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        """Set the load gauges, under both names.

        Args:
            running: requests admitted (prefilling or decoding).
            waiting: requests queued for admission.
            kv_usage: fraction of the KV slot budget in use, in [0, 1].
        """
        for gauge, value in (
            (self.num_requests_running, running),
            (self.vllm_num_requests_running, running),
            (self.num_requests_waiting, waiting),
            (self.vllm_num_requests_waiting, waiting),
            (self.kv_cache_usage, kv_usage),
            (self.vllm_kv_cache_usage, kv_usage),
        ):
            gauge.set(value)

    def set_prefix_cache(self, queried: int, hit: int) -> None:
        """Advance the prefix-cache counters, under both names, to the cache's totals.

        Args:
            queried, hit: prompt tokens looked up and found since the server started
                (:class:`~specdec.engine.PrefixCache` counts them).
        """
        seen_queried, seen_hit = self._prefix_seen
        for counters, delta in (
            ((self.prefix_cache_queries, self.vllm_prefix_cache_queries), queried - seen_queried),
            ((self.prefix_cache_hits, self.vllm_prefix_cache_hits), hit - seen_hit),
        ):
            if delta > 0:
                for counter in counters:
                    counter.inc(delta)
        self._prefix_seen = (queried, hit)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class StatsLog:
    """A line of the server's load every ``interval`` seconds while it works, as vLLM's
    engine logs its throughput (``--disable-log-stats`` turns it off there and here).

    The engine thread adds what each step did (:meth:`add`) and calls :meth:`tick`; a line
    goes to ``write`` once ``interval`` seconds have passed since the last one and some
    work happened in between (an idle server stays quiet), e.g.::

        specdec (last 10 s): prompt 812.4 tokens/s, generation 151.0 tokens/s, running 32,
        waiting 0, KV cache 11.2%, prefix cache hit rate 61.0%; speculation: 210 drafts,
        mean acceptance length 2.35 per draft, acceptance rate 41.3%

    (one line; the rates are the interval's tokens over its seconds, idle time included,
    as vLLM's "Avg ... throughput"; the prefix cache's part with
    ``--enable-prefix-caching``: prompt tokens found over prompt tokens looked up in the
    interval). Mean acceptance length is 1 +
    accepted / drafts (vLLM's), per step that drafted ("per draft"; a response's
    ``mean_acceptance_length`` counts every step).

    Args:
        interval: seconds between lines (> 0).
        write: where a line goes (default: standard output, flushed).
        clock: seconds (default :func:`time.monotonic`).
    """

    def __init__(self, interval: float, write=None, clock=None) -> None:
        import time

        if not interval > 0:
            raise ValueError(f"the stats interval must be > 0 seconds, got {interval!r}")
        self.interval = float(interval)
        self.write = write or (lambda line: print(line, flush=True))
        self.clock = clock or time.monotonic
        self.last = self.clock()
        self.prompt = self.generation = self.drafts = self.drafted = self.accepted = 0
        self._prefix_seen = (0, 0)

    def add(self, prompt=0, generation=0, drafts=0, drafted=0, accepted=0) -> None:
        """Count one step's (or one admission's) tokens."""
        self.prompt += prompt
        self.generation += generation
        self.drafts += drafts
        self.drafted += drafted
        self.accepted += accepted

    def tick(
        self, running: int, waiting: int, kv_usage: float, prefix: tuple[int, int] | None = None
    ) -> str | None:
        """Write (and return) a line if one is due, then start the next interval.

        Args:
            running, waiting, kv_usage: the load (see :meth:`ServerMetrics.set_load`).
            prefix: with prefix caching, the cache's prompt tokens looked up and found
                since the server started.
        """
        now = self.clock()
        elapsed = now - self.last
        if elapsed < self.interval:
            return None
        busy = self.prompt or self.generation or running or waiting
        line = None
        if busy:
            seconds = f"{elapsed:.1f}".removesuffix(".0")  # "10", "10.3"
            line = (
                f"specdec (last {seconds} s): prompt {self.prompt / elapsed:.1f} tokens/s, "
                f"generation {self.generation / elapsed:.1f} tokens/s, running {running}, "
                f"waiting {waiting}, KV cache {100 * kv_usage:.1f}%"
            )
            if prefix is not None:
                queried = prefix[0] - self._prefix_seen[0]
                hit = prefix[1] - self._prefix_seen[1]
                rate = 100 * hit / queried if queried else 0.0
                line += f", prefix cache hit rate {rate:.1f}%"
            if self.drafts:
                line += (
                    f"; speculation: {self.drafts} drafts, mean acceptance length "
                    f"{1 + self.accepted / self.drafts:.2f} per draft, acceptance rate "
                    f"{100 * self.accepted / max(1, self.drafted):.1f}%"
                )
            self.write(line)
        self.last = now
        if prefix is not None:
            self._prefix_seen = prefix
        self.prompt = self.generation = self.drafts = self.drafted = self.accepted = 0
        return line
