"""A/B: decoding layers of amx products in one call (fused) vs from Python, same process, interleaved."""
import sys, time, torch, json
from specdec.models.loading import load, with_backend
from specdec.runtime import model as rm
res = {}
for quant in ("none", "gguf"):
    m = with_backend(load("smollm2-135m-instruct", "bfloat16", "cpu"), "native", True, quant)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 40000, (128,), generator=gen).tolist()
    cache = m.new_cache(300); m.forward(prefix, cache, num_logits=1)
    def step(t):
        m.forward(torch.randint(3, 40000, (t,), generator=gen).tolist(), cache); cache.truncate(128)
    for t in (1, 5, 16):
        samples = {True: [], False: []}
        for rep in range(25):
            for on in (True, False):
                rm.FUSED_DECODE_LAYER = on
                s = time.perf_counter(); step(t); samples[on].append((time.perf_counter() - s) * 1e3)
        med = {on: sorted(v[3:])[len(v[3:]) // 2] for on, v in samples.items()}
        res[f"{quant} T={t}"] = {"fused_ms": med[True], "python_ms": med[False]}
        print(quant, "T", t, "fused %.2f ms, python %.2f ms, %.2fx" % (med[True], med[False], med[False] / med[True]), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
