"""What a new user hands the command line by mistake or by accident: text that is not
UTF-8, Ctrl-C, resources that are missing or taken, a busy machine. Each is one clear line
(exit 2), or for Ctrl-C exit 130 with what was generated so far, and each mistake that can
be seen without the model is refused before the model loads."""

from __future__ import annotations

import io
import json
import os
import socket
import sys

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import specdec.cli as cli
import specdec.cli_common as cli_common
import specdec.machine as machine
from specdec import LLM, SamplingParams
from specdec.cli import main

PROMPT = "w20 w9 w11"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status (argparse's own refusals exit through ``SystemExit``), stdout, stderr."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert err.startswith("specdec: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a model would load: the mistake must be caught before."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the mistake was refused")

    monkeypatch.setattr(cli, "llm_from_args", refuse)
    monkeypatch.setattr("specdec.server.cli.llm_from_args", refuse)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir)


@pytest.fixture
def shared_llm(monkeypatch, tiny_llm):
    """``generate`` runs on one LLM built once (so property tests stay fast)."""
    monkeypatch.setattr(cli, "llm_from_args", lambda args, speculative, **kw: tiny_llm)
    return tiny_llm


def stdin_bytes(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


# ------------------------------------------------------------------- text that is not UTF-8


def test_argv_prompt_with_a_byte_that_is_not_utf8(capsys, tiny_model_dir, no_loading):
    prompt = os.fsdecode(b"caf\xe9 hi")  # what Python makes of such argv bytes
    code, out, err = run_cli(capsys, "generate", prompt, "--model", tiny_model_dir)
    assert_one_line_error(code, err, "the prompt is not valid UTF-8", "byte 0xe9", "iconv")
    assert out == ""


def test_stdin_with_a_byte_that_is_not_utf8(capsys, tiny_model_dir, no_loading, monkeypatch):
    stdin_bytes(monkeypatch, b"caf\xe9 hi\n")
    code, _, err = run_cli(capsys, "generate", "-", "--model", tiny_model_dir)
    assert_one_line_error(code, err, "standard input is not valid UTF-8", "offset 3")


def test_stdin_utf8_with_a_byte_order_mark(capsys, shared_llm, monkeypatch, tiny_model_dir):
    stdin_bytes(monkeypatch, b"\xef\xbb\xbf" + PROMPT.encode())
    code, out, _ = run_cli(capsys, "generate", "-", "--model", tiny_model_dir, "--json")
    reference = shared_llm.generate(PROMPT)
    assert code == 0 and json.loads(out)["token_ids"] == reference.token_ids


def test_stop_string_that_is_not_utf8(capsys, tiny_model_dir, no_loading):
    stop = os.fsdecode(b"\xff")
    code, _, err = run_cli(capsys, "generate", PROMPT, "--model", tiny_model_dir, "--stop", stop)
    assert_one_line_error(code, err, "stop string 0 is not valid UTF-8", "byte 0xff")


def test_python_callers_get_a_value_error(tiny_llm):
    with pytest.raises(ValueError, match="the prompt is not valid Unicode: lone surrogate"):
        tiny_llm.generate("caf\udcff hi")
    with pytest.raises(ValueError, match=r"messages\[1\]\.content is not valid"):
        tiny_llm.tokenizer.encode(
            [{"role": "user", "content": "hi"}, {"role": "user", "content": "\ud800"}]
        )
    with pytest.raises(ValueError, match="stop string 1"):
        SamplingParams(stop=("ok", "\udcff"))


def test_dataset_file_that_is_not_utf8_names_file_and_line(tmp_path):
    from specdec.bench.datasets import load_jsonl

    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"prompts\.jsonl:2 is not valid UTF-8: byte 0xe9"):
        load_jsonl(path)
    path.write_text('{"prompt": "fine"}\n{"prompt": "caf\\udcff"}\n')
    with pytest.raises(ValueError, match=r"prompts\.jsonl:2: turn 0 is not valid Unicode"):
        load_jsonl(path)


