"""A/B in one process: the decoding layers of ``amx`` products in one call into the
extension (``FUSED_DECODE_LAYER`` on) against the same layers run from Python (off),
alternated step by step; exact mode, bfloat16, 128 cached tokens, median of 22 steps.

    .venv/bin/python benchmarks/forward_cost_cpu/xeon_amx_2026_12_06/ab_fused.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch

from specdec.models.loading import load, with_backend
from specdec.runtime import model as runtime_model


def main(path: str) -> None:
    results = {}
    for quantization in ("none", "gguf"):
        model = with_backend(load("smollm2-135m-instruct", "bfloat16", "cpu"), "native", True,
                             quantization)  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        prefix = torch.randint(3, 40000, (128,), generator=gen).tolist()
        cache = model.new_cache(300)
        model.forward(prefix, cache, num_logits=1)
        for rows in (1, 5, 16):
            samples: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(25):
                for fused in (True, False):
                    runtime_model.FUSED_DECODE_LAYER = fused
                    new = torch.randint(3, 40000, (rows,), generator=gen).tolist()
                    start = time.perf_counter()
                    model.forward(new, cache)
                    samples[fused].append((time.perf_counter() - start) * 1e3)
                    cache.truncate(128)
            med = {k: sorted(v[3:])[len(v[3:]) // 2] for k, v in samples.items()}
            results[f"{quantization} T={rows}"] = {"fused_ms": med[True], "python_ms": med[False]}
            print(f"{quantization} T={rows}: fused {med[True]:.2f} ms, python {med[False]:.2f} ms, "
                  f"{med[False] / med[True]:.2f}x", flush=True)  # fmt: skip
    runtime_model.FUSED_DECODE_LAYER = True
    with open(path, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
