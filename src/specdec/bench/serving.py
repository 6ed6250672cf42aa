"""Serving benchmark: ``specdec serve`` under load, speculation off vs on.

The server is the real command (``specdec serve`` in a subprocess on loopback: clients in
the server's process would compete with its engine for the CPU and the GIL); clients are
asyncio ``httpx`` streams of ``/v1/chat/completions`` (greedy,
``stream_options.include_usage``).
For each concurrency c, the same prompts are sent by c concurrent clients, each taking the
next prompt when its previous one finishes; speculation off and on run back to back at each
level (off 1, on 1, off 2, on 2, ...), so a change in the machine's speed during the run
hits both alike; each level runs ``rounds`` times (default 2) in ABBA order (off, on,
on, off: a linear drift of the machine's speed cancels out), and its figures pool every
round. Measured per request: time to first token
(TTFT: first non-empty content chunk), time per output token after the first (TPOT =
(end - first token) / (tokens - 1), vLLM's definition), end-to-end latency; per level:
output tokens per second over the wall time of the level. Speculation is switched per
request with the ``speculative`` extension (``{"enabled": false}`` for the off run), so
one server serves both. Every greedy output with speculation on must equal the output
with it off. A last measurement runs the same prompts one at a time in-process
(``LLM.generate``) to show the server's own overhead at concurrency 1.

With a vLLM interpreter (:func:`run_vllm_serving`), vLLM's own OpenAI server (``python -m
vllm.entrypoints.openai.api_server``, its default multi-process engine) is measured the
same way on the same prompts, after specdec's server has exited: the baseline a
deployment would otherwise run, with its prefix cache off (every level sends the same
prompts again; a cached vLLM would skip from the second level on the prefill that
specdec, whose prefix cache is off by default as in this run, computes every time).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.config import SamplingParams

#: Concurrency levels of the report.
CONCURRENCY = (1, 2, 4, 8, 16, 32)


@dataclass
class Level:
    """One (speculation, concurrency) measurement.

    Attributes:
        speculative: speculation on.
        concurrency: concurrent clients.
        num_requests, output_tokens, wall_s: what ran.
        throughput: output tokens per second over the level's wall time.
        ttft_ms, tpot_ms, e2e_ms: medians over requests (and p90 of TTFT).
        outputs: each prompt's text, in prompt order (the first round's).
        server: ``"specdec"`` or ``"vllm"``.
        rounds: how many times the level ran (its figures pool them all: throughput is
            every round's tokens over every round's wall time, medians are over every
            request of every round).
        round_throughputs: each round's output tokens per second.
        repeatable: every round gave the same outputs.
    """

    speculative: bool
    concurrency: int
    num_requests: int
    output_tokens: int
    wall_s: float
    throughput: float
    ttft_ms: float
    ttft_p90_ms: float
    tpot_ms: float
    e2e_ms: float
    outputs: list[str] = field(repr=False)
    server: str = "specdec"
    rounds: int = 1
    round_throughputs: list[float] = field(default_factory=list)
    repeatable: bool = True


@dataclass
class ServingResult:
    levels: list[Level]
    in_process_tokens_per_s: float
    in_process_outputs: list[str] = field(repr=False)
    max_new_tokens: int = 0
    num_prompts: int = 0
    vllm_version: str | None = None


def run_serving(
    serve_args: list[str],
    make_llm,
    prompts: list[str],
    max_new_tokens: int,
    concurrency: tuple[int, ...] = CONCURRENCY,
    progress=None,
    rounds: int = 2,
) -> ServingResult:
    """Measure the server on ``prompts`` (see the module docstring).

    Args:
        serve_args: ``specdec serve`` options (model, dtype, backend, drafter); the port
            and served model name are added here.
        make_llm: builds the same model in this process, for the in-process measurement
            (called after the server has exited).
        rounds: times each level runs (ABBA order, pooled), >= 1.
    """
    port = _free_port()
    command = [sys.executable, "-m", "specdec.cli", "serve", *serve_args, "--port", str(port),
               "--served-model-name", "bench"]  # fmt: skip
    levels = _measure_server(
        command, None, port, prompts, max_new_tokens, concurrency, (False, True), progress,
        rounds=rounds,
    )  # fmt: skip
    llm = make_llm()
    params = SamplingParams(max_new_tokens=max_new_tokens)
    llm.generate(prompts[0], SamplingParams(max_new_tokens=8))  # the same warm-up
    start, outputs, tokens = time.perf_counter(), [], 0
    for p in prompts:
        out = llm.generate(p, params)
        outputs.append(out.text)
        tokens += len(out.token_ids)
    in_process = tokens / (time.perf_counter() - start)
    if progress:
        progress()
    return ServingResult(levels, in_process, outputs, max_new_tokens, len(prompts))


def run_vllm_serving(
    python: str,
    model: str,
    dtype: str,
    threads: int,
    prompts: list[str],
    max_new_tokens: int,
    concurrency: tuple[int, ...] = CONCURRENCY,
    progress=None,
    rounds: int = 2,
) -> list[Level]:
    """Measure vLLM's OpenAI server on the same prompts and levels (``server="vllm"``,
    ``speculative=False``: plain decoding, vLLM's default; prefix cache off, see the
    module's note), each level ``rounds`` times back to back, pooled.

    Args:
        python: the interpreter of vLLM's environment.
        model: what vLLM loads (:func:`specdec.bench.peers.peer_model`).
        dtype: ``bfloat16``, ``float32`` or ``float16``.
        threads: OpenMP threads of its engine (bound to this process's first CPUs).

    Raises:
        RuntimeError: the server exits or does not answer within 10 minutes.
    """
    port = _free_port()
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
               "--served-model-name", "bench", "--max-model-len", "2048",
               "--seed", "0", "--no-enable-prefix-caching"]  # fmt: skip
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(VLLM_SERVING_KV_GIB))
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cpus:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus[:threads])))
    levels = _measure_server(
        command, env, port, prompts, max_new_tokens, concurrency, (False,), progress,
        extension=False, rounds=rounds,
    )  # fmt: skip
    for level in levels:
        level.server = "vllm"
    return levels


#: vLLM's preallocated CPU KV cache for the serving baseline (GiB): 32 clients at once.
VLLM_SERVING_KV_GIB = 4


def abba(modes: tuple[bool, ...], rounds: int) -> list[bool]:
    """The order of one level's runs: ``modes``, then reversed, and so on ``rounds`` times
    (ABBA for two modes and two rounds: a linear drift of the machine's speed hits both
    modes alike).

    Example:
        >>> abba((False, True), 2), abba((False,), 3)
        ([False, True, True, False], [False, False, False])
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    return [m for r in range(rounds) for m in (modes if r % 2 == 0 else modes[::-1])]


def _measure_server(
    command,
    env,
    port,
    prompts,
    max_new_tokens,
    concurrency,
    modes,
    progress,
    extension=True,
    rounds=1,
) -> list[Level]:
    """Start ``command`` (a server on ``port``), wait for ``/health``, warm it up, run
    every (mode, concurrency) level ``rounds`` times (:func:`abba`), stop it.
    ``extension``: the requests may carry specdec's ``speculative`` field (a vLLM server
    gets plain OpenAI requests)."""
    import httpx

    # the log goes to a file, not a pipe: a chatty server would fill a pipe and block
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
        )
        base = f"http://127.0.0.1:{port}"
        levels = []
        try:
            deadline = time.monotonic() + 600
            while True:
                if server.poll() is not None:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"{' '.join(command[:4])} exited: {tail}")
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{' '.join(command[:4])} did not start within 10 minutes")
                time.sleep(0.25)
            url = f"{base}/v1/chat/completions"
            asyncio.run(_warmup(url, prompts[0], extension))
            for c in concurrency:  # off and on alternate: drift hits both alike
                runs: dict[bool, list] = {m: [] for m in modes}
                for speculative in abba(modes, rounds):
                    runs[speculative].append(
                        asyncio.run(_run(url, prompts, max_new_tokens, c, speculative, extension))
                    )
                for speculative in modes:
                    levels.append(_level(runs[speculative], speculative, c))
                    if progress:
                        progress()
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    return levels


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _warmup(url: str, prompt: str, extension: bool = True) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=600) as http:
        await http.post(url, json=_body(prompt, 8, True, stream=False, extension=extension))