def test_corpus_bytes_are_replaced_and_counted(tmp_path, capsys):
    from specdec.datastore_cli import read_documents

    text = tmp_path / "a.txt"
    text.write_bytes(b"caf\xe9 and \xef\xbf\xbd kept")
    records = tmp_path / "b.jsonl"
    records.write_bytes(b'{"text": "x\\udcff y"}\n{"text": "\xff ok"}\n')
    assert list(read_documents(text)) == ["caf\ufffd and \ufffd kept"]
    assert list(read_documents(records)) == ["x\ufffd y", "\ufffd ok"]
    err = capsys.readouterr().err
    assert f"{text}: 1 characters" in err and f"{records}: 2 characters" in err


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.binary(max_size=40), via_stdin=st.booleans())
def test_any_bytes_as_the_prompt(capsys, monkeypatch, shared_llm, tiny_model_dir, data, via_stdin):
    """Arbitrary bytes on argv or standard input: a generation (exit 0) or one line (exit
    2), never a traceback; valid UTF-8 that is not blank always generates."""
    if via_stdin:
        stdin_bytes(monkeypatch, data)
        prompt = "-"
    else:
        data = data.replace(b"\0", b"")  # argv cannot hold NUL bytes
        prompt = os.fsdecode(data)
        assume(prompt != "-")  # "-" names standard input (the via_stdin cases)
    argv = ["generate", "--model", tiny_model_dir, "--max-new-tokens", "3", "--json", "--"]
    argv.append(prompt)  # after "--": a prompt that starts with "-" is still the prompt
    code, out, err = run_cli(capsys, *argv)
    assert code in (0, 2) and "Traceback" not in err
    try:
        text = data.decode("utf-8-sig" if via_stdin else "utf-8")
    except UnicodeDecodeError:
        assert_one_line_error(code, err, "not valid UTF-8")
        return
    if code == 2:
        assert_one_line_error(code, err)
        assert "empty" in err or not text.strip() or "context" in err
    else:
        assert len(json.loads(out)["token_ids"]) <= 3


# ------------------------------------------------------------------- Ctrl-C


def _interrupt_after(monkeypatch, llm: LLM, num_chunks: int) -> None:
    """``llm.stream`` yields ``num_chunks`` chunks, then Ctrl-C arrives."""
    stream = llm.stream

    def interrupted(*args, **kwargs):
        for i, chunk in enumerate(stream(*args, **kwargs)):
            if i == num_chunks:
                raise KeyboardInterrupt
            yield chunk

    monkeypatch.setattr(llm, "stream", interrupted)


def test_ctrl_c_during_generation_prints_what_was_made(
    capsys, monkeypatch, shared_llm, tiny_model_dir
):
    _interrupt_after(monkeypatch, shared_llm, 3)
    code, out, err = run_cli(capsys, "generate", PROMPT, "--model", tiny_model_dir)
    assert code == 130 and "Traceback" not in err
    assert err.strip().startswith("specdec: interrupted after") and err.count("\n") == 1
    lines = out.splitlines()
    assert "finish reason            abort" in lines  # partial metrics follow the text
    assert lines[0] != "" and not lines[0].startswith("-")  # the partial text, then a newline
    steps = next(line for line in lines if line.startswith("tokens / steps"))
    assert steps.split()[-1] == "3"


