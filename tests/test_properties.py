"""Property-based tests over the CLI and API parameter space: every accepted combination
finishes without a traceback, within its budgets, identical to plain decoding when greedy;
every refused one is a clear one-line error (exit status 2 on the command line)."""

from __future__ import annotations

import contextlib
import io
import json
import math
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_model, make_tokenizer
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.cli import main
from specdec.models.native import NativeModel

# Valid values, extremes included: every combination of these must work.
OK_TEMPERATURES = [0.0, 0.0, 5e-324, 1e-40, 1e-5, 0.7, 1.0, 1e30, 1e308]
OK_TOP_P = [1.0, 0.9, 1e-300]
OK_TOP_K = [0, -1, 1, 5, 10**12]
OK_SEEDS = [None, 0, 3, 2**63 - 1, -1, -(2**63)]
OK_MAX_NEW = [1, 2, 7, 40, 10**9]
OK_K = [1, 3, 8, 64]  # 64: the most num_speculative_tokens takes
#: The largest dynamic tree: valid, but each step expands thousands of nodes (with
#: ``ngram:min_n=1,max_n=1000000`` a 128-token generation took over 10 minutes).
HUGE_TREE = "dynamic:top_k=64,depth=128,budget=1024"
OK_TREES = [
    None,
    "static:tree-8",
    "dynamic:top_k=2,depth=4,budget=6",
    HUGE_TREE,
    "best-first:budget=16,depth=6",
    "sequoia:budget=8,depth=4",
    "sequoia:budget=128,depth=128",
]
OK_NGRAM = [(2, 4), (1, 1), (1, 10**6)]
OK_STOPS = ["w5", "w6 w7", "x" * 1024, "\ufffd", "w"]
# Invalid values, mixed in by the second strategy.
BAD = {
    "temperature": [-1.0, math.nan, math.inf],
    "top_p": [0.0, 1.5, math.nan],
    "top_k": [-2],  # -1 is vLLM's "disabled"
    "seed": [2**63, -(2**63) - 1],
    "max_new": [0, -3],
    "k": [0, -1],
    "method": ["bogus"],
    "tree": ["dynamic:top_k=0,depth=4,budget=6", "dynamic:top_k=4,depth=4,budget=5000", "x"],
    "ngram": [(3, 2), (0, 4)],
    "stops": [[""], ["x" * 2000], ["w"] * 65],
    "backend": ["tpu"],
}


@st.composite
def valid_settings(draw) -> dict:
    method = draw(st.sampled_from(["none", "ngram", "draft-model"]))
    tree = None if method == "none" else draw(st.sampled_from(OK_TREES))
    if tree is not None and method == "draft-model" and draw(st.booleans()):
        tree = "static:chain-3,draw=iid"  # sampled children need a draft distribution
    max_new = draw(st.sampled_from(OK_MAX_NEW))
    if tree == HUGE_TREE:  # up to 64 x 64 expansions per level and step: keep it to 2 steps
        max_new = min(max_new, 2)
    return dict(
        temperature=draw(st.sampled_from(OK_TEMPERATURES)),
        top_p=draw(st.sampled_from(OK_TOP_P)),
        top_k=draw(st.sampled_from(OK_TOP_K)),
        seed=draw(st.sampled_from(OK_SEEDS)),
        max_new=max_new,
        k=draw(st.sampled_from(OK_K)),
        method=method,
        tree=tree,
        ngram=draw(st.sampled_from(OK_NGRAM)),
        stops=draw(st.lists(st.sampled_from(OK_STOPS), max_size=3)),
        backend=draw(st.sampled_from(["hf", "native", "auto"])),
        exact=draw(st.booleans()),
    )


@st.composite
def any_settings(draw) -> dict:
    """Valid settings with one to three values replaced by invalid ones."""
    settings_ = draw(valid_settings())
    for key in draw(st.lists(st.sampled_from(sorted(BAD)), min_size=1, max_size=3)):
        settings_[key] = draw(st.sampled_from(BAD[key]))
        if key == "ngram":  # n-gram sizes are the ngram drafter's options
            settings_["method"] = "ngram"
    return settings_


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    hf = make_model(make_tokenizer(), seed=0)
    path = tmp_path_factory.mktemp("props") / "tiny"
    hf.model.save_pretrained(path)
    hf.tokenizer.hf.save_pretrained(path)
    return path