def _body(
    prompt: str, max_tokens: int, speculative: bool, stream: bool = True, extension: bool = True
) -> dict:
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if extension and not speculative:
        body["speculative"] = {"enabled": False}
    return body


async def _run(url, prompts, max_tokens, concurrency, speculative, extension=True):
    """One run of a level: ``(wall s, per prompt (text, tokens, ttft, tpot, e2e))``."""
    import httpx

    pending = list(enumerate(prompts))
    results: dict[int, tuple] = {}

    async def client(http):
        while pending:
            index, prompt = pending.pop(0)
            body = _body(prompt, max_tokens, speculative, extension=extension)
            results[index] = await _one(http, url, body)

    limits = httpx.Limits(max_connections=concurrency + 4)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=3600, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return wall, [results[i] for i in range(len(prompts))]


def _level(runs: list[tuple[float, list]], speculative: bool, concurrency: int) -> Level:
    """One level's figures, pooled over its runs (see :class:`Level`)."""
    wall = sum(w for w, _ in runs)
    requests = [r for _, ordered in runs for r in ordered]
    tokens = sum(r[1] for r in requests)
    ttft = [r[2] * 1e3 for r in requests if r[2] is not None]
    tpot = [r[3] * 1e3 for r in requests if r[3] is not None]
    first = [r[0] for r in runs[0][1]]
    return Level(
        speculative=speculative,
        concurrency=concurrency,
        num_requests=len(runs[0][1]),
        output_tokens=tokens // len(runs),
        wall_s=wall,
        throughput=tokens / wall,
        ttft_ms=statistics.median(ttft),
        ttft_p90_ms=_quantile(ttft, 0.9),
        tpot_ms=statistics.median(tpot) if tpot else 0.0,
        e2e_ms=statistics.median(r[4] * 1e3 for r in requests),
        outputs=first,
        rounds=len(runs),
        round_throughputs=[sum(r[1] for r in ordered) / w for w, ordered in runs],
        repeatable=all([r[0] for r in ordered] == first for _, ordered in runs),
    )


