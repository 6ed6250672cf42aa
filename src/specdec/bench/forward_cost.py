"""Forward-cost report: what one target forward of T tokens costs, per backend, dtype and
exact mode, against this machine's roofline.

Speculative decoding pays when verifying T = k + 1 tokens costs about as much as decoding
one, so the curve t(T) / t(1) is what decides whether a drafter can win. The roofline is
measured here, on the machine the report runs on:

* read bandwidth: the best of a few ``sum`` passes over a 1 GiB float32 tensor and (on a
  CPU where it builds) a few one-row products over the same GiB read as a float32 matrix
  on specdec's tile kernel (:func:`specdec.runtime.kernels.f32_tile_gemm`), measured at
  the start of the run and again at its end: the fastest read seen bounds the step, so a
  slow hour at the start cannot loosen the bound (on the shared VMs the rate moves by
  tens of percent between runs);
* GEMM peak per dtype: the best of a few 2048 x 2048 x 2048 products;
* ``roofline(T) = max(weight bytes / bandwidth, T * 2 * params / peak)`` (Williams et al.,
  "Roofline", CACM 2009): a decoder forward reads every weight once and does 2 FLOPs per
  weight and token.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.models.hf import HFModel

#: Token counts of the curve.
TOKENS = (1, 2, 4, 8, 16, 32, 64)
#: (backend, dtype, exact, quantization) configurations of the report; ``gguf`` ones run
#: only for a model loaded from a GGUF file (its own Q4_1 / Q8_0 blocks).
CONFIGS = (
    ("hf", "float32", False, "none"),
    ("native", "float32", False, "none"),
    ("native", "float32", True, "none"),
    ("native", "float32", True, "gguf"),
    ("hf", "bfloat16", False, "none"),
    ("native", "bfloat16", False, "none"),
    ("native", "bfloat16", True, "none"),
    ("native", "bfloat16", True, "gguf"),
)
#: Context already cached when the T tokens are run (a typical prompt).
CONTEXT = 128


@dataclass
class Machine:
    """Measured limits: read bandwidth (GB/s) and GEMM peak per dtype (GFLOP/s)."""

    bandwidth_gbs: float
    peak_gflops: dict[str, float]
    threads: int
    #: the CPU's model name, or the GPU's for a run on one
    device: str = ""
    #: every read-rate probe (GB/s) behind ``bandwidth_gbs``, its best
    bandwidth_probes: dict[str, float] = field(default_factory=dict)


def measure_machine(
    dtypes=("float32", "bfloat16"), repeats: int = 3, device: str | torch.device = "cpu"
) -> Machine:
    """Measure read bandwidth and GEMM peak on ``device`` (see the module docstring; on a
    GPU the products are 8192 x 8192 x 8192, 2048 being too small to fill one)."""
    device = torch.device(device)
    probes = measure_bandwidth(device, repeats, "at start")
    peaks = {}
    n = 8192 if device.type == "cuda" else 2048
    for name in dtypes:
        dtype = getattr(torch, name)
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        _seconds(lambda a=a, b=b: a @ b, device)
        best = min(_seconds(lambda a=a, b=b: a @ b, device) for _ in range(repeats))
        peaks[name] = 2 * n**3 / best / 1e9
    bandwidth = max(probes.values())
    return Machine(bandwidth, peaks, torch.get_num_threads(), _device_name(device), probes)


def measure_bandwidth(device: torch.device, repeats: int = 3, when: str = "") -> dict[str, float]:
    """Read rates in GB/s over 1 GiB: ``sum`` (PyTorch's reduction) and, on a CPU where
    specdec's float32 tile kernel builds, a one-row product reading the same GiB as a
    ``[2^18, 1024]`` matrix in its tile layout (each byte read once, one FMA per 16
    floats). Keys: the probe's name, then ``when``."""
    data = torch.ones(1 << 28, device=device)  # 1 GiB of float32
    rates = {}
    best = min(_seconds(data.sum, device) for _ in range(repeats))
    rates[f"sum {when}".strip()] = data.numel() * 4 / best / 1e9
    if device.type == "cpu":
        from specdec.runtime.kernels import f32_tile_gemm, f32_tiles_available

        if f32_tiles_available():
            tiles = data.view(1 << 14, 1024, 16)
            x = torch.ones(1, 1024)
            product = lambda: f32_tile_gemm(x, tiles, 1 << 18)  # noqa: E731
            best = min(_seconds(product) for _ in range(repeats))
            rates[f"tile product {when}".strip()] = data.numel() * 4 / best / 1e9
    return rates


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from specdec.runtime.linear import cpu_name

    return cpu_name()


def _seconds(f, device: torch.device | None = None) -> float:
    """Wall seconds of ``f()``, waiting for a GPU's queued work before and after."""
    on_gpu = device is not None and device.type == "cuda"
    synchronize = torch.cuda.synchronize if on_gpu else (lambda: None)
    synchronize()
    start = time.perf_counter()
    f()
    synchronize()
    return time.perf_counter() - start


def weight_stats(model) -> tuple[int, int]:
    """``(parameters read per forward, bytes)``: every matrix of the decoder layers plus
    the LM head (an embedding row gather is negligible; a tied LM head counts once). For
    a native model with quantized products, their bytes are the blocks' bytes in the
    layout the chosen kernel reads (``QuantLinear.streamed_bytes``; Q4_1: 24 bytes per 32
    weights for the ``fma`` kernel, see :func:`specdec.runtime.quant.kernel_layout`)."""
    module = model.model
    head = module.get_output_embeddings().weight
    params = head.numel()
    for layer in module.model.layers:
        params += sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    weight_bytes = params * head.element_size()
    decoder = getattr(model, "decoder", None)
    if decoder is not None:  # quantized products stream their blocks as the kernel reads them
        linears = [linear for layer in decoder.layers for linear in layer.values()]
        for linear in [*linears, decoder.lm_head]:
            streamed = getattr(linear, "streamed_bytes", None)
            if streamed is not None:
                n, k = linear.matrix.shape
                weight_bytes += streamed - n * k * head.element_size()
    return params, weight_bytes


def roofline_ms(params: int, weight_bytes: int, tokens: int, machine: Machine, dtype: str):
    """The machine's lower bound on a forward of ``tokens`` tokens, in milliseconds."""
    memory = weight_bytes / (machine.bandwidth_gbs * 1e9)
    compute = tokens * 2 * params / (machine.peak_gflops[dtype] * 1e9)
    return max(memory, compute) * 1e3


def forward_times(
    model: HFModel, tokens=TOKENS, repeats: int = 7, context: int = CONTEXT
) -> list[float]:
    """Median milliseconds of one forward of T new tokens after ``context`` cached ones
    (random token ids; the timing does not depend on them). On a GPU each forward is timed
    from an idle device until its queued work is done.

    The sizes are timed in rounds, each round one forward of every T (after one warm-up
    round): a machine whose speed drifts over a minute (a shared VM) then slows every T
    alike, so the ratio t(T) / t(1) compares forwards of the same moments, where timing
    each T's repeats back to back compared T = 1 on one minute with T = 16 on another."""
    gen = torch.Generator().manual_seed(0)
    high = min(model.vocab_size, len(model.tokenizer))
    prefix = torch.randint(3, high, (context,), generator=gen).tolist()
    device = next(model.model.parameters()).device
    cache = model.new_cache(context + max(tokens))
    model.forward(prefix, cache, num_logits=1)
    news = [torch.randint(3, high, (t,), generator=gen).tolist() for t in tokens]
    samples: list[list[float]] = [[] for _ in tokens]
    for _ in range(repeats + 1):  # the first round warms up
        for i, new in enumerate(news):
            samples[i].append(_seconds(lambda new=new: model.forward(new, cache), device) * 1e3)
            cache.truncate(context)
    return [sorted(s[1:])[repeats // 2] for s in samples]


def exact_plan(model) -> dict[str, str]:
    """How exact mode computes each dense product of a native model, as calibration chose
    it (:class:`~specdec.runtime.linear.KernelChoice`): ``{product: "formulation, rows"}``
    where rows is ``all rows at once``, ``tiles of T rows`` or ``one row at a time``;
    ``{}`` for a model without dense products (transformers, or every product quantized).
    """
    from specdec.runtime.linear import ANY_ROWS

    decoder = getattr(model, "decoder", None)
    plan = {}
    for name, choice in sorted((getattr(decoder, "choices", None) or {}).items()):
        if choice.tile >= ANY_ROWS:
            rows = "all rows at once"
        elif choice.tile == 1:
            rows = "one row at a time"
        else:
            rows = f"tiles of {choice.tile} rows"
        padded = f", padded to {choice.min_rows}" if choice.min_rows > 1 else ""
        plan[name] = f"{choice.exact}, {rows}{padded}"
    return plan


@dataclass
class CurveRecord:
    """One configuration's curve (``exact_plan``: :func:`exact_plan` of an exact one)."""

    backend: str
    dtype: str
    exact: bool
    times_ms: list[float]
    roofline_ms: list[float]
    kv_bytes_per_token: int | None = None
    tokens: list[int] = field(default_factory=lambda: list(TOKENS))
    quantization: str = "none"
    exact_plan: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        mode = " exact" if self.exact else ""
        quant = f" {self.quantization}" if self.quantization != "none" else ""
        return f"{self.backend} {self.dtype}{mode}{quant}"


def run_forward_cost(model_name: str, device: str = "cpu", progress=None) -> dict:
    """Measure the machine and every configuration of :data:`CONFIGS` for ``model_name``.

    Returns:
        ``{"machine", "params", "weight_bytes", "curves"}`` (JSON-ready).
    """
    from specdec.models.loading import load, with_backend

    machine = measure_machine(device=device)
    curves, stats = [], {}
    loaded: dict[str, HFModel] = {}
    for backend, dtype, exact, quantization in CONFIGS:
        if dtype not in loaded:
            loaded = {dtype: load(model_name, dtype, device)}  # one dtype in memory at a time
        model = loaded[dtype]
        if quantization == "gguf" and model.gguf_path is None:
            if progress:
                progress(1)
            continue
        if backend == "native":
            model = with_backend(model, "native", exact, quantization)
        params, weight_bytes = weight_stats(model)
        suffix = "" if quantization == "none" else f"_{quantization}"
        stats.update({"params": params, f"weight_bytes_{dtype}{suffix}": weight_bytes})
        kv = model.new_cache(1).bytes_per_token if backend == "native" else None
        times = forward_times(model)
        plan = exact_plan(model) if exact else {}
        curves.append(
            (
                (params, weight_bytes),
                CurveRecord(
                    backend,
                    dtype,
                    exact,
                    times,
                    [],
                    kv,
                    quantization=quantization,
                    exact_plan=plan,
                ),
            )  # fmt: skip
        )
        if progress:
            progress(1)
    loaded, model = {}, None  # the weights out of memory before the GiB of the probes
    machine.bandwidth_probes.update(measure_bandwidth(torch.device(device), when="at end"))
    machine.bandwidth_gbs = max(machine.bandwidth_probes.values())
    for (params, weight_bytes), curve in curves:  # the bound of the fastest read seen
        curve.roofline_ms = [
            roofline_ms(params, weight_bytes, t, machine, curve.dtype) for t in TOKENS
        ]
    records = [asdict(curve) for _, curve in curves]
    return {"machine": asdict(machine), **stats, "curves": records}


def report_markdown(result: dict) -> str:
    """Tables: t(T) in ms (and t(T)/t(1)), the roofline, and the issue's three checks."""
    m = result["machine"]
    peaks = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in m["peak_gflops"].items())
    where = f"measured here, {m['device']}" if m.get("device") else "measured here"
    probes = m.get("bandwidth_probes") or {}
    seen = f" (the best of: {', '.join(f'{k} {v:.1f}' for k, v in probes.items())})"
    lines = [
        f"Machine ({where}): read bandwidth {m['bandwidth_gbs']:.1f} GB/s{seen * bool(probes)}, "
        f"GEMM peak {peaks}, {m['threads']} threads. Context: {CONTEXT} cached tokens.\n",
        "| configuration | " + " | ".join(f"T={t}" for t in TOKENS) + " |",
        "|---|" + "---|" * len(TOKENS),
    ]
    curves = [CurveRecord(**c) for c in result["curves"]]
    for c in curves:
        cells = [f"{ms:.1f} ({ms / c.times_ms[0]:.2f}x)" for ms in c.times_ms]
        lines.append(f"| {c.label} | " + " | ".join(cells) + " |")
    for dtype, quant in dict.fromkeys((c.dtype, c.quantization) for c in curves):
        roof = next(c.roofline_ms for c in curves if (c.dtype, c.quantization) == (dtype, quant))
        name = dtype if quant == "none" else f"{dtype} {quant}"
        lines.append(f"| roofline {name} | " + " | ".join(f"{r:.1f}" for r in roof) + " |")
    lines += ["", "| configuration | t(1) / bandwidth bound | worst t(T) / roofline(T) |"]
    lines += ["|---|---|---|"]
    for c in curves:
        ratios = [t / r for t, r in zip(c.times_ms, c.roofline_ms, strict=True)]
        lines.append(
            f"| {c.label} | {c.roofline_ms[0] / c.times_ms[0]:.0%} of the bound | "
            f"{max(ratios):.2f}x |"
        )
    lines.append("")
    for dtype in dict.fromkeys(c.dtype for c in curves):
        exact = [c for c in curves if c.dtype == dtype and c.exact and c.quantization == "none"]
        others = [c for c in curves if c.dtype == dtype and not c.exact]
        if exact and others:
            fastest = min(c.times_ms[0] for c in others)
            lines.append(
                f"- {dtype}: exact decoding step {exact[0].times_ms[0]:.1f} ms = "
                f"{exact[0].times_ms[0] / fastest:.2f}x the fastest non-exact step "
                f"({fastest:.1f} ms)."
            )
        kv = [c.kv_bytes_per_token for c in curves if c.dtype == dtype and c.kv_bytes_per_token]
        if kv:
            lines.append(f"- {dtype}: KV cache {kv[0]} bytes per cached token (all layers).")
        for c in curves:
            if c.dtype == dtype and c.exact_plan:
                chosen = "; ".join(f"{name}: {how}" for name, how in c.exact_plan.items())
                lines.append(f"- {c.label}, dense products as calibrated: {chosen}.")
    return "\n".join(lines) + "\n"


def plot_forward_cost(path: Path, result: dict) -> Path:
    """t(T) per configuration against T (log-log), with each dtype's roofline dashed."""
    from specdec.bench.report import pyplot

    plt = pyplot()

    curves = [CurveRecord(**c) for c in result["curves"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in curves:
        style = ":" if c.backend != "native" else "-." if c.quantization != "none" else "-"
        ax.plot(c.tokens, c.times_ms, style, marker="o", label=c.label)
    for dtype in dict.fromkeys(c.dtype for c in curves):
        roof = next(c.roofline_ms for c in curves if c.dtype == dtype)
        ax.plot(TOKENS, roof, "--", color="black" if dtype == "float32" else "gray",
                label=f"roofline {dtype}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per forward (T)")
    ax.set_ylabel("ms per forward")
    ax.set_title("Forward cost vs roofline")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_forward_cost(out_dir: Path, result: dict, environment: dict) -> list[Path]:
    """``forward_cost.json``, ``forward_cost.md`` and ``forward_cost.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"environment": environment, **result}
    paths = [out_dir / "forward_cost.json", out_dir / "forward_cost.md"]
    paths[0].write_text(json.dumps(data, indent=1))
    env = "\n".join(f"- {k}: {v}" for k, v in environment.items())
    paths[1].write_text(
        f"# specdec forward cost\n\n## Environment\n\n{env}\n\n## Result\n\n"
        f"{report_markdown(result)}"
    )
    paths.append(plot_forward_cost(out_dir / "forward_cost.png", result))
    return paths