def test_ctrl_c_with_json_prints_partial_metrics(capsys, monkeypatch, shared_llm, tiny_model_dir):
    full = shared_llm.generate(PROMPT, SamplingParams(max_new_tokens=20))
    _interrupt_after(monkeypatch, shared_llm, 2)
    argv = ["generate", PROMPT, "--model", tiny_model_dir, "--json", "--max-new-tokens", "20"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 130
    record = json.loads(out)
    assert record["interrupted"] is True and record["finish_reason"] == "abort"
    assert {"tree", "backend", "dtype", "exact", "threads"} <= record.keys()
    assert record["token_ids"] == full.token_ids[: len(record["token_ids"])]
    assert record["metrics"]["num_steps"] == 2
    assert record["metrics"]["num_output_tokens"] == len(record["token_ids"]) > 0
    assert record["prompt_tokens"] == len(full.prompt_token_ids) > 0
    assert "interrupted after" in err


def test_ctrl_c_before_the_first_token_still_prints_one_json_record(
    capsys, monkeypatch, shared_llm, tiny_model_dir
):
    full = shared_llm.generate(PROMPT, SamplingParams(max_new_tokens=4))
    _interrupt_after(monkeypatch, shared_llm, 0)  # during the prompt's prefill
    argv = ["generate", PROMPT, "--model", tiny_model_dir, "--json", "--max-new-tokens", "4"]
    code, out, err = run_cli(capsys, *argv)
    record = json.loads(out)
    assert code == 130 and record["interrupted"] is True and record["token_ids"] == []
    assert record["prompt_tokens"] == len(full.prompt_token_ids)
    assert record["metrics"]["num_steps"] == 0
    # the time before Ctrl-C went to the prompt: reported, not 0
    assert record["metrics"]["elapsed_s"] == record["metrics"]["prefill_s"] > 0
    assert err.strip() == "specdec: interrupted after 0 tokens"
    # without --json: no metrics of a run that made nothing, the same one line
    code, out, err = run_cli(capsys, "generate", PROMPT, "--model", tiny_model_dir)
    assert code == 130 and "tokens / steps" not in out
    assert err.strip() == "specdec: interrupted after 0 tokens"


def test_ctrl_c_while_loading(capsys, monkeypatch, tiny_model_dir):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "llm_from_args", interrupted)
    code, out, err = run_cli(capsys, "generate", PROMPT, "--model", tiny_model_dir)
    assert code == 130 and err.strip() == "specdec: interrupted" and out == ""


# ------------------------------------------------------------------- checked before loading


def test_busy_port_is_refused_before_loading(capsys, tiny_model_dir, no_loading):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        code, out, err = run_cli(capsys, "serve", "--model", tiny_model_dir, "--port", port)
    assert_one_line_error(code, err, f"cannot serve on 127.0.0.1:{port}", "in use")
    assert "serving" not in out


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_draft_model_drafter_without_a_draft(capsys, tiny_model_dir, no_loading, command):
    args = [PROMPT] if command == "generate" else []
    code, _, err = run_cli(
        capsys, command, *args, "--model", tiny_model_dir, "--drafter", "draft-model"
    )
    assert_one_line_error(code, err, "needs a draft model", "--draft-model")
    # the hint names the cheap copy of the target, not int8-dynamic (37% agreement)
    assert "--drafter quantized" in err and "int8" not in err


def test_hybrid_with_a_draft_model_asks_for_one(capsys, tiny_model_dir, no_loading):
    """``hybrid:model=draft-model`` needs ``--draft-model`` like ``draft-model`` does, and
    ``--draft-model`` with a hybrid whose model is not a draft model is refused."""
    code, _, err = run_cli(
        capsys, "generate", PROMPT, "--model", tiny_model_dir, "--drafter",
        "hybrid:model=draft-model",
    )  # fmt: skip
    assert_one_line_error(code, err, "needs a draft model", "--draft-model")
    code, _, err = run_cli(
        capsys, "generate", PROMPT, "--model", tiny_model_dir, "--drafter", "hybrid",
        "--draft-model", tiny_model_dir,
    )  # fmt: skip
    assert_one_line_error(code, err, "--draft-model is only used with", "hybrid:model=draft-model")


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_folder_without_a_model(capsys, tmp_path, no_loading, command):
    (tmp_path / "notes.txt").write_text("not a model")
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "w5 w6"}\n')
    args = {"generate": [PROMPT], "serve": [], "bench": ["--dataset", str(data)]}[command]
    code, _, err = run_cli(capsys, command, *args, "--model", str(tmp_path))
    assert_one_line_error(code, err, f"--model: folder {tmp_path} holds no", "config.json")