async def _one(http, url: str, body: dict):
    """``(text, completion tokens, ttft s, tpot s, e2e s)`` of one streamed request."""
    start = time.perf_counter()
    first = None
    text, tokens = [], 0
    async with http.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    if first is None:
                        first = time.perf_counter()
                    text.append(content)
    end = time.perf_counter()
    ttft = None if first is None else first - start
    tpot = None if first is None or tokens < 2 else (end - first) / (tokens - 1)
    return "".join(text), tokens, ttft, tpot, end - start


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


# ---------------------------------------------------------------- report


def report_markdown(result: ServingResult) -> str:
    own = [lv for lv in result.levels if lv.server == "specdec"]
    off = {lv.concurrency: lv for lv in own if not lv.speculative}
    on = {lv.concurrency: lv for lv in own if lv.speculative}
    vllm = {lv.concurrency: lv for lv in result.levels if lv.server == "vllm"}
    rounds = max((lv.rounds for lv in result.levels), default=1)
    lines = []
    if rounds > 1:
        lines += [
            f"Each level ran {rounds} times (speculation off, on, on, off, ...: a steady "
            "drift of the machine's speed hits both alike); its figures pool the rounds, "
            "and `on / off by round` pairs round i of each.",
            "",
        ]
    lines += [
        "| concurrency | tokens/s off | tokens/s on | on / off | on / off by round "
        "| TTFT ms off / on (median) | TPOT ms off / on (median) | e2e ms off / on (median) "
        "| identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in sorted(off):
        a, b = off[c], on[c]
        same = sum(x == y for x, y in zip(a.outputs, b.outputs, strict=True))
        by_round = (
            ", ".join(
                f"{y / x:.2f}x"
                for x, y in zip(a.round_throughputs, b.round_throughputs, strict=True)
            )
            or "-"
        )
        repeat = "" if a.repeatable and b.repeatable else " (a round differed)"
        lines.append(
            f"| {c} | {a.throughput:.1f} | {b.throughput:.1f} | {b.throughput / a.throughput:.2f}x "
            f"| {by_round} | {a.ttft_ms:.0f} / {b.ttft_ms:.0f} | {a.tpot_ms:.1f} / {b.tpot_ms:.1f} "
            f"| {a.e2e_ms:.0f} / {b.e2e_ms:.0f} | {same}/{len(a.outputs)}{repeat} |"
        )
    server_1 = on[min(on)].throughput if on else 0.0
    same_in_process = sum(
        x == y for x, y in zip(on[min(on)].outputs, result.in_process_outputs, strict=True)
    )
    lines += [
        "",
        f"Server overhead at concurrency 1 (speculation on): `specdec serve` "
        f"{server_1:.1f} tokens/s vs `LLM.generate` in-process "
        f"{result.in_process_tokens_per_s:.1f} tokens/s "
        f"({server_1 / result.in_process_tokens_per_s:.2f}x); identical outputs "
        f"{same_in_process}/{len(result.in_process_outputs)}.",
    ]
    if vllm:
        version = f" {result.vllm_version}" if result.vllm_version else ""
        lines += [
            "",
            f"Against vLLM{version}'s OpenAI server (plain decoding, its default; prefix "
            "cache off: the levels repeat the prompts; specdec's is off too), "
            "same prompts and levels, measured after specdec's server exited:",
            "",
            "| concurrency | vLLM tokens/s | specdec off / vLLM | specdec on / vLLM | TTFT ms "
            "vLLM (median) | TPOT ms vLLM (median) | vLLM identical to specdec off |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in sorted(vllm):
            v = vllm[c]
            cells = [str(c), f"{v.throughput:.1f}"]
            for mine in (off.get(c), on.get(c)):
                cells.append(f"{mine.throughput / v.throughput:.2f}x" if mine else "-")
            same = (
                f"{sum(x == y for x, y in zip(v.outputs, off[c].outputs, strict=True))}"
                f"/{len(v.outputs)}"
                if c in off
                else "-"
            )
            cells += [f"{v.ttft_ms:.0f}", f"{v.tpot_ms:.1f}", same]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_serving(out_dir: Path, result: ServingResult, env: dict) -> list[Path]:
    from specdec.bench.report import pyplot

    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"environment": env, **asdict(result)}
    paths = [out_dir / "serving.json", out_dir / "serving.md", out_dir / "serving.png"]
    paths[0].write_text(json.dumps(data, indent=1))
    paths[1].write_text(
        "# specdec serving benchmark\n\n## Environment\n\n"
        + "".join(f"- {k}: {v}\n" for k, v in env.items())
        + f"\n## Result\n\n{result.num_prompts} prompts, {result.max_new_tokens} new tokens, "
        "greedy.\n\n" + report_markdown(result) + "\n"
    )
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    curves = (("specdec", False, "o--", "speculation off"), ("specdec", True, "s-",
              "speculation on"), ("vllm", False, "^:", "vLLM"))  # fmt: skip
    for server, speculative, style, label in curves:
        levels = [
            lv for lv in result.levels if lv.server == server and lv.speculative == speculative
        ]
        if not levels:
            continue
        xs = [lv.concurrency for lv in levels]
        axes[0].plot(xs, [lv.throughput for lv in levels], style, label=label)
        axes[1].plot(xs, [lv.ttft_ms for lv in levels], style, label=label)
        axes[2].plot(xs, [lv.tpot_ms for lv in levels], style, label=label)
    titles = ("output tokens/s", "time to first token (ms, median)", "time per output token (ms)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)
    return paths
