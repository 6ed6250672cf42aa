"""End-to-end tests of ``specdec generate`` (``specdec.cli.main``) on a tiny saved model."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest
import torch

from specdec import LLM
from specdec.cli import main

#: With the seed-0 tiny model this prompt gives 20 greedy tokens with no EOS and a repeating
#: tail ("w16 w2 w16 w2 ..."), so the n-gram drafter gets accepted drafts.
PROMPT = "w20 w9 w11"
MAX_NEW = "20"

METRIC_KEYS = {
    "num_steps",
    "num_draft_tokens",
    "num_accepted_tokens",
    "acceptance_rate",
    "mean_acceptance_length",
    "per_position_acceptance_rate",
    "elapsed_s",
    "tokens_per_s",
    "decode_tokens_per_s",
    "prefill_s",
}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return tiny_model_dir


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop anything printed before
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_text(capsys, model_dir: str, *args: str) -> tuple[int, str, str]:
    """``generate PROMPT`` on the tiny model in text (streaming) mode."""
    return run_cli(
        capsys, "generate", PROMPT, "--model", model_dir, "--max-new-tokens", MAX_NEW, *args
    )


def run_json(capsys, model_dir: str, *args: str, prompt: str = PROMPT) -> dict:
    code, out, err = run_cli(
        capsys,
        "generate",
        prompt,
        "--model",
        model_dir,
        "--max-new-tokens",
        MAX_NEW,
        "--json",
        *args,
    )
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out  # exactly one JSON object, nothing else on stdout
    record = json.loads(lines[0])
    assert isinstance(record, dict)
    return record


def test_json_compare_ngram(capsys, model_dir):
    record = run_json(capsys, model_dir, "--compare", "--drafter", "ngram")
    assert {
        "text",
        "token_ids",
        "finish_reason",
        "metrics",
        "baseline",
        "speedup",
        "identical",
    } <= record.keys()
    assert record["metrics"].keys() >= METRIC_KEYS
    assert {"text", "token_ids", "elapsed_s", "tokens_per_s"} <= record["baseline"].keys()
    # the speed after the prompt (its prefill left out), for long prompts
    assert {"prefill_s", "decode_tokens_per_s"} <= record["baseline"].keys()
    assert record["decode_speedup"] == pytest.approx(
        record["metrics"]["decode_tokens_per_s"] / record["baseline"]["decode_tokens_per_s"]
    )

    ids = record["token_ids"]
    assert 1 <= len(ids) <= 20
    assert all(isinstance(t, int) for t in ids)
    assert record["finish_reason"] in ("stop", "length")
    assert record["prompt_tokens"] >= 1  # how long the prompt was, chat template included
    # the native kernels' instruction set (null on transformers)
    native = ("avx512", "avx2", "portable")
    assert record["simd"] in ((None,) if record["backend"] == "hf" else native)
    # the dense products' formulation(s) on the native backend (null on transformers)
    from specdec.runtime.linear import FORMULATIONS

    dense = record["dense_kernel"]
    assert (
        dense is None if record["backend"] == "hf" else set(dense.split(",")) <= set(FORMULATIONS)
    )
    # where the prompt's arithmetic changes (a native target's prefill plan; null on hf)
    plan = record["prefill_plan"]
    assert plan is None if record["backend"] == "hf" else "quantized_to" in plan
    assert plan is None or "times_ms" not in plan
    assert record["text"]  # this prompt produces real words
    assert record["identical"] is True
    assert record["baseline"]["token_ids"] == ids
    assert record["baseline"]["text"] == record["text"]
    assert isinstance(record["speedup"], float) and record["speedup"] > 0

    m = record["metrics"]
    assert m["num_steps"] >= 1
    assert 0 <= m["num_accepted_tokens"] <= m["num_draft_tokens"]
    assert 0.0 <= m["acceptance_rate"] <= 1.0
    assert m["mean_acceptance_length"] >= 1.0
    assert m["elapsed_s"] > 0 and m["tokens_per_s"] > 0
    # The repeating tail of this output is found by prompt lookup: some drafts are accepted,
    # so fewer steps than tokens.
    assert m["num_accepted_tokens"] > 0
    assert m["num_steps"] < len(ids)


def test_text_output_with_metrics(capsys, model_dir):
    expected = run_json(capsys, model_dir)["text"]
    code, out, err = run_text(capsys, model_dir, "--compare")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == expected  # the streamed text comes first, then the metrics
    assert lines[1] == "-" * 60
    assert "{" not in out  # not JSON
    for label in (
        "finish reason",
        "tokens / steps",
        "mean acceptance length",
        "acceptance rate",
        "steps with a draft",
        "per-position acceptance",
        "time",
        "autoregressive baseline",
        "speedup",
    ):
        assert any(line.startswith(label) for line in lines[2:]), label
    assert "identical to baseline    yes" in lines
    # the baseline's decoding speed beside ours, which "after the prompt" gives
    ours = next(line for line in lines if line.startswith("after the prompt"))
    base = next(line for line in lines if line.startswith("autoregressive baseline"))
    assert ours.endswith("tokens/s") and base.endswith("after the prompt)")


def test_text_output_without_compare_has_no_baseline(capsys, model_dir):
    code, out, err = run_text(capsys, model_dir)
    assert code == 0, err
    assert "mean acceptance length" in out
    assert "speedup" not in out
    assert "identical to baseline" not in out


def test_drafter_none(capsys, model_dir):
    reference = run_json(capsys, model_dir)
    record = run_json(capsys, model_dir, "--drafter", "none", "--compare")
    assert record["token_ids"] == reference["token_ids"]
    assert record["identical"] is True
    m = record["metrics"]
    assert m["num_draft_tokens"] == 0
    assert m["num_steps"] == len(record["token_ids"])  # one token per step


def test_drafter_draft_model_same_dir(capsys, model_dir):
    reference = run_json(capsys, model_dir)
    record = run_json(
        capsys, model_dir, "--drafter", "draft-model", "--draft-model", model_dir, "--compare"
    )
    assert record["identical"] is True
    assert record["token_ids"] == reference["token_ids"]
    assert record["baseline"]["token_ids"] == record["token_ids"]
    assert record["draft_model"] == record["model"] and record["model"]  # names what ran
    assert reference["draft_model"] is None
    m = record["metrics"]
    # The draft is the target itself: every greedy draft token is accepted.
    assert m["num_draft_tokens"] > 0
    assert m["num_accepted_tokens"] == m["num_draft_tokens"]
    assert m["num_steps"] < len(record["token_ids"])


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--num-speculative-tokens", "0"], "--num-speculative-tokens"),
        (["--drafter", "draft-model"], "draft"),  # no --draft-model given
        (["--device", "bogus"], "device"),
        (["--dtype", "float8"], "--dtype: unknown dtype 'float8'"),
        (["--draft-dtype", "float8"], "--draft-dtype: unknown dtype"),
        (["--seed", "99999999999999999999999"], "seed"),
        (["--drafter", "ngram", "--draft-model", "x"], "--draft-model is only used"),
        (["--demo-prompt"], "not both"),
        (["--tree", "bushy:budget=3"], "unknown tree kind"),
        (["--tree", "dynamic:budget=0"], "integer >= 1"),
        (["--tree", "static:tree-8,draw=iid"], "draw=iid"),
        (["--drafter", "none", "--tree", "static:tree-8"], "needs a drafter"),
        (["--repetition-penalty", "0"], "--repetition-penalty"),
        (["--presence-penalty", "3"], "--presence-penalty"),
        (["--min-p", "2"], "--min-p"),
        (["--min-tokens", "100000"], "--min-tokens"),
        (["--logit-bias", "5"], "ID=BIAS"),
        (["--logit-bias", "x=1"], "ID=BIAS"),
        (["--logit-bias", "5=500"], "--logit-bias value"),
        (["--logit-bias", "999999=1"], "outside the vocabulary"),
        (["--verifier", "block", "--tree", "static:tree-8"], "verifies chains"),
        (["--json-schema", "[1]"], "--json-schema: a JSON schema must be a JSON object"),
        (["--json-schema", "@/no/such/schema.json"], "--json-schema: cannot read"),
        (["--choice", "yes", "--regex", "y"], "one output constraint, got --regex, --choice"),
        (["--regex", ""], "--regex: regex must be a non-empty string"),
        (["--regex", "w1"], "byte-level"),  # the tiny model's tokenizer is word-level
        (["--bad-word", ""], "bad_words must be non-empty strings"),
    ],
)
def test_bad_option_values(capsys, model_dir, args, fragment):
    code, out, err = run_cli(capsys, "generate", PROMPT, "--model", model_dir, *args)
    assert code == 2
    assert err.startswith("specdec: error:")
    assert fragment in err
    assert "Traceback" not in err
    assert out == ""


def test_empty_prompt(capsys, model_dir):
    code, _, err = run_cli(capsys, "generate", "", "--model", model_dir)
    assert code == 2
    assert err.startswith("specdec: error:")
    assert "empty" in err


def test_missing_prompt(capsys, model_dir):
    code, _, err = run_cli(capsys, "generate", "--model", model_dir)
    assert code == 2
    assert err.startswith("specdec: error:")
    assert "PROMPT" in err


def test_prompt_longer_than_context(capsys, model_dir, monkeypatch):
    """Refused once the tokenizer has counted it, before the warm-up runs any forward
    (a long prompt's first chunk took seconds to warm up only to be refused)."""
    from specdec import cli

    warmed = []
    monkeypatch.setattr(cli, "_warm_up", lambda *a: warmed.append(a))
    prompt = " ".join(f"w{i % 29}" for i in range(200))  # the tiny model holds 128 tokens
    code, out, err = run_cli(capsys, "generate", prompt, "--model", model_dir)
    assert code == 2
    assert err.startswith("specdec: error:")
    assert "128" in err
    assert out.strip() == ""
    assert warmed == []


def test_missing_model_path(capsys, tmp_path):
    # Desired behaviour: a clear error and exit code 2, not a traceback. (transformers
    # raises OSError for a path that does not exist, which the CLI must report too.)
    missing = tmp_path / "no-such-model"
    code, _, err = run_cli(capsys, "generate", PROMPT, "--model", str(missing))
    assert code == 2
    assert err.startswith("specdec: error:")
    assert "no-such-model" in err


def test_unknown_drafter_rejected_by_argparse(capsys, model_dir):
    with pytest.raises(SystemExit) as info:
        main(["generate", PROMPT, "--model", model_dir, "--drafter", "foo"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--drafter" in err and "foo" in err


def test_stop_string(capsys, model_dir):
    reference = run_json(capsys, model_dir)
    text = reference["text"]
    words = text.split()
    assert len(words) >= 10
    stop = words[len(words) // 2]  # a word from the middle of the output
    cut = text.index(stop)
    assert cut > 0

    record = run_json(capsys, model_dir, "--stop", stop)
    assert record["finish_reason"] == "stop"
    assert stop not in record["text"]
    assert record["text"] == text[:cut]  # nothing after the stop string either
    ids = record["token_ids"]
    assert len(ids) < len(reference["token_ids"])
    assert ids == reference["token_ids"][: len(ids)]

    # Streaming (text) output is cut at the same place.
    code, out, err = run_cli(
        capsys,
        "generate",
        PROMPT,
        "--model",
        model_dir,
        "--max-new-tokens",
        MAX_NEW,
        "--stop",
        stop,
    )
    assert code == 0, err
    assert out.split("\n" + "-" * 60)[0] == text[:cut]


def test_seed_makes_sampling_reproducible(capsys, model_dir):
    def sample(seed: int) -> list[int]:
        record = run_json(capsys, model_dir, "--temperature", "1.0", "--seed", str(seed))
        return record["token_ids"]

    first = sample(7)
    assert sample(7) == first
    # Sampling really is random: other seeds give other outputs.
    others = [sample(seed) for seed in (1, 2, 3)]
    assert any(ids != first for ids in others)


@pytest.mark.parametrize("line_end", ["", "\n", "\r\n"])
def test_prompt_from_stdin(capsys, model_dir, monkeypatch, line_end):
    """``echo PROMPT | specdec generate -`` asks what ``specdec generate PROMPT`` asks: one
    final line end (echo's, an editor's) is not part of the prompt."""
    reference = run_json(capsys, model_dir)
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT + line_end))
    record = run_json(capsys, model_dir, prompt="-")
    assert record["token_ids"] == reference["token_ids"]
    assert record["text"] == reference["text"]
    assert record["prompt_tokens"] == reference["prompt_tokens"]


def test_stdin_prompt_differs_from_literal_dash(capsys, model_dir, monkeypatch):
    # '-' must read stdin, not be used as the prompt text: an empty stdin is an empty prompt.
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, _, err = run_cli(capsys, "generate", "-", "--model", model_dir)
    assert code == 2
    assert "empty" in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA is available here")
def test_unavailable_cuda_is_a_clear_error_without_loading(capsys, model_dir):
    code, _, err = run_cli(capsys, "generate", PROMPT, "--model", model_dir, "--device", "cuda")
    assert code == 2 and "CUDA is not available" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_unavailable_draft_device_is_a_clear_error_without_loading(capsys, model_dir):
    code, _, err = run_cli(
        capsys, "generate", PROMPT, "--model", model_dir, "--draft-model", model_dir,
        "--draft-device", "cuda",
    )  # fmt: skip
    assert code == 2 and "Traceback" not in err
    assert "--draft-device 'cuda' requested but CUDA is not available" in err
    code, _, err = run_cli(
        capsys, "generate", PROMPT, "--model", model_dir, "--draft-model", model_dir,
        "--draft-device", "gpu0",
    )  # fmt: skip
    assert code == 2 and "invalid --draft-device 'gpu0': use cpu, cuda, cuda:N or mps" in err
    code, _, err = run_cli(
        capsys, "generate", PROMPT, "--model", model_dir, "--drafter", "ngram",
        "--draft-device", "cpu",
    )  # fmt: skip
    assert code == 2 and "--draft-device places --draft-model" in err
    with pytest.raises(ValueError, match="invalid draft_device 'gpu0'"):
        LLM(model_dir, draft=model_dir, draft_device="gpu0")


def test_draft_model_option_implies_draft_model_drafter(capsys, model_dir):
    record = run_json(capsys, model_dir, "--draft-model", model_dir)
    m = record["metrics"]
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] == m["num_draft_tokens"]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("specdec ")


def test_tree_json_and_text(capsys, model_dir):
    chain = run_json(capsys, model_dir, "--drafter", "ngram")
    record = run_json(capsys, model_dir, "--tree", "dynamic:top_k=3,depth=4,budget=8", "--compare")
    assert record["tree"] == "dynamic:top_k=3,depth=4,budget=8"
    assert record["identical"] is True and record["token_ids"] == chain["token_ids"]
    assert sum(record["metrics"]["accepted_length_counts"]) == record["metrics"]["num_steps"]
    code, out, err = run_text(capsys, model_dir, "--tree", "static:tree-8")
    assert code == 0, err
    assert "accepted depth histogram" in out and "per-depth acceptance" in out


def test_int8_draft_of_the_target(capsys, model_dir):
    """--draft-dtype int8-dynamic: a quantized copy drafts; output is still the target's."""
    record = run_json(
        capsys,
        model_dir,
        "--draft-model",
        model_dir,
        "--draft-dtype",
        "int8-dynamic",
        "--tree",
        "static:tree-8",
        "--compare",
    )
    assert record["identical"] is True
    assert record["metrics"]["num_accepted_tokens"] > 0


def test_unknown_hub_model_is_one_quick_line(capsys):
    assert main(["generate", "hi", "--model", "specdec-tests/no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: cannot load model") and err.count("\n") == 1


def test_draft_dtype_is_checked_without_a_draft(capsys, tmp_path):
    missing = str(tmp_path / "no-model")  # never loaded: the error comes first
    assert main(["generate", "hi", "--model", missing, "--draft-dtype", "int4"]) == 2
    assert "int4" in capsys.readouterr().err


@pytest.mark.parametrize("drafter", ["layer-skip", "sparse-kv", "quantized:kernel=q8"])
def test_self_drafts_on_transformers_are_refused_before_loading(capsys, tmp_path, drafter):
    missing = str(tmp_path / "no-model")  # never loaded: the error comes first
    args = ["generate", "hi", "--model", missing, "--backend", "hf", "--drafter", drafter]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--drafter {drafter.split(':')[0]} needs the native backend" in err
    assert "no-model" not in err


def test_sampling_transform_flags_apply_and_stay_lossless(capsys, model_dir):
    """The penalty and bias flags change the output, and speculation (with --compare's
    plain baseline) keeps it identical."""
    plain = run_json(capsys, model_dir, "--drafter", "none")
    args = ("--repetition-penalty", "1.8", "--frequency-penalty", "0.5", "--logit-bias", "7=2")
    shaped = run_json(capsys, model_dir, "--compare", "--drafter", "ngram", *args)
    assert shaped["identical"] is True
    assert shaped["token_ids"] != plain["token_ids"]
    block = run_json(capsys, model_dir, "--drafter", "ngram", "--verifier", "block", *args)
    assert block["token_ids"] == shaped["token_ids"]


def _fake_output(
    tokens: list[int], seconds: float, steps_off: int = 0, prefill: float = 0.0, drafted: int = 4
):
    from types import SimpleNamespace

    from specdec.metrics import SpecStats

    metrics = SpecStats(
        verifier="rejection", num_output_tokens=len(tokens), num_steps=len(tokens),
        chosen_k_counts=[3, 1], num_steps_off=steps_off, elapsed_s=seconds, prefill_s=prefill,
        num_draft_tokens=drafted,
    )  # fmt: skip
    return SimpleNamespace(
        metrics=metrics, finish_reason="length", token_ids=tokens, prompt_token_ids=[5] * 700
    )


def test_the_ran_on_line_names_the_weights_and_their_kernels():
    from specdec.cli_common import describe_target

    meta = {"backend": "native", "dtype": "bfloat16", "exact": True, "quantization": "none",
            "quant_kernel": None, "dense_kernel": "dpbf16", "simd": "avx512",
            "threads": 2}  # fmt: skip
    assert describe_target(meta) == (
        "native backend (AVX-512 kernels), bfloat16, exact, dense weights (dpbf16 products), "
        "2 threads"
    )
    meta.update(quantization="gguf", quant_kernel="q8", dense_kernel="f32_tiles")
    assert "gguf weights (q8 kernel) (f32_tiles dense products)" in describe_target(meta)
    meta.update(backend="hf", quantization="int8-dynamic", quant_kernel=None, dense_kernel=None)
    assert "float32" not in describe_target(meta) and "int8-dynamic weights," in (
        describe_target(meta)
    )


def test_compare_says_what_a_short_run_or_a_differing_output_means(capsys):
    """A speedup over a few tokens is called timing noise; a greedy output that differs
    without exact mode says why and what keeps it identical; "speculation off" is printed
    only when the controller switched it off."""
    from specdec import SamplingParams
    from specdec.cli import NOISY_TOKENS, _print_metrics

    meta = {"backend": "hf", "dtype": "bfloat16", "exact": False, "quantization": "none",
            "quant_kernel": None, "simd": None, "threads": 1}  # fmt: skip
    short, other = _fake_output([1, 2, 3], 0.1), _fake_output([1, 2, 4], 0.2)
    _print_metrics(short, other, SamplingParams(), None, meta)
    out = capsys.readouterr().out
    assert "speedup                  2.00x (only 3 tokens: timing noise)" in out
    assert "identical to baseline    NO" in out and "`--backend native`" in out
    assert "speculation off" not in out
    long = list(range(NOISY_TOKENS))
    _print_metrics(_fake_output(long, 0.1, 1), _fake_output(long, 0.1), SamplingParams(),
                   None, {**meta, "exact": True})  # fmt: skip
    out = capsys.readouterr().out
    assert "speedup                  1.00x\n" in out and "timing noise" not in out
    assert "identical to baseline    yes" in out and "`--backend native`" not in out
    assert "speculation off          1 of 4 steps" in out
    assert "speedup after the prompt" not in out  # no prefill in these runs
    # sampled runs can differ in length: both counts, the baseline's named
    _print_metrics(_fake_output([1, 2, 3], 0.1), _fake_output([1, 2], 0.1),
                   SamplingParams(temperature=0.8), None, meta)  # fmt: skip
    assert "(only 3 and 2 (baseline) tokens: timing noise)" in capsys.readouterr().out
    # a drafter that proposed nothing (sparse-kv below its min_context): no speedup to read
    _print_metrics(_fake_output(long, 0.087, drafted=0), _fake_output(long, 0.1),
                   SamplingParams(), None, {**meta, "exact": True})  # fmt: skip
    out = capsys.readouterr().out
    assert "speedup                  1.15x (nothing was drafted: the difference is timing" in out


def test_compare_on_a_long_prompt_says_the_speedup_after_the_prompt(capsys):
    """When the prompt's prefill takes a good share of the time (a long prompt), the text
    output says how long it took and the speedup of what follows it."""
    from specdec import SamplingParams
    from specdec.cli import _print_metrics

    long = list(range(64))
    spec = _fake_output(long, 1.2, prefill=1.0)  # 64 tokens in 0.2 s after the prompt
    plain = _fake_output(long, 1.4, prefill=1.0)  # in 0.4 s
    _print_metrics(spec, plain, SamplingParams())
    out = capsys.readouterr().out
    assert "prompt                   700 tokens, first token after 1.00 s" in out
    assert "after the prompt         320.0 tokens/s" in out
    assert "speedup                  1.17x\n" in out
    assert "speedup after the prompt 2.00x (the prompt's prefill took 83% of the time)" in out


def test_generate_prints_which_drafter_each_hybrid_step_chose(capsys, model_dir):
    code, out, _ = run_cli(
        capsys, "generate", PROMPT, "--model", model_dir, "--drafter", "hybrid:model=ngram",
        "--max-new-tokens", "12",
    )  # fmt: skip
    assert code == 0
    assert "hybrid model drafter     ngram" in out.splitlines()  # which model drafter ran
    line = next(x for x in out.splitlines() if x.startswith("draft sources"))
    suffix, model = (int(x) for x in re.findall(r"(?:suffix|model) (\d+)", line))
    assert suffix + model >= 1
    code, out, _ = run_cli(
        capsys, "generate", PROMPT, "--model", model_dir, "--drafter", "hybrid:model=ngram",
        "--max-new-tokens", "12", "--json",
    )  # fmt: skip
    record = json.loads(out.strip().splitlines()[-1])
    sources, metrics = record["metrics"]["draft_sources"], record["metrics"]
    assert set(sources) <= {"suffix", "model"}  # this request's steps, not the drafter's
    assert metrics["num_drafts"] <= sum(sources.values()) <= metrics["num_steps"]
    assert record["drafter_options"]["model"] == record["hybrid_model"] == "ngram"
