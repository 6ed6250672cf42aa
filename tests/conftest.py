"""Tiny random-weight models and a word-level tokenizer, built in code (fast, offline)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdec.models.hf import HFModel

NUM_WORDS = 29  # + 3 special tokens = 32 real tokens
#: Where the tests' models live: ``SPECDEC_TEST_DEVICE=cuda`` runs the suite's models on a
#: GPU (``benchmarks/gpu_check.sh``); CPU otherwise.
TEST_DEVICE = torch.device(os.environ.get("SPECDEC_TEST_DEVICE", "cpu"))


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs ``-n auto``), each worker takes its share of
    the cores for PyTorch's threads (and the ``specdec`` processes tests start, through
    ``OMP_NUM_THREADS``), so workers x threads <= cores. Measured on 2 cores: two workers of
    2 threads each ran the suite slower than one process (each OpenMP region waits for a
    core the other worker holds); two of 1 thread ran it 1.8x faster. The kernels'
    thread-count invariance is tested explicitly (``test_kernels``)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every CPU
        cores = len(affinity(0)) if affinity else os.cpu_count() or 1
        threads = max(1, cores // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def make_tokenizer(num_words: int = NUM_WORDS, prefix: str = "w") -> PreTrainedTokenizerFast:
    """Word-level tokenizer: ``<unk>``=0, ``<s>``=1, ``</s>``=2, then ``w0``, ``w1``, ..."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"{prefix}{i}": 3 + i for i in range(num_words)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def make_model(
    tokenizer,
    seed: int,
    vocab_size: int | None = None,
    hidden_size: int = 32,
    num_layers: int = 2,
    max_positions: int = 128,
    init_std: float = 0.3,
    name: str = "tiny",
    device: torch.device | str = TEST_DEVICE,
) -> HFModel:
    """A random Llama on ``device``; ``vocab_size`` > len(tokenizer) gives a padded
    embedding matrix.

    ``init_std`` is large so next-token distributions are peaked, like a trained model's.
    """
    config = LlamaConfig(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval().to(device)
    return HFModel(model, tokenizer, name=name)


def save_model(hf: HFModel, directory) -> str:
    """Write a tiny model and its tokenizer as a Hugging Face directory; its path."""
    hf.model.save_pretrained(directory)
    hf.tokenizer.hf.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The tiny target (seed 0) saved as a model directory, for CLI tests (read-only)."""
    return save_model(make_model(make_tokenizer(), seed=0), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def target(tokenizer) -> HFModel:
    return make_model(tokenizer, seed=0, name="tiny-target")


@pytest.fixture(scope="session")
def draft(tokenizer) -> HFModel:
    return make_model(tokenizer, seed=1, hidden_size=16, num_layers=1, name="tiny-draft")


@pytest.fixture(scope="session")
def padded_draft(tokenizer) -> HFModel:
    """A draft whose embedding matrix has 16 padding rows beyond the tokenizer."""
    return make_model(
        tokenizer,
        seed=2,
        vocab_size=len(tokenizer) + 16,
        hidden_size=16,
        num_layers=1,
        name="tiny-padded-draft",
    )


def perturbed_copy(
    model: HFModel, noise: float, seed: int, extra_vocab: int = 0, name: str = "tiny-near-draft"
) -> HFModel:
    """The target's weights plus Gaussian noise: a draft that agrees often, not always.

    ``extra_vocab`` > 0 appends padding rows (random) to the embedding and LM head.
    """
    config = model.model.config.to_dict()
    config["vocab_size"] = model.vocab_size + extra_vocab
    copy = LlamaForCausalLM(LlamaConfig(**config)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        source = model.model.state_dict()
        for key, tensor in copy.state_dict().items():
            src = source[key].cpu()
            if src.shape != tensor.shape:  # padded vocabulary rows
                tensor.normal_(0, 0.3, generator=generator)
                tensor[: src.shape[0]] = src
            else:
                tensor.copy_(src)
            tensor.add_(noise * torch.randn(tensor.shape, generator=generator))
    return HFModel(copy.to(TEST_DEVICE), model.tokenizer, name=name)


@pytest.fixture(scope="session")
def near_draft(target) -> HFModel:
    return perturbed_copy(target, noise=0.01, seed=3)


@pytest.fixture(scope="session")
def near_padded_draft(target) -> HFModel:
    return perturbed_copy(target, noise=0.01, seed=4, extra_vocab=16, name="tiny-near-padded")


@pytest.fixture(scope="session")
def small():
    """An 8-token target and a noisy copy as draft: small enough for exact joint laws."""
    tokenizer = make_tokenizer(num_words=5)
    target = make_model(tokenizer, seed=0, hidden_size=16, num_layers=1, init_std=0.2)
    draft = perturbed_copy(target, noise=0.08, seed=1)
    return target, draft


@pytest.fixture(autouse=True)
def _keep_torch_threads(monkeypatch):
    """The CLI sets PyTorch's thread count for its process (``--threads``, or fewer on a
    busy machine); tests that run it in-process must not change it for the tests after,
    nor depend on the machine's load (the test process itself keeps a core busy), so the
    machine reads idle unless a test says otherwise."""
    from specdec import cli_common, machine

    monkeypatch.setattr(cli_common, "machine_load", lambda: 0.0)
    monkeypatch.setattr(machine, "load_checked", True)  # LLM's look at the load, too
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def torch_threads(n: int):
    """PyTorch on ``n`` threads inside the block (the kernels' bits must not depend on it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


#: A chat template for the tiny word-level tokenizer: the messages' contents, then "w28".
SERVER_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w28{% endif %}"
)


def make_server_llm():
    """The tiny target on the native runtime (exact), with a chat template, prompt lookup
    (k=4) and room for 16 sequences: what the server tests serve."""
    from specdec import LLM, SpeculativeConfig
    from specdec.engine import EngineConfig
    from specdec.models.native import NativeModel

    tokenizer = make_tokenizer()
    tokenizer.chat_template = SERVER_CHAT_TEMPLATE
    target = NativeModel(make_model(tokenizer, seed=0, name="tiny-target"), exact=True)
    return LLM(
        target,
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4),
        engine_config=EngineConfig(max_num_seqs=16, max_num_batched_tokens=256),
    )


def sse_events(text: str) -> list[dict]:
    """The JSON objects of a server-sent event stream's ``data:`` lines (``[DONE]`` left out)."""
    import json

    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def uvicorn_thread(app, **config):
    """``app`` on a uvicorn server in a daemon thread, on a free loopback port; yields
    ``(base url, server)`` and stops the server after. ``config`` goes to
    ``uvicorn.Config`` (e.g. ``log_level="error"``, or ``log_config=None`` to log through
    the root logger, which ``caplog`` sees)."""
    import threading
    import time

    import uvicorn

    port = free_port()
    config = {"timeout_graceful_shutdown": 5, **config}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(15)