def _method(c: dict) -> str:
    """The drafter spec: ngram carries its n-gram sizes."""
    if c["method"] != "ngram":
        return c["method"]
    return f"ngram:min_n={c['ngram'][0]},max_n={c['ngram'][1]}"


def _run_cli(model_dir, c: dict) -> tuple[int, str, str]:
    argv = ["generate", "w5 w6 w7 w5 w6", "--model", str(model_dir), "--json", "--compare"]
    argv += [f"--temperature={c['temperature']!r}", f"--top-p={c['top_p']!r}"]
    argv += [f"--top-k={c['top_k']}", f"--max-new-tokens={c['max_new']}"]
    argv += [f"--num-speculative-tokens={c['k']}", f"--drafter={_method(c)}"]
    if c["method"] == "draft-model":
        argv += ["--draft-model", str(model_dir)]
    if c["seed"] is not None:
        argv += [f"--seed={c['seed']}"]
    if c["tree"] is not None:
        argv += [f"--tree={c['tree']}"]
    argv += [f"--stop={stop}" for stop in c["stops"]]
    argv += [f"--backend={c['backend']}", "--exact" if c["exact"] else "--no-exact"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse refusing a value
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def _check_output(record: dict, c: dict) -> None:
    assert 1 <= len(record["token_ids"]) <= c["max_new"]
    assert not record["text"].endswith("\ufffd")
    if c["temperature"] == 0 and (c["backend"] == "hf" or c["exact"]):
        assert record["identical"] is True


CLI_SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@CLI_SETTINGS
@given(c=valid_settings())
def test_cli_runs_every_valid_combination(model_dir, c):
    code, out, err = _run_cli(model_dir, c)
    assert code == 0, err
    _check_output(json.loads(out), c)


@CLI_SETTINGS
@given(c=any_settings())
def test_cli_refuses_invalid_values_in_one_line(model_dir, c):
    code, _, err = _run_cli(model_dir, c)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("specdec: error:"), err


def _generate(api, c: dict, prompt):
    params = SamplingParams(
        temperature=c["temperature"], top_p=c["top_p"], top_k=c["top_k"], seed=c["seed"],
        max_new_tokens=c["max_new"], stop=tuple(c["stops"]),
    )  # fmt: skip
    spec = SpeculativeConfig(method=_method(c), num_speculative_tokens=c["k"], tree=c["tree"])
    llm = LLM(api.target, draft=api.draft, speculative=spec, backend=c["backend"])
    return llm.generate(prompt, params), params


@settings(max_examples=60, deadline=None)
@given(c=valid_settings(), prompt=st.lists(st.integers(0, 31), min_size=1, max_size=127))
def test_api_runs_every_valid_combination(api, c, prompt):
    out, params = _generate(api, c, prompt)
    target = api.target
    assert 1 <= len(out.token_ids) <= c["max_new"]
    assert len(prompt) + len(out.token_ids) <= target.max_context
    assert all(0 <= t < target.vocab_size for t in out.token_ids)
    if c["temperature"] == 0:
        plain = LLM(api.target, speculative=SpeculativeConfig(method="none"))
        plain = plain.generate(prompt, params)
        assert out.token_ids == plain.token_ids


@settings(max_examples=60, deadline=None)
@given(
    c=st.one_of(any_settings(), valid_settings()),
    prompt=st.sampled_from([[], [1] * 128, [1] * 500, [1, 10**6], [1, -1], [1, 5, 6]]),
)
def test_api_refuses_invalid_input_in_one_line(api, c, prompt):
    with pytest.raises(ValueError) as error:
        _generate(api, c, prompt)
        if prompt == [1, 5, 6]:  # the prompt is fine: then a setting must be bad
            raise ValueError("no invalid value was drawn")
    assert str(error.value) and "\n" not in str(error.value)


@pytest.fixture(scope="module", params=["hf", "native"])
def api(request, target, near_draft):
    if request.param == "native":
        target, near_draft = NativeModel(target), NativeModel(near_draft)
    return SimpleNamespace(target=target, draft=near_draft)
