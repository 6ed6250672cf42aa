"""Peer worker of ``specdec bench``: vLLM or llama.cpp decodes prompt token ids.

This file runs under the *peer's* interpreter (``--vllm-python`` / ``--llama-python``),
where specdec is usually not installed: it imports only the standard library and the
peer library (``vllm`` or ``llama_cpp``), never specdec. specdec starts it once per peer
method (:class:`specdec.bench.peers.PeerRunner`) as ``PYTHON peer_worker.py``.

Protocol: one JSON object per line, UTF-8, in both directions.

* First line on standard input, the load message::

      {"library": "vllm" | "llama-cpp", "method": "vllm-ar" | "vllm-ngram" | "llama-cpp"
       | "llama-cpp-lookup", "options": {"k": 10, "max_ngram": 4}, "model": PATH_OR_NAME,
       "dtype": "bfloat16", "threads": 2, "max_context": 8192, "eos_ids": [2],
       "warmup": [{"prompt_ids": [...], "max_new_tokens": 64}, ...]}

  ``model`` is a Hugging Face folder or hub id (vLLM) or a GGUF file (llama.cpp).
  The worker loads the model once, runs the ``warmup`` generations once (greedy; a
  repetitive prompt makes the speculative methods draft, accept and reject, so the
  libraries compile those paths before the timed runs: vLLM's n-gram proposer and its
  verification shapes compile on first use), and
  answers ``{"ready": true, "version": "0.32.0", "load_s": 41.2}`` or
  ``{"ready": false, "error": "..."}`` (then exits with status 1).
* Each later line, a job::

      {"prompt_ids": [...], "max_new_tokens": 128, "temperature": 0.0, "top_p": 1.0,
       "top_k": 0, "seed": 0, "eos_ids": [2]}

  ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 are off; ``eos_ids`` (ids
  that end the generation; default: the load message's). The answer::

      {"token_ids": [...], "elapsed_s": 0.52, "error": null}

  ``token_ids``: the generated ids, at most ``max_new_tokens``, ending with the EOS id
  when one was generated (specdec's convention: the EOS token is kept, nothing after
  it). ``elapsed_s``: wall seconds of the library's generate call, measured here (no
  pipe, no JSON). ``error``: ``"Type: message"`` when the call raised; ``token_ids``
  then holds what it generated before raising.
* End of standard input: the worker frees the model and exits with status 0.

The answers go to the file descriptor that was standard output when the worker started.
Before importing the library the worker points standard output (file descriptor 1, so
Python prints and C-level writes alike) at standard error: library logs never reach the
protocol channel.

What the peers run: vLLM ``LLM(model, dtype, max_model_len, seed=0,
enable_prefix_caching=False)``, plus for ``vllm-ngram`` ``speculative_config={"method":
"ngram", "num_speculative_tokens": k, "prompt_lookup_max": max_ngram,
"prompt_lookup_min": 1}``, one ``generate`` per request with ``stop_token_ids`` = the EOS
ids; llama.cpp ``Llama(model_path, n_ctx, n_threads, n_threads_batch, n_batch=512)``,
plus for ``llama-cpp-lookup`` ``draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k)``,
its KV cache reset before each request (no prefix reuse: every request processes its
whole prompt, as specdec does).
"""

from __future__ import annotations

import json
import os
import sys
import time


def clip(token_ids: list[int], eos_ids: set[int], max_new_tokens: int) -> list[int]:
    """``token_ids`` cut after the first EOS id (kept) and to ``max_new_tokens`` ids."""
    out = []
    for token in token_ids[:max_new_tokens]:
        out.append(int(token))
        if token in eos_ids:
            break
    return out


