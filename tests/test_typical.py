"""Typical acceptance (Medusa-2): a LOSSY verifier, opt-in only, labelled lossy.

Oracles: the exact output law of one production step (through the engine's verify seam)
against an independent reference of the rule, and against the target's law, which it
must NOT equal (the verifier is tested to be lossy); greedy decoding stays exact; the
opt-in is enforced and the label reaches the stats, the CLI and the server.
"""

from __future__ import annotations

import math

import httpx
import pytest
from test_engine import PROMPTS
from test_transforms import Transformed, chain_law

from conftest import make_server_llm, uvicorn_thread
from exact_laws import Synthetic, _chain_draws, _extend, target_sequences, worst_error
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.config import TypicalOptions
from specdec.server import create_app

PARAMS = SamplingParams(temperature=1.0)
VERIFIER = "typical:epsilon=0.3,delta=0.5"
OPTIONS = TypicalOptions(epsilon=0.3, delta=0.5)


def production_law(model: Transformed, k: int, mode: str) -> dict:
    """First k + 1 tokens: drafts, one production step with the typical verifier, then
    plain target sampling."""
    return chain_law(model, k, mode, verifier=VERIFIER)


def reference_law(model: Synthetic, k: int, mode: str) -> dict:
    """The rule written out: accept while p_i(x_i) > min(eps, delta e^{-H(p_i)}), then
    draw from p at the first unaccepted row."""
    total: dict = {}
    for drafts, prob in _chain_draws(model, k, mode):
        accepted = 0
        for i in range(k):
            p = model.p(drafts[:i])
            entropy = -sum(float(x) * math.log(float(x)) for x in p if x > 0)
            if float(p[drafts[i]]) > min(OPTIONS.epsilon, OPTIONS.delta * math.exp(-entropy)):
                accepted += 1
            else:
                break
        p = model.p(drafts[:accepted])
        step = {tuple(drafts[:accepted]) + (y,): float(p[y]) for y in range(model.vocab)}
        _extend(model, step, k + 1, prob, total)
    return total


@pytest.mark.parametrize("mode", ["iid", "deterministic"])
def test_the_law_is_the_typical_rule_and_not_the_target(mode):
    lossy = 0.0
    for seed in range(3):
        # deterministic drafts: the target's own argmax, so the rule accepts it
        model = Transformed(seed, "peaked" if mode == "iid" else "identical", PARAMS)
        got = production_law(model, 2, mode)
        assert worst_error(got, reference_law(model, 2, mode)) < 1e-6
        lossy = max(lossy, worst_error(got, target_sequences(model, (), 3)))
    assert lossy > 1e-2  # lossy, as labelled


def test_the_lossy_verifier_needs_an_opt_in():
    with pytest.raises(ValueError, match="lossy.*allow_lossy"):
        SpeculativeConfig("ngram", verifier="typical")
    with pytest.raises(ValueError, match="verifies chains"):
        SpeculativeConfig("ngram", verifier="typical", allow_lossy=True, tree="static:tree-8")
    with pytest.raises(ValueError, match="epsilon must be in"):
        SpeculativeConfig("ngram", verifier="typical:epsilon=0", allow_lossy=True)
    with pytest.raises(ValueError, match="takes epsilon=E and delta=D"):
        SpeculativeConfig("ngram", verifier="typical:alpha=1", allow_lossy=True)
    with pytest.raises(ValueError, match="takes no options"):
        SpeculativeConfig("ngram", verifier="block:x=1")
    config = SpeculativeConfig("ngram", verifier="typical:delta=0.2", allow_lossy=True)
    assert config.lossy and not SpeculativeConfig("ngram").lossy


def test_greedy_stays_exact_and_sampled_output_is_labelled(target, near_draft):
    spec = SpeculativeConfig("draft-model", 4, verifier=VERIFIER, allow_lossy=True)
    llm = LLM(target, draft=near_draft, speculative=spec)
    greedy = SamplingParams(max_new_tokens=20)
    plain = llm.generate(PROMPTS[0], greedy, speculative=SpeculativeConfig("none"))
    out = llm.generate(PROMPTS[0], greedy)
    assert out.token_ids == plain.token_ids and not out.metrics.lossy
    assert out.metrics.verifier == "greedy"  # what checked it, not the configured verifier
    sampled = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=20, temperature=1.0, seed=1))
    assert sampled.metrics.lossy and sampled.metrics.verifier == VERIFIER
    assert sampled.metrics.to_dict()["lossy"] is True


def test_the_cli_says_lossy(capsys, tiny_model_dir):
    from specdec.cli import main

    args = ["generate", "w1 w2 w3", "--model", tiny_model_dir, "--max-new-tokens", "6",
            "--temperature", "1", "--verifier", "typical", "--backend", "hf"]  # fmt: skip
    assert main(args) == 2
    assert "--allow-lossy" in capsys.readouterr().err
    assert main([*args, "--allow-lossy"]) == 0
    assert "LOSSY" in capsys.readouterr().out


def test_the_server_refuses_without_opt_in_and_labels_with_it():
    llm = make_server_llm()
    with uvicorn_thread(create_app(llm, "tiny"), log_level="error") as (url, _):
        body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 6, "temperature": 1.0,
                "seed": 3, "speculative": {"verifier": "typical"}}  # fmt: skip
        response = httpx.post(f"{url}/v1/completions", json=body)
        assert response.status_code == 400 and "allow_lossy" in response.text
        body["speculative"]["allow_lossy"] = True
        response = httpx.post(f"{url}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        metrics = response.json()["metrics"]["speculative_decoding"]
        assert metrics["lossy"] is True and metrics["verifier"] == "typical"
        body["speculative"] = {"verifier": "typical:epsilon=7", "allow_lossy": True}
        response = httpx.post(f"{url}/v1/completions", json=body)
        assert response.status_code == 400 and "epsilon" in response.text


def test_a_request_opts_out_of_the_servers_lossy_verifier():
    import dataclasses

    llm = make_server_llm()
    llm.speculative = dataclasses.replace(llm.speculative, verifier="typical", allow_lossy=True)
    with uvicorn_thread(create_app(llm, "tiny"), log_level="error") as (url, _):
        body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 6, "temperature": 1.0,
                "seed": 3}  # fmt: skip
        metrics = httpx.post(f"{url}/v1/completions", json=body).json()["metrics"]
        assert metrics["speculative_decoding"]["lossy"] is True  # the server's default
        body["speculative"] = {"allow_lossy": False}
        metrics = httpx.post(f"{url}/v1/completions", json=body).json()["metrics"]
        spec = metrics["speculative_decoding"]
        assert spec["lossy"] is False and spec["verifier"] == "rejection"
        body["speculative"] = {"allow_lossy": "yes"}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 400
        body["speculative"] = {"allow_lossy": False, "verifier": "typical"}
        response = httpx.post(f"{url}/v1/completions", json=body)
        assert response.status_code == 400
        assert '"allow_lossy": true' in response.json()["error"]["message"]
