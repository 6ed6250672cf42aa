"""Weight-only quantized products (GGUF Q4_1 / Q8_0 blocks, specdec.runtime.quant).

Oracles: the kernel's expansion equals gguf-py's reference dequantizer bit for bit; a
quantized product equals the dense float32 ``stream`` product on the dequantized matrix,
cast to the activations' dtype, bit for bit (float32, bfloat16, float16 activations; any
row count); a row's bits do not depend on the rows
beside it; the embedded GGUF's own blocks, read and un-permuted, dequantize to exactly the
weights transformers loads from the same file; and a quantized native model keeps greedy
speculative decoding identical to its plain decoding, with each quantized kernel
(``fma``, ``amx``, ``q8``); the ``amx`` kernel is the float64 product within bfloat16 rounding and
row-invariant for any row count; the ``q8`` kernel is its specified arithmetic (8-bit
activations, llama.cpp's) bit for bit, computed here in PyTorch, for any row count.
"""

from __future__ import annotations

import gc

import pytest
import torch

from specdec.runtime.kernels import kernel_available

pytestmark = pytest.mark.skipif(not kernel_available(), reason="needs specdec's C++ kernels")

from specdec.runtime import quant  # noqa: E402
from specdec.runtime.kernels import (  # noqa: E402
    dequantize_blocks,
    q8_gemm,
    quant_gemm,
    small_gemm,
)
from specdec.runtime.quant import (  # noqa: E402
    KINDS,
    MEASURED_QUANT_KERNELS,
    Q8_GROUP_KINDS,
    QUANT_ROWS,
    DenseKeeper,
    QuantizedMatrix,
    QuantLinear,
    amx_layout,
    available_quant_kernels,
    check_row_invariance,
    choose_quant_kernel,
    concat,
    dequantize,
    keep_dense_budget,
    kernel_layout,
    q8_layout,
    quant_kernel_choices,
    quantize,
    reference_dequantize,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = ("ggml", "kernel")


def _blocks(matrix: QuantizedMatrix, layout: str) -> tuple[torch.Tensor, int]:
    """The blocks and kernel code of ``matrix`` as GGUF stores them or as the kernel reads
    them fastest (Q4_1 rewritten by :func:`kernel_layout`)."""
    return kernel_layout(matrix) if layout == "kernel" else (matrix.blocks, KINDS[matrix.kind][0])


def _matrix(kind: str, n: int, k: int, seed: int = 0) -> QuantizedMatrix:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.05
    weight[0, :32] = 0.0  # a constant block (d = 0)
    return quantize(weight, kind)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_expansion_equals_gguf_reference(kind, dtype, layout):
    matrix = _matrix(kind, 37, 96)
    reference = reference_dequantize(matrix)
    assert torch.equal(dequantize(matrix, torch.float32), reference)
    blocks, code = _blocks(matrix, layout)
    got = dequantize_blocks(blocks, code, 96, dtype)
    assert torch.equal(got, reference.to(dtype))


def test_kernel_layout_of_q4_1():
    matrix = _matrix("q4_1", 5, 64)
    blocks, code = kernel_layout(matrix)
    assert code == 2 and blocks.shape == (5, 2 * 24) and blocks.dtype == torch.uint8
    raw = matrix.blocks.view(5, 2, 20)
    packed = blocks.view(5, 2, 24)
    # d and m as float32, exactly the float16 values
    assert torch.equal(packed[..., :4].contiguous().view(torch.float32),
                       raw[..., :2].contiguous().view(torch.float16).float())  # fmt: skip
    # the nibble bytes: a transposed 4 x 4 array of ggml's
    assert torch.equal(packed[..., 8:].reshape(5, 2, 4, 4), raw[..., 4:].reshape(5, 2, 4, 4).mT)
    q8 = _matrix("q8_0", 5, 64)
    assert kernel_layout(q8) == (q8.blocks, 1)  # Q8_0 runs as stored


@pytest.mark.parametrize("kind", list(KINDS))
def test_quantize_error_is_bounded(kind):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(16, 64, generator=gen)
    back = reference_dequantize(quantize(weight, kind))
    blocks = weight.view(16, 2, 32)
    if kind == "q8_0":
        step = blocks.abs().amax(-1, keepdim=True) / 127
    else:
        step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15
    # half a quantization step, plus float16 rounding of the scales
    assert ((back.view(16, 2, 32) - blocks).abs() <= 0.51 * step + 2e-3).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 64])
def test_product_equals_float32_stream_product_on_the_dequantized_matrix(kind, dtype, rows, layout):
    matrix = _matrix(kind, 37, 576)  # N not a multiple of the kernel's 4-row blocks
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    dense = dequantize(matrix, torch.float32)  # the file's weights exactly
    expected = small_gemm(x.float(), dense).to(dtype)  # float32 arithmetic, then the cast
    assert torch.equal(quant_gemm(x, *_blocks(matrix, layout)), expected)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_in_any_batch(dtype, layout):
    assert check_row_invariance("q4_1", 1536, dtype)
    blocks, code = _blocks(_matrix("q4_1", 64, 1536, seed=3), layout)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(40, 1536, generator=gen).to(dtype)
    alone = torch.cat([quant_gemm(x[i : i + 1], blocks, code) for i in range(40)])
    assert torch.equal(quant_gemm(x, blocks, code), alone)
    assert torch.equal(quant_gemm(x[3:30], blocks, code), alone[3:30])