class VllmPeer:
    """vLLM's offline ``LLM``: plain decoding (``vllm-ar``) or n-gram speculative
    decoding (``vllm-ngram``)."""

    def __init__(self, load: dict) -> None:
        import vllm
        from vllm import LLM

        self.version = getattr(vllm, "__version__", "?")
        self.eos_ids = {int(t) for t in load["eos_ids"]}
        kwargs = {}
        if load["method"] == "vllm-ngram":
            options = load["options"]
            kwargs["speculative_config"] = {
                "method": "ngram",
                "num_speculative_tokens": int(options["k"]),
                "prompt_lookup_max": int(options["max_ngram"]),
                "prompt_lookup_min": 1,
            }
        self.llm = LLM(
            model=load["model"],
            dtype=load["dtype"],
            max_model_len=int(load["max_context"]),
            seed=0,
            enable_prefix_caching=False,  # each request is timed from an empty cache
            **kwargs,
        )

    def generate(self, job: dict, eos_ids: set[int], out: list[int]) -> None:
        """Append the ids vLLM generated for ``job`` to ``out``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sampled = float(job["temperature"]) > 0
        params = SamplingParams(
            max_tokens=int(job["max_new_tokens"]),
            temperature=float(job["temperature"]),
            top_p=float(job["top_p"]) if sampled else 1.0,
            top_k=int(job["top_k"]) if sampled else 0,
            seed=int(job["seed"]) if sampled and job.get("seed") is not None else None,
            stop_token_ids=sorted(eos_ids),
        )
        prompt = TokensPrompt(prompt_token_ids=list(job["prompt_ids"]))
        result = self.llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        out.extend(int(t) for t in result.token_ids)
        # vLLM keeps a stop token in token_ids; should a build drop it, put it back.
        stop = getattr(result, "stop_reason", None)
        if isinstance(stop, int) and stop in eos_ids and (not out or out[-1] != stop):
            out.append(stop)

    def close(self) -> None:
        del self.llm


class LlamaCppPeer:
    """llama-cpp-python's ``Llama``: plain decoding (``llama-cpp``) or its prompt-lookup
    decoding (``llama-cpp-lookup``)."""

    def __init__(self, load: dict) -> None:
        import llama_cpp
        from llama_cpp import Llama

        self.version = getattr(llama_cpp, "__version__", "?")
        self.eos_ids = {int(t) for t in load["eos_ids"]}
        draft = None
        if load["method"] == "llama-cpp-lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=int(load["options"]["k"]))
        threads = int(load["threads"])
        self.llm = Llama(
            model_path=load["model"],
            n_ctx=int(load["max_context"]),
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            seed=0,
            verbose=False,
            draft_model=draft,
        )

    def generate(self, job: dict, eos_ids: set[int], out: list[int]) -> None:
        """Append the ids llama.cpp generated for ``job`` to ``out``."""
        max_new_tokens = int(job["max_new_tokens"])
        if max_new_tokens < 1:
            return
        self.llm.reset()  # no prefix reuse from the previous request's KV cache
        sampled = float(job["temperature"]) > 0
        if sampled:
            self.llm.set_seed(int(job.get("seed") or 0))
        tokens = self.llm.generate(
            list(job["prompt_ids"]),
            top_k=int(job["top_k"]) if sampled else 1,
            top_p=float(job["top_p"]) if sampled else 1.0,
            min_p=0.0,
            typical_p=1.0,
            temp=float(job["temperature"]),
            repeat_penalty=1.0,
            reset=True,
        )
        for token in tokens:
            out.append(int(token))
            if token in eos_ids or len(out) >= max_new_tokens:
                break

    def close(self) -> None:
        if hasattr(self.llm, "close"):
            self.llm.close()
        del self.llm


PEERS = {"vllm": VllmPeer, "llama-cpp": LlamaCppPeer}


def error_text(error: BaseException) -> str:
    """``"Type: message"`` on one line, at most 500 characters."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text[:500]


def run_job(peer, job: dict) -> dict:
    """One job's answer (see the module docstring)."""
    eos_ids = {int(t) for t in job.get("eos_ids") or peer.eos_ids}
    out: list[int] = []
    start = time.perf_counter()
    try:
        peer.generate(job, eos_ids, out)
        error = None
    except Exception as exc:  # the turn is recorded as failed; the run goes on
        error = error_text(exc)
    elapsed = time.perf_counter() - start
    token_ids = clip(out, eos_ids, int(job["max_new_tokens"]))
    return {"token_ids": token_ids, "elapsed_s": elapsed, "error": error}


def serve(requests, answer) -> int:
    """Read the load message and the jobs from ``requests`` (lines), write answers with
    ``answer(dict)``; return the exit status."""
    line = requests.readline()
    if not line.strip():
        return 1
    load = json.loads(line)
    start = time.perf_counter()
    try:
        peer = PEERS[load["library"]](load)
        for warmup in load["warmup"]:
            job = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, **warmup}
            warm = run_job(peer, job)
            if warm["error"]:
                raise RuntimeError(f"warm-up generation failed: {warm['error']}")
    except Exception as exc:
        answer({"ready": False, "error": error_text(exc)})
        return 1
    answer({"ready": True, "version": peer.version, "load_s": time.perf_counter() - start})
    for line in requests:
        if line.strip():
            answer(run_job(peer, json.loads(line)))
    peer.close()
    return 0


def main() -> int:
    # The protocol keeps the original standard output; everything else written to file
    # descriptor 1 from here on (Python or C) lands on standard error.
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    sys.stdout.flush()
    os.dup2(2, 1)

    def answer(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    try:
        return serve(sys.stdin, answer)
    except KeyboardInterrupt:  # specdec shuts the worker down by closing standard input
        return 130
    except BrokenPipeError:  # specdec went away
        return 1


if __name__ == "__main__":
    sys.exit(main())