def test_file_that_is_not_a_model(capsys, tmp_path, no_loading):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 8)
    code, _, err = run_cli(capsys, "generate", PROMPT, "--model", str(path))
    assert_one_line_error(code, err, f"{path} is a file but not a .gguf model")


def test_draft_model_folder_is_checked_too(capsys, tmp_path, tiny_model_dir, no_loading):
    code, _, err = run_cli(
        capsys, "generate", PROMPT, "--model", tiny_model_dir, "--draft-model", str(tmp_path)
    )
    assert_one_line_error(code, err, "--draft-model: folder", "config.json")


def test_datastore_build_of_a_folder(capsys, tmp_path):
    (tmp_path / "a.txt").write_text("text")
    out = tmp_path / "store.npz"
    code, _, err = run_cli(capsys, "datastore", "build", str(tmp_path), "-o", str(out))
    assert_one_line_error(code, err, f"corpus path {tmp_path} is a folder", "find")


# ------------------------------------------------------------------- a busy machine


@pytest.mark.parametrize(
    ("load", "env", "flag", "threads", "reason"),
    [
        (0.2, None, None, 2, "idle"),
        (1.3, None, None, 1, "busy"),
        (7.0, None, None, 1, "busy"),
        (1.3, "2", None, None, "OMP_NUM_THREADS"),
        (1.3, None, 2, 2, "--threads"),
    ],
)
def test_thread_choice(monkeypatch, capsys, load, env, flag, threads, reason):
    import argparse

    import torch

    monkeypatch.setattr(cli_common, "machine_cores", lambda: 2)
    monkeypatch.setattr(cli_common, "machine_load", lambda: load)
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    monkeypatch.setattr(torch, "get_num_threads", lambda: state["threads"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: state.update(threads=n))
    state = {"threads": 2}  # PyTorch's usual count on this 2-core machine
    before = 2
    choice = cli_common.choose_threads(argparse.Namespace(threads=flag))
    assert choice.reason == reason
    assert choice.num_threads == (before if threads is None else threads)
    err = capsys.readouterr().err
    assert ("busy" in err) == (reason == "busy")


def test_more_threads_than_cores_run_on_the_cores_and_say_so(monkeypatch, capsys):
    """New users' trials: --threads 64 on 2 cores ran 8x slower without a word, and
    --threads 1000 started 1000 threads that stalled the machine for minutes."""
    import argparse

    import torch

    set_to = []
    monkeypatch.setattr(cli_common, "machine_cores", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    cli_common.choose_threads(argparse.Namespace(threads=1000))
    err = capsys.readouterr().err
    assert "--threads 1000 is more than this machine's 2 cores" in err
    assert "running on 2" in err and set_to == [2]
    cli_common.choose_threads(argparse.Namespace(threads=2))
    assert capsys.readouterr().err == "" and set_to == [2, 2]


def test_threads_below_one_are_refused(capsys, tiny_model_dir, no_loading):
    code, _, err = run_cli(capsys, "generate", PROMPT, "--model", tiny_model_dir, "--threads", "0")
    assert_one_line_error(code, err, "--threads must be >= 1")


@pytest.mark.parametrize(
    "flag, value, said",
    [
        ("--num-speculative-tokens", "0", "--num-speculative-tokens must be an integer from 1"),
        ("--num-speculative-tokens", "100000", "must be an integer from 1 to 64, got 100000"),
        ("--max-new-tokens", "0", "--max-new-tokens must be an integer >= 1"),
        ("--temperature", "-1", "--temperature must be a finite number >= 0"),
        ("--top-p", "2", "--top-p must be in (0, 1]"),
    ],
)
def test_errors_name_the_flag_not_the_field(capsys, tiny_model_dir, no_loading, flag, value, said):
    code, _, err = run_cli(capsys, "generate", PROMPT, "--model", tiny_model_dir, flag, value)
    assert_one_line_error(code, err, said)


def test_starved_run_is_flagged(monkeypatch, capsys):
    clock = {"wall": 0.0, "cpu": 0.0}
    monkeypatch.setattr(cli_common.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(cli_common, "_cpu_seconds", lambda: clock["cpu"])
    meter = cli_common.CpuMeter(num_threads=2)
    clock.update(wall=10.0, cpu=19.0)  # both threads on a CPU 95% of the time
    assert meter.share() == pytest.approx(0.95)
    assert not cli_common.warn_if_busy(meter.share(), 2)
    clock.update(wall=20.0, cpu=24.0)  # 24 s of CPU in 20 s on 2 threads: 60%
    assert cli_common.warn_if_busy(meter.share(), 2)
    assert "the speedup above is unreliable" in capsys.readouterr().err
    assert cli_common.warn_if_busy(0.5, 2, "every timing above")  # bench --forward-cost
    assert "every timing above is unreliable" in capsys.readouterr().err


def test_busy_warning_comes_after_the_metrics(capsys, monkeypatch, shared_llm, tiny_model_dir):
    monkeypatch.setattr(cli_common.CpuMeter, "share", lambda self: 0.3)
    code, out, err = run_cli(capsys, "generate", PROMPT, "--model", tiny_model_dir, "--compare")
    assert code == 0 and "speedup" in out and "30% of the time" in err
    assert "the speedup above is unreliable" in err
    # the figure itself says so too: a reader sees the speedup line first
    assert "x (UNRELIABLE: the machine was busy, see the warning below)" in out
    argv = ["generate", PROMPT, "--model", tiny_model_dir, "--compare", "--json"]
    code, out, err = run_cli(capsys, *argv)  # no "above" on a JSON record
    assert code == 0 and json.loads(out)["busy"] is True
    assert "the speedup in the JSON record is unreliable" in err
    monkeypatch.setattr(cli_common.CpuMeter, "share", lambda self: 0.95)
    code, out, err = run_cli(capsys, "generate", PROMPT, "--model", tiny_model_dir, "--compare")
    assert code == 0 and "speedup" in out and "UNRELIABLE" not in out and "unreliable" not in err


def test_ctrl_c_during_the_baseline_keeps_the_speculative_output(
    capsys, monkeypatch, shared_llm, tiny_model_dir
):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shared_llm, "generate", interrupted)  # the baseline's call
    argv = ["generate", PROMPT, "--model", tiny_model_dir, "--compare", "--json"]
    code, out, err = run_cli(capsys, *argv)
    record = json.loads(out)
    assert code == 130 and record["finish_reason"] != "abort" and "baseline" not in record
    assert record["interrupted"] == "baseline" and "backend" in record
    assert "interrupted during the plain-decoding baseline" in err


def test_compare_reports_cpu_share(capsys, shared_llm, tiny_model_dir):
    code, out, _ = run_cli(
        capsys, "generate", PROMPT, "--model", tiny_model_dir, "--json", "--compare"
    )
    record = json.loads(out)
    assert code == 0 and record["cpu_share"] > 0 and isinstance(record["busy"], bool)
    assert record["threads"] >= 1


# ------------------------------------------------------------------- max_tokens


def test_max_tokens_is_max_new_tokens():
    assert SamplingParams(max_tokens=7) == SamplingParams(max_new_tokens=7)
    assert SamplingParams(max_tokens=7).max_new_tokens == 7
    assert SamplingParams().max_new_tokens == 256
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(max_tokens=7, max_new_tokens=7)
    with pytest.raises(ValueError, match="^max_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=0)  # the name the caller used
    with pytest.raises(ValueError, match="^max_tokens must be an integer >= 1, got 2.5"):
        SamplingParams(max_tokens=2.5)
    with pytest.raises(ValueError, match="^max_new_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_new_tokens=0)


@pytest.mark.parametrize(
    ("args", "see"),
    [
        (["--drafter", "sparse-kv:quantization=q2"], "(see 'specdec drafters')"),
        (["--drafter", "ngram:x=1"], "`specdec drafters` describes them"),
        (["--controller", "cost:bogus=1"], "`specdec controllers` describes them"),
        (["--max-new-tokens", "x"], "(see 'specdec generate --help')"),
    ],
)
def test_an_option_error_names_where_the_options_are_listed(
    capsys, tiny_model_dir, no_loading, args, see
):
    """A drafter's or controller's options are listed by `specdec drafters` /
    `specdec controllers`, not by the command's --help; named once."""
    code, _, err = run_cli(capsys, "generate", PROMPT, "--model", tiny_model_dir, *args)
    command = see.split("specdec ")[1].split("'")[0].split("`")[0]
    assert code == 2 and see in err and err.count(f"specdec {command}") == 1, err


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("retrieval", "needs a datastore"),  # refused before loading, as every case here
        ("retrieval:datastore=/no/such/store.npz", "/no/such/store.npz: not found"),
        ("suffix:k=4", "the draft length is --num-speculative-tokens"),
        ("hybrid:kernel=fma", "the model drafter's options go after ';': model=NAME;kernel="),
        ("hybrid:model=nope", "hybrid:model=nope: unknown drafter; choose a chain drafter"),
        ("eagle@dynamic:top_k=4,depth=6", "give them apart: --drafter eagle --tree dynamic"),
    ],
)
def test_drafter_spec_mistakes_say_what_to_write(
    capsys, tiny_model_dir, no_loading, spec, fragment
):
    code, _, err = run_cli(capsys, "generate", PROMPT, "--model", tiny_model_dir, "--drafter", spec)
    assert code == 2 and fragment in err and "Traceback" not in err, err


def test_retrieval_datastore_that_is_a_folder(tmp_path):
    from specdec import SpeculativeConfig

    with pytest.raises(ValueError, match="a folder; expected a .npz file"):
        SpeculativeConfig(method=f"retrieval:datastore={tmp_path}")


def test_the_load_is_what_other_processes_do_now_not_a_minute_ago(monkeypatch):
    """Busy cores from two ``/proc/stat`` samples while this process sleeps: a run that
    just ended (high 1-minute load average) no longer costs the next one its threads."""
    samples = iter([(1000, 4000), (1150, 4400)])  # 150 of 400 jiffies busy: 37.5%
    monkeypatch.setattr(machine, "_cpu_ticks", lambda: next(samples))
    monkeypatch.setattr(machine, "LOAD_SAMPLE_S", 0.0)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0), raising=False)
    assert machine.busy_cores() == pytest.approx(1.5)
    monkeypatch.setattr(machine, "_cpu_ticks", lambda: None)  # no /proc/stat
    assert machine.busy_cores() == 9.0