def test_quant_linear_prefill_and_bias():
    matrix = _matrix("q8_0", 40, 64)
    bias = torch.randn(40)
    linear = QuantLinear(matrix, bias, torch.float32)
    x = torch.randn(20, 64)
    dense = reference_dequantize(matrix)
    torch.testing.assert_close(linear(x, exact=True), x @ dense.T + bias, rtol=1e-5, atol=1e-5)
    # a long prompt chunk: one dense product on the expanded matrix
    torch.testing.assert_close(linear.prefill(x), x @ dense.T + bias, rtol=1e-5, atol=1e-5)
    assert torch.equal(linear.prefill(x[:3]), linear(x[:3]))  # short chunks: the kernel


def test_concat_and_rows():
    a, b = _matrix("q4_1", 8, 64, 5), _matrix("q4_1", 4, 64, 6)
    both = concat([a, b])
    assert both.shape == (12, 64)
    assert torch.equal(
        reference_dequantize(both), torch.cat([reference_dequantize(a), reference_dequantize(b)])
    )
    order = torch.tensor([3, 0, 11])
    assert torch.equal(reference_dequantize(both.rows(order)), reference_dequantize(both)[order])
    with pytest.raises(ValueError, match="formats"):
        concat([a, _matrix("q8_0", 4, 64)])


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), "q8_0")
    with pytest.raises(ValueError, match="unknown block format"):
        quantize(torch.randn(4, 64), "q3_k")
    with pytest.raises(ValueError, match="do not hold"):
        QuantizedMatrix("q4_1", torch.zeros(4, 30, dtype=torch.uint8), (4, 64))
    matrix = _matrix("q4_1", 4, 64)
    with pytest.raises(RuntimeError, match="quantized rows"):
        quant_gemm(torch.randn(2, 96), matrix.blocks, 0)  # K does not match the blocks
    with pytest.raises(RuntimeError, match="kind"):
        quant_gemm(torch.randn(2, 64), matrix.blocks, 7)
    with pytest.raises(RuntimeError, match="quantized rows"):  # ggml's blocks as code 2
        quant_gemm(torch.randn(2, 64), matrix.blocks, 2)
    with pytest.raises(RuntimeError, match="dtype"):
        quant_gemm(torch.randn(2, 64, dtype=torch.float64), matrix.blocks, 0)


# ------------------------------------------------------------------ the embedded GGUF


@pytest.fixture(scope="module")
def embedded_fp32():
    from specdec.models.loading import load

    return load("smollm2-135m-instruct", "float32", backend="hf")


def test_gguf_blocks_are_the_weights_transformers_loads(embedded_fp32):
    """The file's own Q4_1 / Q8_0 blocks, read and with llama.cpp's q/k row permutation
    undone, dequantize to exactly the float32 weights transformers loads from it."""
    from specdec.runtime.quant import gguf_matrices
    from specdec.runtime.weights import extract_weights

    weights = extract_weights(embedded_fp32.model, embedded_fp32.max_context)
    cfg = weights.config
    found, dense = gguf_matrices(
        embedded_fp32.gguf_path, len(weights.layers), cfg.num_heads, cfg.num_kv_heads
    )
    assert dense == []
    assert found["qkv"][0].kind == "q4_1" and found["lm_head"][0].kind == "q8_0"
    for name in ("qkv", "o", "gate_up", "down"):
        for i in (0, len(weights.layers) - 1):
            assert torch.equal(
                reference_dequantize(found[name][i]), getattr(weights.layers[i], name)
            )
    assert torch.equal(reference_dequantize(found["lm_head"][0]), weights.lm_head)


def test_gguf_blocks_kept_in_the_cache_are_the_files_blocks(embedded_fp32, tmp_path, caplog):
    """With ``cache``, the first read keeps the blocks as safetensors and later reads give
    back the same matrices from there without the GGUF; a damaged kept file is read from the
    GGUF again (with a warning) and rewritten."""
    from unittest import mock

    from specdec.runtime import quant

    path, args = embedded_fp32.gguf_path, (30, 9, 3)
    reference = quant.gguf_matrices(path, *args)
    first = quant.gguf_matrices(path, *args, cache=tmp_path)
    (kept,) = tmp_path.glob("gguf-blocks-*30x9x3.safetensors")
    with mock.patch.object(quant, "_read_gguf_matrices", side_effect=AssertionError):
        again = quant.gguf_matrices(path, *args, cache=tmp_path)  # the GGUF is not read
    for got in (first, again):
        assert got[1] == reference[1] and got[0].keys() == reference[0].keys()
        for name, matrices in reference[0].items():
            for a, b in zip(got[0][name], matrices, strict=True):
                assert (a.kind, a.shape) == (b.kind, b.shape) and torch.equal(a.blocks, b.blocks)
    kept.write_bytes(b"not safetensors")
    repaired = quant.gguf_matrices(path, *args, cache=tmp_path)
    assert "ignoring the kept GGUF blocks" in caplog.text
    assert torch.equal(repaired[0]["lm_head"][0].blocks, reference[0]["lm_head"][0].blocks)
    assert kept.stat().st_size > 1_000_000  # rewritten
    # the loader names a folder beside the converted copy: vLLM, pointed at that copy,
    # loads every *.safetensors in it as weights
    folder = embedded_fp32.gguf_cache
    assert folder is not None and folder.name.endswith(".blocks")
    converted = folder.with_name(folder.name.removesuffix(".blocks"))
    assert (converted / "config.json").is_file() and not any(converted.glob("gguf-blocks-*"))


