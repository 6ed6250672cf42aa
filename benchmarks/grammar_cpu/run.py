"""Grammar engines side by side on this project's tokenizer: llguidance, xgrammar and
outlines-core (the structured-output backends of vLLM, SGLang and llama.cpp).

For each constraint, each engine compiles it, then walks a valid output token by token:
the time to compute the next-token mask at every position (what structured output adds to
each verified row), and whether it allows the next token of the valid output. The masks of
the engines are compared position by position; tokens allowed by one and not another are
listed (special tokens inside a JSON string, non-canonical spellings of forced text).

Needs its own virtual environment (xgrammar pulls in triton):
    python -m venv grammar-venv
    grammar-venv/bin/pip install torch==2.13.0 transformers llguidance xgrammar outlines-core
    grammar-venv/bin/python benchmarks/grammar_cpu/run.py --tokenizer DIR
DIR: the embedded model's tokenizer, e.g. the folder printed by
    .venv/bin/python -c "from specdec.models.loading import *; \
        print(cached_gguf_conversion(embedded_gguf_path('smollm2-135m-instruct')))"
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
CASES = {
    "json_schema": (
        "schema",
        SCHEMA,
        '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"], '
        '"address": {"city": "London", "zip": "12345"}}',
    ),
    "json_object": ("schema", {"type": "object"}, '{"a": [1, 2.5, {"b": null}], "c": "text"}'),
    "regex": ("regex", r"\(\d{3}\) \d{3}-\d{4}", "(555) 123-4567"),
}


def unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w.unsqueeze(1) >> torch.arange(32)) & 1).bool().flatten()[:vocab]


def llguidance_engine(tok, vocab):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    setup = time.perf_counter() - t0

    def start(kind, spec):
        if kind == "schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec))
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        bm = lt.allocate_token_bitmask(1, vocab)

        def mask():
            lt.fill_next_token_bitmask(m, bm, 0)
            return bm[0]

        return mask, lambda t: m.consume_token(t)

    return setup, start


def xgrammar_engine(tok, vocab):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    setup = time.perf_counter() - t0

    def start(kind, spec):
        compiled = (
            compiler.compile_json_schema(json.dumps(spec), any_whitespace=True)
            if kind == "schema"
            else compiler.compile_regex(spec)
        )
        m = xgr.GrammarMatcher(compiled)
        bm = xgr.allocate_token_bitmask(1, vocab)

        def mask():
            m.fill_next_token_bitmask(bm)
            return bm[0]

        return mask, lambda t: m.accept_token(t)

    return setup, start


def outlines_engine(tok, vocab):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    # byte-level token strings -> bytes (GPT-2's byte to unicode table, inverted)
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    to_byte = {chr(c): b for b, c in zip(bs, cs, strict=True)}
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    table: dict = {}
    for text, i in tok.get_vocab().items():
        if i not in special:
            table.setdefault(bytes(to_byte[c] for c in text), []).append(i)
    vocabulary = Vocabulary(tok.eos_token_id, table)
    setup = time.perf_counter() - t0

    def start(kind, spec):
        regex = build_regex_from_schema(json.dumps(spec)) if kind == "schema" else spec
        guide = Guide(Index(regex, vocabulary))
        eos = tok.eos_token_id

        def mask():
            allowed = torch.zeros(((vocab + 31) // 32) * 32, dtype=torch.bool)
            allowed[torch.tensor(guide.get_tokens())] = True
            return allowed

        def advance(t):
            if t != eos:
                guide.advance(t)
            return True

        return mask, advance

    return setup, start


ENGINES = {
    "llguidance": llguidance_engine,
    "xgrammar": xgrammar_engine,
    "outlines-core": outlines_engine,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(tok)
    results: dict = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "vocab": vocab,
        "engines": {},
    }
    masks: dict = {}
    for name, make in ENGINES.items():
        import importlib.metadata as md

        version = md.version(name.replace("-", "_") if name == "outlines-core" else name)
        setup, start = make(tok, vocab)
        entry = {"version": version, "tokenizer_setup_s": setup, "cases": {}}
        for case, (kind, spec, text) in CASES.items():
            ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            t0 = time.perf_counter()
            mask, advance = start(kind, spec)
            compile_s = time.perf_counter() - t0
            times, rejected, rows = [], [], []
            for i, t in enumerate(ids):
                t1 = time.perf_counter()
                m = mask()
                times.append(time.perf_counter() - t1)
                allowed = unpack(m, vocab) if m.dtype != torch.bool else m[:vocab]
                rows.append(allowed)
                if not allowed[t]:
                    rejected.append(i)
                    break
                advance(t)
            masks[(name, case)] = rows
            entry["cases"][case] = {
                "compile_ms": 1e3 * compile_s,
                "mask_ms_median": 1e3 * statistics.median(times),
                "mask_ms_mean": 1e3 * statistics.fmean(times),
                "mask_ms_max": 1e3 * max(times),
                "positions": len(ids),
                "valid_output_accepted": not rejected,
            }
        results["engines"][name] = entry
    diffs: dict = {}
    names = list(ENGINES)
    for case in CASES:
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                ra, rb = masks[(a, case)], masks[(b, case)]
                examples = []
                differ = 0
                for pos, (x, y) in enumerate(zip(ra, rb, strict=False)):
                    if torch.equal(x, y):
                        continue
                    differ += 1
                    if len(examples) < 3:
                        only_a = torch.nonzero(x & ~y).flatten().tolist()[:6]
                        only_b = torch.nonzero(y & ~x).flatten().tolist()[:6]
                        examples.append(
                            {
                                "position": pos,
                                f"only_{a}": tok.convert_ids_to_tokens(only_a),
                                f"only_{b}": tok.convert_ids_to_tokens(only_b),
                            }
                        )
                diffs[f"{case}: {a} vs {b}"] = {
                    "positions_differ": differ,
                    "of": min(len(ra), len(rb)),
                    "examples": examples,
                }
    results["mask_differences"] = diffs
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    lines = [
        "# Grammar engines on SmolLM2's tokenizer (CPU)",
        "",
        f"Machine: {results['machine']}; vocabulary {vocab} tokens. One valid output per "
        "constraint walked token by token (EOS last); mask = the next-token mask of one "
        "position, what structured output adds to each verified row.",
        "",
        "| engine | version | tokenizer setup (s) | constraint | compile (ms) "
        "| mask median (ms) | mask max (ms) | valid output accepted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in results["engines"].items():
        for case, r in entry["cases"].items():
            lines.append(
                f"| {name} | {entry['version']} | {entry['tokenizer_setup_s']:.2f} | {case} | "
                f"{r['compile_ms']:.1f} | {r['mask_ms_median']:.3f} | {r['mask_ms_max']:.2f} | "
                f"{'yes' if r['valid_output_accepted'] else 'NO'} |"
            )
    lines += ["", "## Where the masks differ", ""]
    for key, d in diffs.items():
        examples = json.dumps(d["examples"][:2], ensure_ascii=False)
        lines.append(
            f"- **{key}**: {d['positions_differ']} of {d['of']} positions; e.g. {examples}"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