def test_llm_warns_once_per_process_on_a_busy_machine(monkeypatch, caplog, tiny_model_dir):
    """A library user gets the CLI's warning: busy cores that PyTorch's threads need make
    everything slower with nothing else to say why (a new user's trial: LLM() took 20 s)."""
    import logging

    monkeypatch.setattr(machine, "load_checked", False)
    monkeypatch.setattr(machine, "cores", lambda: 2)
    monkeypatch.setattr(machine, "busy_cores", lambda: 1.3)
    monkeypatch.setattr("torch.get_num_threads", lambda: 2)
    with caplog.at_level(logging.WARNING, logger="specdec.llm"):
        # float32 pinned: dtype auto's probe, run when this machine has no verdict at the
        # patched thread count, would warn of the (patched) busy cores too
        LLM(tiny_model_dir, dtype="float32")
        LLM(tiny_model_dir, dtype="float32")  # once per process
    warned = [r.getMessage() for r in caplog.records if "busy" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "1.3 of 2 cores busy" in warned[0] and "torch.set_num_threads(1)" in warned[0]
    caplog.clear()
    monkeypatch.setattr(machine, "load_checked", False)
    monkeypatch.setattr(machine, "busy_cores", lambda: 0.2)  # idle: nothing to say
    assert machine.warn_once_if_busy(logging.getLogger("t"), 2) is False and not caplog.records
    monkeypatch.setattr(machine, "load_checked", False)
    monkeypatch.setattr(machine, "busy_cores", lambda: 5.0)
    assert machine.warn_once_if_busy(logging.getLogger("t"), 1) is False  # one thread: no wait


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc/stat here")
def test_cpu_ticks_read_the_machine():
    busy, total = machine._cpu_ticks()
    assert 0 <= busy <= total and total > 0


def test_serve_keeps_every_core_whatever_the_load(monkeypatch, capsys):
    import argparse

    import torch

    monkeypatch.setattr(cli_common, "machine_load", lambda: 5.0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    usual = torch.get_num_threads()
    choice = cli_common.choose_threads(argparse.Namespace(threads=None), adapt=False)
    assert choice.num_threads == usual and choice.reason == "idle"
    if usual > 1:
        assert "restart with --threads" in capsys.readouterr().err


def test_ctrl_c_while_python_imports_the_cli(monkeypatch, capsys):
    """The command's entry point imports the CLI (PyTorch: seconds) inside its own
    handler, and ``import specdec`` itself imports nothing heavy."""
    import builtins
    import subprocess

    import specdec.entry as entry

    real_import = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "specdec.cli":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    monkeypatch.delitem(sys.modules, "specdec.cli")
    assert entry.main() == 130
    assert capsys.readouterr().err.strip() == "specdec: interrupted"
    check = "import sys, specdec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
    # --version answers without the CLI's imports, as the parser would
    check = (
        "import sys; sys.argv = ['specdec', '--version']; import specdec.entry as e; "
        "code = e.main(); print(code, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    from specdec import __version__

    assert out.stdout.splitlines() == [f"specdec {__version__}", "0 False"], out.stderr


@pytest.mark.parametrize("swallowed", [True, False])
def test_ctrl_c_that_a_library_swallows_or_mangles_during_the_imports(
    monkeypatch, capsys, swallowed
):
    """Ctrl-C while the CLI's libraries import can land in code that does not let
    ``KeyboardInterrupt`` through (a destructor's "Exception ignored", an ImportError of
    a partially initialized module; both seen in a new user's trial): the entry point
    still stops with ``specdec: interrupted`` and status 130, and runs nothing."""
    import os
    import signal
    import time
    import types

    import specdec.entry as entry
    from specdec.interrupt import InterruptWatch

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # e.g. a shell script's & job
        pytest.skip("SIGINT is ignored in this process (inherited): no Ctrl-C can arrive")
    ran = []

    class Cli(types.ModuleType):
        def __getattr__(self, name):
            try:  # a library's code that catches the interrupt
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            except KeyboardInterrupt:
                pass
            if not swallowed:
                raise ImportError("cannot import name 'x' from partially initialized module")
            return lambda: ran.append(True) or 0

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setitem(sys.modules, "specdec.cli", Cli("specdec.cli"))
    assert entry.main() == 130
    assert capsys.readouterr().err.strip() == "specdec: interrupted" and not ran
    assert signal.getsignal(signal.SIGINT) is before  # the watch put Python's handler back
    with InterruptWatch() as watch:  # and without a Ctrl-C, nothing is seen
        pass
    assert not watch.seen
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.SIG_IGN)
    monkeypatch.setattr(signal, "signal", lambda *a: pytest.fail("an ignored SIGINT changed"))
    with InterruptWatch() as watch:  # ignored by the parent (a script's & job): kept
        pass


def test_folder_without_weights_is_refused_before_loading(capsys, tmp_path, no_loading):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    code, _, err = run_cli(capsys, "generate", PROMPT, "--model", str(tmp_path))
    assert_one_line_error(code, err, "weights (*.safetensors or *.bin)")


def test_folder_with_broken_files_is_one_line(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    code, _, err = run_cli(capsys, "generate", PROMPT, "--model", str(tmp_path))
    assert_one_line_error(code, err, f"cannot load the model in folder {tmp_path}")


def test_file_named_gguf_that_is_not_one(capsys, tmp_path, no_loading):
    path = tmp_path / "model.gguf"
    path.write_text("hello")
    code, _, err = run_cli(capsys, "generate", PROMPT, "--model", str(path))
    assert_one_line_error(code, err, "is not a GGUF file")


def test_retrieval_datastore_that_is_not_one(capsys, tmp_path, tiny_model_dir, no_loading):
    path = tmp_path / "README.md"
    path.write_text("# not a datastore")
    spec = f"retrieval:datastore={path}"
    code, _, err = run_cli(capsys, "generate", PROMPT, "--model", tiny_model_dir, "--drafter", spec)
    assert code == 2 and "not a datastore file" in err and "Traceback" not in err


def test_tree_errors_name_the_tree():
    from specdec import SpeculativeConfig

    with pytest.raises(ValueError, match=r"tree 'dynamic:top_k=100': top_k is at most 64"):
        SpeculativeConfig(tree="dynamic:top_k=100")


@pytest.mark.parametrize(
    "spec, says",
    [
        ("dynamic:topk=4", "(allowed: adaptive, budget, depth, top_k)"),
        ("dynamic:top_k=0", "tree option top_k must be an integer >= 1"),
        ("dynamic:top_k=100,depth=4,budget=8", "top_k is at most 64 (top_k**2 candidates"),
    ],
)
def test_cli_tree_errors_keep_the_specs_option_names(
    capsys, tiny_model_dir, no_loading, spec, says
):
    """A tree spec's top_k is not the sampling flag --top-k: the CLI writes the library's
    field names as its flags everywhere except in a tree spec's error (a trial was told to
    use --top-k inside --tree)."""
    code, _, err = run_cli(capsys, "generate", PROMPT, "--model", tiny_model_dir, "--tree", spec)
    assert_one_line_error(code, err, f"--tree '{spec}'", says)
    assert "--top-k" not in err


def test_options_that_do_nothing_say_so(capsys, tiny_model_dir, no_loading):
    """Documented as unused, now also said at run time: K beside a tree (its depth and
    budget size the draft), a controller beside --drafter none (nothing to control)."""
    import argparse

    from specdec.cli_common import note_unused_options, speculative_config

    def note(**values):
        args = argparse.Namespace(
            drafter=None, draft_model=None, num_speculative_tokens=5, tree=None,
            controller="fixed", backend="native",
        )  # fmt: skip
        vars(args).update(values)
        config = speculative_config(args)
        assert capsys.readouterr().err == ""  # checking says nothing: an error stays alone
        note_unused_options(args, config)
        return capsys.readouterr().err

    assert "--num-speculative-tokens is not used with --tree" in note(
        tree="static:tree-8", num_speculative_tokens=12
    )
    assert note(tree="static:tree-8") == ""  # the default K: nothing to say
    assert "--controller cost does nothing with --drafter none" in note(
        drafter="none", controller="cost"
    )
    assert note(drafter="suffix", controller="cost") == ""
    # through the CLI: an invalid setting's error stays the only line (a property test)
    args = ["--tree", "static:tree-8", "--num-speculative-tokens", "7", "--top-p", "0"]
    code, _, err = run_cli(capsys, "generate", PROMPT, "--model", tiny_model_dir, *args)
    assert_one_line_error(code, err, "top")