def test_quantized_model_equals_the_dense_model_on_the_same_kernel(embedded_fp32):
    """A quantized float32 native model is the dense model of the dequantized weights: with
    the dense products forced onto the same kernel (``stream``), every logit is
    bit-identical (a short prompt, then verification rows, all on the decoding path)."""
    from specdec.models.base import BatchItem
    from specdec.models.native import NativeModel
    from specdec.runtime.linear import BUCKETS, KernelChoice

    hf = embedded_fp32
    stream = KernelChoice(["stream"] * len(BUCKETS), "stream", 64, 1)
    names = ("qkv", "o", "gate_up", "down", "lm_head")
    dense = NativeModel(hf, choices=dict.fromkeys(names, stream))
    quantized = NativeModel(hf, quantization="gguf")
    assert quantized.decoder.layers[0]["qkv"].matrix.kind == "q4_1"
    outs = []
    for model in (dense, quantized):
        cache = model.new_cache(64)
        # the prompt's rows as decoding rows: a prompt chunk's products follow the measured
        # prefill plan (quantized kernel or expanded weights), which timings on a busy
        # machine may set apart for the two models
        prompt = BatchItem(list(range(200, 210)), cache, num_logits=1, prefill=False)
        first = model.forward_batch([prompt])
        step = model.forward_batch([BatchItem([300, 301, 302, 303], cache)])
        outs.append((first[0], step[0]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize(
    ("dtype", "kernel"),
    [
        ("float32", "fma"),
        ("bfloat16", "fma"),
        ("bfloat16", "amx"),
        ("bfloat16", "dpbf16"),
        ("float32", "q8"),
    ],
)  # fmt: skip (q8 in bfloat16: its conversions are checked bit for bit on the kernel)
def test_quantized_greedy_speculation_equals_plain_decoding(dtype, kernel, monkeypatch):
    """Exact mode on the GGUF's own blocks, with each quantized kernel: a batch of prompts
    with speculation gives each prompt its plain one-at-a-time greedy output, token for
    token."""
    from specdec import LLM, SamplingParams, SpeculativeConfig

    if kernel not in available_quant_kernels(getattr(torch, dtype)):
        pytest.skip(f"the {kernel} kernel is not available here")
    monkeypatch.setenv("SPECDEC_QUANT_KERNEL", kernel)

    llm = LLM(
        backend="native",
        dtype=dtype,
        quantization="gguf",
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=6),
    )
    assert llm.target.quantization == "gguf"
    assert llm.target.decoder.layers[0]["qkv"].kernel == kernel
    prompts = [
        "Repeat twice: the quick brown fox jumps over the lazy dog.",
        "List the numbers from one to twelve, separated by commas.",
        "def fib(n):\n    # return the n-th Fibonacci number\n",
    ]
    params = SamplingParams(max_new_tokens=24)
    batch = llm.generate(prompts, params)
    for prompt, out in zip(prompts, batch, strict=True):
        plain = llm.generate(prompt, params, speculative=SpeculativeConfig(method="none"))
        assert out.token_ids == plain.token_ids, prompt


def test_quantization_errors():
    from conftest import make_model, make_tokenizer
    from specdec import LLM
    from specdec.models.loading import check_quantization
    from specdec.models.native import NativeModel

    with pytest.raises(ValueError, match="unknown quantization"):
        check_quantization("q2", "native")
    with pytest.raises(ValueError, match="native backend"):
        check_quantization("q4_1", "hf")
    with pytest.raises(ValueError, match="unknown quantization"):
        LLM(quantization="int3")
    tiny = make_model(make_tokenizer(), seed=0)
    with pytest.raises(ValueError, match="needs a model loaded from a GGUF"):
        NativeModel(tiny, quantization="gguf")
    with pytest.raises(ValueError, match="unknown quantization"):
        NativeModel(tiny, quantization="q5_k")


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_quantized_at_load_is_lossless_under_speculation(kind):
    """A dense model quantized at load (``q8_0`` / ``q4_1``): the products run from the
    blocks, and greedy speculation equals plain decoding of the quantized model."""
    from conftest import make_model, make_tokenizer
    from specdec import LLM, SamplingParams, SpeculativeConfig
    from specdec.models.native import NativeModel

    tokenizer = make_tokenizer()
    model = NativeModel(make_model(tokenizer, seed=0), quantization=kind)
    assert model.decoder.layers[0]["down"].matrix.kind == kind
    assert model.decoder.lm_head.matrix.kind == "q8_0"
    llm = LLM(model, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    params = SamplingParams(max_new_tokens=20)
    prompt = "w5 w6 w7 w5 w6 w7 w5 w6"
    plain = llm.generate(prompt, params, speculative=SpeculativeConfig(method="none"))
    assert llm.generate(prompt, params).token_ids == plain.token_ids


def _f32_tiles() -> bool:
    from specdec.runtime.kernels import f32_tiles_available

    return f32_tiles_available()


#: The kernels that read the tile layout (amx_layout), each where this CPU runs it.
TILE_KERNELS = [
    pytest.param(
        kernel,
        marks=pytest.mark.skipif(
            kernel not in available_quant_kernels(torch.bfloat16),
            reason=f"no {'AMX-BF16' if kernel == 'amx' else 'AVX512-BF16 with VBMI'} here",
        ),
    )
    for kernel in ("amx", "dpbf16")
]


def _tile_gemm(kernel: str):
    """``(product, layout)`` of a tile kernel."""
    from specdec.runtime import kernels
    from specdec.runtime.quant import dpbf16_layout

    if kernel == "amx":
        return kernels.amx_quant_gemm, amx_layout
    return kernels.dpbf16_quant_gemm, dpbf16_layout


@pytest.mark.parametrize("kernel", TILE_KERNELS)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("n", "k"), [(40, 64), (576, 1536), (300, 96)])
def test_tile_quantized_product_is_the_weights_product_and_row_invariant(kernel, kind, n, k):
    """The tile kernels (integer weights, the file's weights exactly, float32
    accumulation: amx on AMX tiles, dpbf16 on AVX512-BF16 pair dot products): within
    bfloat16 rounding of the float64 product on the dequantized matrix, including a block
    of zeros (d = 0) and N not a multiple of 16; every row bit-identical alone and at every
    place of every row count up to 80 (every pass size of rows, and several passes)."""
    gemm, layout = _tile_gemm(kernel)
    matrix = _matrix(kind, n, k, seed=7)
    tiles, code = layout(matrix)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(90, k, generator=gen).bfloat16()
    y = gemm(x, tiles, code, n)
    ref = x.double() @ reference_dequantize(matrix).double().t()
    assert ((y.double() - ref).abs() <= 2**-8 * ref.abs() + 1e-4 * ref.abs().max()).all()
    alone = torch.cat([gemm(x[i : i + 1], tiles, code, n) for i in range(90)])
    assert torch.equal(alone, y)
    for m in range(2, 81):
        for start in (0, 9):
            assert torch.equal(gemm(x[start : start + m], tiles, code, n), y[start : start + m])


def test_dpbf16_planted_bug_is_caught():
    """The oracle above catches a kernel that drops the Q4_1 minimum (m S(x)): its products
    leave bfloat16 rounding of the weights' product."""
    matrix = _matrix("q4_1", 40, 64, seed=7)
    raw = matrix.blocks.reshape(40, 2, 20).clone()
    raw[..., 2:4] = 0  # m = 0 in every block: what a kernel without the m S(x) term computes
    dropped = QuantizedMatrix("q4_1", raw.reshape(40, 40), (40, 64))
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    ref = x.double() @ reference_dequantize(matrix).double().t()
    wrong = x.double() @ reference_dequantize(dropped).double().t()
    assert not ((wrong - ref).abs() <= 2**-8 * ref.abs() + 1e-4 * ref.abs().max()).all()


@pytest.mark.parametrize("kernel", TILE_KERNELS)
def test_tile_quant_linear_and_its_refusals(kernel):
    gemm, layout = _tile_gemm(kernel)
    matrix = _matrix("q4_1", 48, 64)
    bias = torch.randn(48).bfloat16()
    linear = QuantLinear(matrix, bias, torch.bfloat16, kernel=kernel)
    assert linear.tile == 64 and linear.kernel == kernel
    x = torch.randn(20, 64).bfloat16()
    ref = x.float() @ reference_dequantize(matrix).t() + bias.float()
    torch.testing.assert_close(linear(x, exact=True).float(), ref, rtol=0.02, atol=0.02)
    assert torch.equal(linear(x[:1], exact=True), linear(x, exact=True)[:1])
    with pytest.raises(ValueError, match="computes in bfloat16"):
        QuantLinear(matrix, None, torch.float32, kernel=kernel)
    with pytest.raises(ValueError, match="unknown quantized kernel"):
        QuantLinear(matrix, None, torch.bfloat16, kernel="int8")
    with pytest.raises(RuntimeError, match="tiles hold 64"):
        gemm(torch.zeros(1, 96).bfloat16(), *layout(matrix), 48)
    with pytest.raises(RuntimeError, match="x must be a bfloat16"):
        gemm(torch.zeros(1, 64), *layout(matrix), 48)
    with pytest.raises(RuntimeError, match="matching the tiles' N"):
        gemm(torch.zeros(1, 64).bfloat16(), *layout(matrix), 64)
    with pytest.raises(RuntimeError, match="tiles must be a contiguous"):
        other = amx_layout if kernel == "dpbf16" else _tile_gemm("dpbf16")[1]
        gemm(torch.zeros(1, 64).bfloat16(), *other(matrix), 48)


def test_the_quantized_kernel_is_chosen_by_its_exact_mode_score():
    """One row counts fully, 16 and 64 rows a quarter each (as dense exact choices)."""
    assert len(QUANT_ROWS) == 3
    assert choose_quant_kernel({"fma": [7.0, 40.0, 150.0], "amx": [10.0, 17.0, 55.0]}) == "amx"
    assert choose_quant_kernel({"fma": [7.0, 9.0, 12.0], "amx": [10.0, 10.0, 12.0]}) == "fma"


def test_quant_kernel_choices_measure_once_and_obey_the_override(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    products = {"o": [_matrix("q4_1", 32, 64, s) for s in range(2)]}
    monkeypatch.setenv("SPECDEC_QUANT_KERNEL", "fma")
    assert quant_kernel_choices(products, torch.bfloat16) == {"o": "fma"}
    monkeypatch.setenv("SPECDEC_QUANT_KERNEL", "int4")
    with pytest.raises(ValueError, match="SPECDEC_QUANT_KERNEL"):
        quant_kernel_choices(products, torch.bfloat16)
    monkeypatch.setenv("SPECDEC_QUANT_KERNEL", "amx")  # bfloat16 only: said, and fma runs
    with caplog.at_level("WARNING", logger="specdec.runtime.quant"):
        assert quant_kernel_choices(products, torch.float32) == {"o": "fma"}
    assert "SPECDEC_QUANT_KERNEL=amx is not available here" in caplog.text
    assert "the kernel measurement picks runs instead (fma)" in caplog.text
    if "amx" not in available_quant_kernels(torch.bfloat16):  # bfloat16: the measured choice
        caplog.clear()
        with caplog.at_level("WARNING", logger="specdec.runtime.quant"):
            chosen = quant_kernel_choices(products, torch.bfloat16)["o"]
        assert "the kernel measurement picks runs instead" in caplog.text
        assert chosen in MEASURED_QUANT_KERNELS and chosen != "amx"
    monkeypatch.setenv("SPECDEC_QUANT_KERNEL", "Auto")  # the default, said explicitly
    from specdec.runtime.quant import forced_quant_kernel

    assert forced_quant_kernel() is None
    monkeypatch.delenv("SPECDEC_QUANT_KERNEL")
    assert quant_kernel_choices(products, torch.float32) == {"o": "fma"}  # amx: bf16 only
    first = quant_kernel_choices(products, torch.bfloat16)
    assert first["o"] in available_quant_kernels(torch.bfloat16)
    measured = [k for k in available_quant_kernels(torch.bfloat16) if k in MEASURED_QUANT_KERNELS]
    if len(measured) >= 2:  # measured, then read back
        assert (tmp_path / "kernels.json").exists()
        assert quant_kernel_choices(products, torch.bfloat16) == first


def test_forward_cost_counts_the_bytes_the_quantized_kernel_reads(embedded_fp32):
    """The roofline of a quantized model counts the bytes its chosen kernel streams (the
    blocks in that kernel's layout), not the dense matrices'."""
    from specdec.bench.forward_cost import weight_stats
    from specdec.models.native import NativeModel

    model = NativeModel(embedded_fp32, quantization="gguf")
    decoder = model.decoder
    linears = [*(lin for layer in decoder.layers for lin in layer.values()), decoder.lm_head]
    params, nbytes = weight_stats(model)
    assert nbytes == sum(lin.streamed_bytes for lin in linears)  # every product is quantized
    # Q4_1 layers at 6 bits per weight, the Q8_0 LM head at 8.5: under 7 bits on average
    assert nbytes < params * 7 // 8


def test_a_bad_quant_kernel_is_refused_before_any_model_loads(monkeypatch):
    """``check_quantization`` (run by the CLI, the server and ``LLM`` before loading)
    refuses a bad ``SPECDEC_QUANT_KERNEL``, whatever the quantization."""
    from specdec.models.loading import check_quantization

    monkeypatch.setenv("SPECDEC_QUANT_KERNEL", "int4")
    for quantization in ("none", "gguf"):
        with pytest.raises(ValueError, match="SPECDEC_QUANT_KERNEL='int4': expected one of"):
            check_quantization(quantization, "native")
    monkeypatch.setenv("SPECDEC_QUANT_KERNEL", " AMX ")
    check_quantization("gguf", "native")  # case and spaces do not matter


# ------------------------------------------------------------ the q8 kernel (llama.cpp's)


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fused multiply-add, exactly: ``a * b`` is exact in float64 (24-bit
    mantissas) and the sum rounds once to float64, then to float32. The two roundings
    differ from one only where the float64 sum, inexact, lands on a float32 midpoint:
    there the exact error of the float64 sum (Knuth's TwoSum) says which neighbour the
    true value is nearer to."""
    ab, cd = a.double() * b.double(), c.double()
    r = ab + cd
    back = r - ab
    err = (ab - (r - back)) + (cd - back)  # r + err == ab + cd exactly
    r32 = r.float()
    lo = torch.where(r32.double() <= r, r32, torch.nextafter(r32, torch.tensor(float("-inf"))))
    hi = torch.nextafter(lo, torch.tensor(float("inf")))
    tie = (r - lo.double()) == (hi.double() - r)
    fixed = torch.where(err > 0, hi, lo)
    return torch.where(tie & (err != 0), fixed, r32)


def _q8_reference(x: torch.Tensor, matrix: QuantizedMatrix) -> torch.Tensor:
    """The q8 kernel's arithmetic (``csrc/q8.cpp``) in PyTorch, step by step: ``[M, N]``
    float32."""
    m_rows, k = x.shape
    n, nb = matrix.shape[0], k // 32
    xb = x.float().reshape(m_rows, nb, 32)
    d = xb.abs().amax(-1) / 127  # float32 division, as the kernel
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    a = torch.round(xb * inv[..., None])  # nearest even, as the kernel's conversion
    s = d * a.sum(-1)  # the integer sum is exact in float32 (|sum| <= 4064)
    raw = matrix.blocks.reshape(n, nb, -1)
    dw = raw[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    if matrix.kind == "q4_1":
        mw = raw[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
        nib = raw[..., 4:20].long()
        q = torch.cat([nib & 15, nib >> 4], dim=-1)  # q_i, then q_{i + 16}
    else:
        q = raw[..., 2:34].contiguous().view(torch.int8).long()
    p = torch.einsum("mbi,nbi->mnb", a.long(), q)  # exact integers, |p| < 2^24
    acc = torch.zeros(m_rows, n)
    for b in range(nb):
        acc = _fma32(p[:, :, b].float(), dw[None, :, b] * d[:, None, b], acc)
        if matrix.kind == "q4_1":
            acc = _fma32(mw[None, :, b].expand(m_rows, n), s[:, None, b].expand(m_rows, n), acc)
    return acc


@pytest.mark.parametrize("layout", ["file", "q8"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(16, 64), (40, 576), (13, 96)])
def test_q8_product_is_its_arithmetic_bit_for_bit_for_any_row_count(kind, dtype, n, k, layout):
    """The q8 kernel (8-bit activations, integer dot products: llama.cpp's arithmetic)
    equals its specification computed in PyTorch, bit for bit, then rounded to the
    activations' dtype, on the file's rows and on its own layout (groups of 8 outputs
    interleaved, where N is a multiple of 8); including a block of zero weights (d = 0), a
    block of zero activations (d_x = 0), ties of the rounding to 8 bits and Q8_0's -128.
    Every row gives the same bits alone and at every place of every row count up to 20
    (the kernel's one-row path, its chunks of rows and their remainders)."""
    matrix = _matrix(kind, n, k, seed=3)
    if kind == "q8_0":  # a weight of -128 (|q| is read unsigned by the kernel)
        matrix.blocks.view(n, k // 32, 34)[1, 0, 2] = 0x80
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(23, k, generator=gen)
    x[2, :32] = 0.0  # d_x = 0
    x[3, :32] = torch.arange(32) - 15.5  # d_x = 1 (max 127 below): x / d_x ties, to even
    x[3, 0] = 127.0
    x = x.to(dtype)
    blocks, code = (matrix.blocks, KINDS[kind][0]) if layout == "file" else q8_layout(matrix)
    assert (code == Q8_GROUP_KINDS[kind]) == (layout == "q8" and n % 8 == 0)
    y = q8_gemm(x, blocks, code)
    assert y.dtype == dtype and y.shape == (23, n)
    assert torch.equal(y, _q8_reference(x, matrix).to(dtype))
    alone = torch.cat([q8_gemm(x[i : i + 1], blocks, code) for i in range(23)])
    assert torch.equal(alone, y)
    for m in range(2, 21):
        for start in (0, 3):
            assert torch.equal(q8_gemm(x[start : start + m], blocks, code), y[start : start + m])


def test_q8_product_is_near_the_float_product_and_refuses_what_it_cannot_compute():
    """Rounding the activations to 8 bits per block costs about 1% of an output's size
    (relative to the float32 product on the same weights); and bad inputs are refused."""
    matrix = _matrix("q4_1", 256, 576, seed=5)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(6))
    y = q8_gemm(x, matrix.blocks, 0)
    ref = x.double() @ reference_dequantize(matrix).double().t()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 0.02
    grouped = q8_gemm(x, *q8_layout(matrix))
    assert torch.equal(grouped, y)  # the same arithmetic on either layout
    with pytest.raises(RuntimeError, match="kind must be 0"):
        q8_gemm(x, kernel_layout(matrix)[0], 2)  # the fma kernel's own layout is not read
    with pytest.raises(RuntimeError, match="quantized rows hold"):
        q8_gemm(x[:, :544], matrix.blocks, 0)
    odd = _matrix("q4_1", 12, 96)  # N = 12: not whole groups of 8
    with pytest.raises(RuntimeError, match="not a multiple of 8"):
        q8_gemm(torch.randn(1, 96), odd.blocks, Q8_GROUP_KINDS["q4_1"])
    assert q8_layout(odd)[1] == KINDS["q4_1"][0]  # such a matrix keeps the file's rows
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        q8_gemm(x.double(), matrix.blocks, 0)


def test_q8_runs_only_when_asked_for(tmp_path, monkeypatch):
    """``q8`` changes the activations, so measurement never picks it: it runs when
    ``SPECDEC_QUANT_KERNEL=q8`` asks, in any dtype, reading the file's own blocks."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECDEC_QUANT_KERNEL", raising=False)
    products = {"o": [_matrix("q4_1", 32, 64, s) for s in range(2)]}
    for dtype in DTYPES:
        assert "q8" in available_quant_kernels(dtype)
        assert quant_kernel_choices(products, dtype)["o"] != "q8"
    monkeypatch.setenv("SPECDEC_QUANT_KERNEL", "q8")
    assert quant_kernel_choices(products, torch.float32) == {"o": "q8"}
    linear = QuantLinear(products["o"][0], None, torch.float32, kernel="q8")
    assert linear.tile == 64  # row-invariant: exact mode runs any row count at once
    assert linear.streamed_bytes == products["o"][0].blocks.numel()  # 20 bytes per 32
    x = torch.randn(5, 64)
    assert torch.equal(linear(x, exact=True), q8_gemm(x, *q8_layout(products["o"][0])))
    assert torch.equal(linear.dense(torch.float32), reference_dequantize(products["o"][0]))


@pytest.mark.parametrize(
    ("kernel", "dtype"),
    [("fma", "float32"), ("q8", "float32"),
     *[pytest.param(k.values[0], "bfloat16", marks=k.marks) for k in TILE_KERNELS],
     pytest.param("dense", "bfloat16", marks=TILE_KERNELS[1].marks),
     pytest.param("dense-amx", "bfloat16", marks=TILE_KERNELS[0].marks),
     pytest.param("dense", "float32", marks=pytest.mark.skipif(
         not _f32_tiles(), reason="the float32 tile product needs AVX-512"))],
)  # fmt: skip
def test_fused_decode_layers_give_the_bits_of_the_layers_run_from_python(
    kernel, dtype, embedded_fp32, monkeypatch
):
    """``decode_layers`` (every layer of a forward in one call into the extension) and
    ``decode_layer`` (one call per layer, where hidden states are captured) against the
    same layers run call by call from Python: identical logits, captured states and KV
    caches, in both modes, for a ragged batch of a decoding row, a chain of 3 and a token
    tree of 7 rows, over all layers and over a subset (layer skipping); a prompt chunk in
    the batch keeps the Python path. ``dense``: the model unquantized, every product on
    specdec's tile formulation for its dtype (``dpbf16``, ``f32_tiles``; ``dense-amx``:
    ``amx``)."""
    from specdec.models.base import BatchItem
    from specdec.models.native import NativeModel
    from specdec.runtime import model as runtime_model
    from specdec.runtime.linear import ANY_ROWS, BUCKETS, KernelChoice
    from specdec.trees import ROOT, TokenTree

    formulation = "dpbf16" if dtype == "bfloat16" else "f32_tiles"
    if kernel == "dense-amx":
        kernel, formulation = "dense", "amx"
    if kernel == "dense":
        dense = KernelChoice([formulation] * len(BUCKETS), formulation, ANY_ROWS, 1)
        monkeypatch.setattr(
            runtime_model, "kernel_choices", lambda products: dict.fromkeys(products, dense)
        )
    else:
        monkeypatch.setenv("SPECDEC_QUANT_KERNEL", kernel)
    quantization = "none" if kernel == "dense" else "gguf"
    if dtype == "float32":
        model = NativeModel(embedded_fp32, quantization=quantization)
    else:
        from specdec.models.loading import load

        model = NativeModel(
            load("smollm2-135m-instruct", dtype, backend="hf"), quantization=quantization
        )
    decoder = model.decoder
    if kernel == "dense":
        assert decoder.layers[0]["qkv"].choice.exact == formulation and not decoder.quant_kernels
    else:
        assert decoder.layers[0]["qkv"].kernel == kernel
    n_layers = len(decoder.layers)
    assert all(spec is not None for spec in decoder._decode_specs[True])
    calls = []
    for name in ("decode_layer", "decode_layers"):
        real = getattr(runtime_model, name)
        monkeypatch.setattr(
            runtime_model, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a)
        )
    tree = TokenTree.build([ROOT, ROOT, 0, 0, 1, 2], [311, 312, 313, 314, 315, 316])
    prompts = [list(range(200, 212)), list(range(400, 409)), list(range(600, 620))]
    caches = [model.new_cache(40) for _ in prompts]
    for prompt, cache in zip(prompts, caches, strict=True):
        decoder.forward([BatchItem(prompt, cache)])

    def items():
        return [
            BatchItem([300], caches[0]),
            BatchItem([301, 302, 303], caches[1]),
            BatchItem([310, *tree.token_ids], caches[2],
                      positions=caches[2].num_tokens + tree.position_offsets(),
                      tree_mask=tree.attention_mask()),
        ]  # fmt: skip

    cases = [  # (exact, layers, capture, the calls the fused path makes)
        (True, None, (), ["decode_layers"]),
        (False, None, (), ["decode_layers"]),
        (True, [0, 3, 7, 20], (), ["decode_layers"]),
        # captured layers cut the layers into one call per piece (EAGLE, Medusa)
        (True, None, (5, n_layers), ["decode_layers"] * 2),
        (True, None, (0, 2, 5), ["decode_layers"] * 3),
        (False, None, (1, n_layers - 1, n_layers), ["decode_layers"] * 3),
    ]
    for exact, layers, capture, fused_calls in cases:
        outs = []
        for on in (True, False):
            monkeypatch.setattr(runtime_model, "FUSED_DECODE_LAYER", on)
            calls.clear()
            batch = items()
            results = decoder.forward_full(batch, exact=exact, layers=layers, capture=capture)
            tensors = [
                t for r in results for t in (r.logits, r.hidden, r.captured) if t is not None
            ]
            kv = [c.kv.clone() for c in caches]
            for item in batch:
                item.cache.truncate(item.cache.num_tokens - len(item.token_ids))
            outs.append(tensors + kv)
            assert calls == (fused_calls if on else []), (exact, layers, capture)
        for a, b in zip(outs[0], outs[1], strict=True):
            assert torch.equal(a, b), (exact, layers, capture)
    monkeypatch.setattr(runtime_model, "FUSED_DECODE_LAYER", True)
    for exact, fused in ((False, []), (True, ["decode_layers"])):
        calls.clear()
        fresh = model.new_cache(40)
        decoder.forward([BatchItem([300], caches[0]), BatchItem(prompts[0], fresh)], exact=exact)
        caches[0].truncate(caches[0].num_tokens - 1)
        # fast mode: one forward with a prompt chunk, run from Python; exact mode runs the
        # decoding row apart from the chunk (see _prefill_groups), so that forward is fused
        assert calls == fused


@pytest.mark.parametrize("kernel", ["fma", "q8"])
def test_prompt_chunks_keep_dense_expansions_within_the_budget(kernel, monkeypatch):
    """A chunk's dense product reads the expansion kept by the first chunk (the same values
    as expanding again) while the keeper's budget admits it; past the budget, or with the
    keeper off, every call expands anew; a kept matrix serves every later chunk bit for bit."""
    matrices = [_matrix("q4_1", 64, 64, seed) for seed in range(3)]
    one = 64 * 64 * 4  # one float32 expansion, bytes
    monkeypatch.setattr(quant, "DENSE_KEEPER", DenseKeeper(budget=2 * one))
    linears = [QuantLinear(m, None, torch.float32, kernel=kernel) for m in matrices]
    firsts = [lin.dense(torch.float32) for lin in linears]
    for m, first in zip(matrices, firsts, strict=True):
        assert torch.equal(first, reference_dequantize(m))
    assert linears[0].dense(torch.float32) is firsts[0]  # kept
    assert linears[1].dense(torch.float32) is firsts[1]
    again = linears[2].dense(torch.float32)  # past the budget: expanded anew
    assert again is not firsts[2] and torch.equal(again, firsts[2])
    assert quant.DENSE_KEEPER.kept == 2 * one
    x = torch.randn(quant.PREFILL_DENSE_ROWS, 64)
    expanded = torch.nn.functional.linear(x, reference_dequantize(matrices[0]))
    assert torch.equal(linears[0].prefill(x), expanded)
    assert torch.equal(linears[0].prefill(x), expanded)  # the kept matrix, unchanged by use
    keeper = quant.DENSE_KEEPER
    del linears, firsts
    gc.collect()
    assert keeper.kept == 0  # the matrices are gone: their bytes are free for the next model
    monkeypatch.setattr(quant, "DENSE_KEEPER", DenseKeeper(budget=0.0))
    off = QuantLinear(matrices[0], None, torch.float32, kernel=kernel)
    assert off.dense(torch.float32) is not off.dense(torch.float32)
    assert quant.DENSE_KEEPER.kept == 0


def test_keep_dense_budget_reads_the_environment(monkeypatch):
    """``SPECDEC_KEEP_DENSE``: on (no limit), off (none), auto / unset (a share of the memory
    available); anything else is refused with the variable's name; the keeper reads it at
    its first request, not at import."""
    assert keep_dense_budget("on") == keep_dense_budget(" TRUE ") == float("inf")
    assert keep_dense_budget("OFF") == keep_dense_budget("0") == 0.0
    monkeypatch.setattr(quant, "available_memory", lambda: 8_000_000_000)
    assert keep_dense_budget("auto") == keep_dense_budget("") == 2_000_000_000
    monkeypatch.setattr(quant, "available_memory", lambda: None)
    assert keep_dense_budget("auto") == 0.0  # unknown memory: expand per chunk
    with pytest.raises(ValueError, match="SPECDEC_KEEP_DENSE='yes': expected on, off or auto"):
        keep_dense_budget("yes")
    monkeypatch.setenv("SPECDEC_KEEP_DENSE", "sometimes")
    keeper = DenseKeeper()
    with pytest.raises(ValueError, match="'sometimes'"):
        keeper.admit(1)
    from specdec.models.loading import check_quantization

    with pytest.raises(ValueError, match="SPECDEC_KEEP_DENSE"):  # before any load, any backend
        check_quantization("none", "hf")
    monkeypatch.setenv("SPECDEC_KEEP_DENSE", "off")
    assert not keeper.admit(1) and keeper.budget == 0.0
