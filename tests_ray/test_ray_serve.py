"""``specdec serve`` replicated on Ray Serve (``make test-ray``): two replicas of the tiny
model behind Ray's proxy, loopback only."""

from __future__ import annotations

import concurrent.futures as cf
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_model, make_tokenizer, save_model  # noqa: E402
from specdec import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from specdec.integrations.ray import DEPLOYMENT_NAME, build_app  # noqa: E402

PROMPTS = [f"w{i} w{i + 1} w{i + 2} w{i} w{i + 1}" for i in range(1, 33)]
MAX_TOKENS = 24
LONG = 600  # tokens: requests still running when a replica is killed or drained


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    model = make_model(make_tokenizer(), seed=0, max_positions=1024)
    return save_model(model, tmp_path_factory.mktemp("tiny"))


def _outputs(model_dir, max_tokens, prompts):
    llm = LLM(model_dir, speculative=SpeculativeConfig(method="none"))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return {p: llm.generate(p, params, chat=False).text for p in prompts}


@pytest.fixture(scope="module")
def expected(model_dir) -> dict[str, str]:
    return _outputs(model_dir, MAX_TOKENS, PROMPTS)


@pytest.fixture(scope="module")
def expected_long(model_dir) -> dict[str, str]:
    return _outputs(model_dir, LONG, PROMPTS[:16])


@pytest.fixture(scope="module")
def url(model_dir):
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(["--model", model_dir, "--drafter", "ngram", "--served-model-name", "tiny"],
                    replicas=2, graceful_shutdown_timeout_s=20)  # fmt: skip
    serve.run(app, name=DEPLOYMENT_NAME, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def complete(url: str, prompt: str, timeout: float = 120, max_tokens=MAX_TOKENS) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def replicas() -> list:
    status = serve.status().applications[DEPLOYMENT_NAME].deployments[DEPLOYMENT_NAME]
    return status


def test_two_replicas_answer_like_one_process_under_32_concurrent_requests(url, expected):
    assert replicas().replica_states.get("RUNNING") == 2
    with cf.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda p: complete(url, p), PROMPTS))
    assert [a.status_code for a in answers] == [200] * len(PROMPTS)
    assert [a.json()["choices"][0]["text"] for a in answers] == [expected[p] for p in PROMPTS]
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert "vllm:num_requests_running" in metrics


def test_a_killed_replica_loses_no_request_silently(url, expected, expected_long):
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if "SERVE_REPLICA" in a["name"] and DEPLOYMENT_NAME in a["name"]]  # fmt: skip
    assert len(actors) == 2
    victim = ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"])
    with cf.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(complete, url, p, 90, LONG) for p in PROMPTS[:16]]
        time.sleep(1.0)
        ray.kill(victim, no_restart=False)
        answers = [f.result() for f in futures]  # every request ends: none hangs
    failed = 0
    for prompt, answer in zip(PROMPTS[:16], answers, strict=True):
        if answer.status_code == 200:  # finished on the survivor
            assert answer.json()["choices"][0]["text"] == expected_long[prompt]
        else:  # in flight on the killed replica: an error the client sees, never a wrong answer
            assert answer.status_code >= 500, answer.text
            failed += 1
    print(f"killed mid-run: {failed} of 16 requests failed with 5xx, the rest answered")
    assert 0 < failed < 16
    # requests after the kill are served (by the survivor, then the restarted replica)
    after = [complete(url, p) for p in PROMPTS[16:20]]
    assert all(a.status_code == 200 for a in after)
    assert [a.json()["choices"][0]["text"] for a in after] == [expected[p] for p in PROMPTS[16:20]]
    deadline = time.monotonic() + 120
    while replicas().replica_states.get("RUNNING") != 2 and time.monotonic() < deadline:
        time.sleep(1)
    assert replicas().replica_states.get("RUNNING") == 2  # Ray restarted it


def test_shutdown_drains_in_flight_requests(url, expected_long):
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, url, p, 120, LONG) for p in PROMPTS[:8]]
        time.sleep(0.5)
        in_flight = sum(not f.done() for f in futures)
        serve.delete(DEPLOYMENT_NAME)  # graceful: in-flight requests finish first
        answers = [f.result() for f in futures]
    assert in_flight > 0  # the drain began while requests were generating
    assert [a.status_code for a in answers] == [200] * 8
    texts = [a.json()["choices"][0]["text"] for a in answers]
    assert texts == [expected_long[p] for p in PROMPTS[:8]]


def test_bad_replica_counts_are_refused(model_dir):
    with pytest.raises(ValueError, match="replicas must be an integer >= 1"):
        build_app(["--model", model_dir], replicas=0)
    with pytest.raises(ValueError, match="--max-waiting must be >= 1"):
        build_app(["--model", model_dir, "--max-waiting", "0"])
