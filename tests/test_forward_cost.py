"""The forward-cost report: roofline arithmetic, timing a tiny model, tables and plot."""

from __future__ import annotations

import json

import pytest

from specdec.bench.forward_cost import (
    TOKENS,
    Machine,
    forward_times,
    report_markdown,
    roofline_ms,
    weight_stats,
    write_forward_cost,
)
from specdec.models.native import NativeModel


def test_roofline_is_the_larger_of_memory_and_compute():
    machine = Machine(bandwidth_gbs=10.0, peak_gflops={"float32": 100.0}, threads=2)
    # 1 GB read at 10 GB/s = 100 ms; 1 token of a 1e6-parameter model is compute-trivial
    assert roofline_ms(10**6, 10**9, 1, machine, "float32") == pytest.approx(100.0)
    # 64 tokens x 2 FLOPs x 1e9 parameters at 100 GFLOP/s = 1280 ms > 100 ms
    assert roofline_ms(10**9, 10**9, 64, machine, "float32") == pytest.approx(1280.0)


def test_bandwidth_is_the_fastest_read_seen():
    """Every probe is a positive rate named by its time; the machine's bandwidth is their
    best (on a CPU with AVX-512, the tile kernel's one-row product is one of them)."""
    import torch

    from specdec.bench.forward_cost import measure_bandwidth, measure_machine
    from specdec.runtime.kernels import f32_tiles_available

    rates = measure_bandwidth(torch.device("cpu"), repeats=1, when="now")
    expected = {"sum now"} | ({"tile product now"} if f32_tiles_available() else set())
    assert set(rates) == expected and all(r > 0 for r in rates.values())
    machine = measure_machine(dtypes=("float32",), repeats=1)
    assert machine.bandwidth_gbs == max(machine.bandwidth_probes.values())
    assert "sum at start" in machine.bandwidth_probes


def test_weight_stats_count_layers_and_lm_head(target):
    params, nbytes = weight_stats(target)
    module = target.model
    expected = module.get_output_embeddings().weight.numel() + sum(
        p.numel() for layer in module.model.layers for p in layer.parameters() if p.dim() == 2
    )
    assert params == expected and nbytes == 4 * expected


def test_exact_plan_names_each_dense_product(target):
    from specdec.bench.forward_cost import exact_plan

    plan = exact_plan(NativeModel(target, exact=True))
    assert set(plan) >= {"qkv", "o", "gate_up", "down"}
    assert all(("rows" in how or "row at a time" in how) for how in plan.values())
    assert exact_plan(target) == {}


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_forward_times_of_a_tiny_model(target, backend):
    model = NativeModel(target) if backend == "native" else target
    times = forward_times(model, tokens=(1, 2, 8), repeats=1, context=16)
    assert len(times) == 3 and all(t > 0 for t in times)


def _fake_result() -> dict:
    def curve(backend, dtype, exact, base):
        times = [base * (1 + 0.1 * i) for i in range(len(TOKENS))]
        return dict(
            backend=backend, dtype=dtype, exact=exact, times_ms=times,
            roofline_ms=[base / 2] * len(TOKENS), kv_bytes_per_token=1024 if exact else None,
            tokens=list(TOKENS), exact_plan={"qkv": "linear, tiles of 16 rows"} if exact else {},
        )  # fmt: skip

    return {
        "machine": {"bandwidth_gbs": 20.0, "peak_gflops": {"float32": 300.0}, "threads": 2},
        "params": 1000,
        "curves": [curve("hf", "float32", False, 50.0), curve("native", "float32", True, 40.0)],
    }


def test_report_tables_and_files(tmp_path):
    result = _fake_result()
    text = report_markdown(result)
    assert "| native float32 exact | 40.0 (1.00x) |" in text
    assert "read bandwidth 20.0 GB/s, GEMM" in text  # no probes recorded: none listed
    result["machine"]["bandwidth_probes"] = {"sum at start": 18.0, "sum at end": 20.0}
    assert "20.0 GB/s (the best of: sum at start 18.0, sum at end 20.0)" in report_markdown(result)
    assert "| hf float32 | 50% of the bound |" in text
    assert "exact decoding step 40.0 ms = 0.80x the fastest non-exact step (50.0 ms)" in text
    assert "1024 bytes per cached token" in text
    assert "native float32 exact, dense products as calibrated: qkv: linear, tiles of 16" in text
    paths = write_forward_cost(tmp_path, result, {"cpu": "test"})
    assert sorted(p.name for p in paths) == [
        "forward_cost.json", "forward_cost.md", "forward_cost.png",
    ]  # fmt: skip
    assert json.loads((tmp_path / "forward_cost.json").read_text())["environment"]["cpu"] == "test"
