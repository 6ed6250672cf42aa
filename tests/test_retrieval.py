"""REST retrieval drafter: the suffix array and search on worked examples, the continuation
trie's counts, chains and trees, the datastore file (round trip, tokenizer identity,
corrupt files), options, ``specdec datastore build``, and the drafter conformance suite."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from drafter_conformance import PROMPTS, DrafterConformance, hf_greedy
from hypothesis import given, settings
from hypothesis import strategies as st
from test_statistical import PROMPT as STATISTICAL_PROMPT

from conftest import make_tokenizer
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.cli import main
from specdec.drafters.options import RetrievalOptions
from specdec.drafters.retrieval import (
    SEPARATOR,
    ContinuationTrie,
    Datastore,
    RetrievalDrafter,
    TokenizerInfo,
    retrieve,
    suffix_array,
    suffix_array_reference,
)
from specdec.registry import drafter_entry
from specdec.trees.builders import make_tree_builder
from specdec.trees.spec import TreeSpec
from specdec.trees.tree import ROOT

GENERATOR = torch.Generator()
TOY = TokenizerInfo("toy", vocab_size=40, vocab_sha256="0" * 64)
#: Two documents: "1 2 3 1 2 4 1 2 3 9" and "1 2 3 5 6".
CORPUS = [[1, 2, 3, 1, 2, 4, 1, 2, 3, 9], [1, 2, 3, 5, 6]]


def toy_store(documents=CORPUS, max_match: int = 16) -> Datastore:
    return Datastore.build(documents, TOY, max_match=max_match)


def options(**kwargs) -> RetrievalOptions:
    return RetrievalOptions(datastore="unused", **kwargs)


# ------------------------------------------------------------------------- suffix array
def test_suffix_array_of_a_worked_example():
    # positions:   0  1  2  3  4   5  6  7
    tokens = np.array([2, 1, 2, 1, -1, 2, 1, -1])
    # windows of 3: 0 "2 1 2", 1 "1 2 1", 2 "2 1 -|", 3 "1 -|", 5 "2 1 -|", 6 "1 -|"
    assert suffix_array(tokens, 3).tolist() == [3, 6, 1, 2, 5, 0]
    # depth 1 compares first tokens only: ties keep position order
    assert suffix_array(tokens, 1).tolist() == [1, 3, 6, 0, 2, 5]
    assert suffix_array(tokens, 3).dtype == np.int32


@settings(max_examples=60, deadline=None)
@given(
    documents=st.lists(
        st.lists(st.integers(0, 4), min_size=1, max_size=12), min_size=1, max_size=5
    ),
    depth=st.integers(1, 9),
)
def test_suffix_array_equals_the_reference_sort(documents, depth):
    tokens = np.array([t for doc in documents for t in [*doc, SEPARATOR]])
    assert suffix_array(tokens, depth).tolist() == suffix_array_reference(tokens, depth)


# ---------------------------------------------------------------------------- search
@pytest.mark.parametrize(
    "pattern, positions",
    [
        ([1, 2], {0, 3, 6, 11}),
        ([1, 2, 3], {0, 6, 11}),
        ([2, 3, 9], {7}),
        ([3, 1, 2, 4], {2}),
        ([9, 1], set()),  # 9 ends document 0 and 1 starts document 1: no crossing
        ([3, 9, 1, 2], set()),
        ([5, 6], {14}),
        ([7], set()),
    ],
)
def test_occurrences_on_a_tiny_corpus(pattern, positions):
    store = toy_store()
    assert set(store.occurrences(pattern).tolist()) == positions
    lo, hi = store.find(pattern)
    assert hi - lo == len(positions)


@settings(max_examples=60, deadline=None)
@given(
    documents=st.lists(
        st.lists(st.integers(0, 3), min_size=1, max_size=15), min_size=1, max_size=4
    ),
    pattern=st.lists(st.integers(0, 3), min_size=1, max_size=4),
)
def test_find_equals_brute_force(documents, pattern):
    store = Datastore.build(documents, TOY, max_match=4)
    flat = store.tokens.tolist()
    n = len(pattern)
    expected = {i for i in range(len(flat) - n + 1) if flat[i : i + n] == pattern}
    assert set(store.occurrences(pattern).tolist()) == expected


def test_search_pattern_length_is_checked():
    store = toy_store(max_match=3)
    for bad in ([], [1, 2, 3, 1]):
        with pytest.raises(ValueError, match="1 to 3 tokens"):
            store.find(bad)


@pytest.mark.parametrize(
    "context, max_match, min_match, length, count",
    [
        ([7, 7, 4, 1, 2, 3], 8, 2, 4, 1),  # "4 1 2 3" (positions 5..8): the longest match
        ([7, 7, 4, 1, 2, 3], 3, 2, 3, 3),  # capped at 3 tokens: "1 2 3", three times
        ([7, 3, 5], 8, 2, 2, 1),  # "3 5" only in document 1
        ([7, 9, 1], 8, 2, None, 0),  # "9 1" crosses the document boundary
        ([7, 9, 1], 8, 1, 1, 4),  # with min_match=1, "1" alone
        ([8, 8], 8, 1, None, 0),  # nothing
        ([2], 8, 2, None, 0),  # shorter than min_match
    ],
)
def test_longest_match(context, max_match, min_match, length, count):
    found = toy_store().longest_match(context, max_match, min_match)
    if length is None:
        assert found is None
    else:
        assert found.length == length and found.hi - found.lo == count


def test_continuations_stop_at_the_document_end_and_are_thinned_evenly():
    store = toy_store()
    match = store.longest_match([1, 2], 8, 2)  # occurrences at 0, 3, 6, 11
    rows = store.continuations(match, 3, 10)
    assert sorted(rows.tolist()) == [[3, 1, 2], [3, 5, 6], [3, 9, -1], [4, 1, 2]]
    # a document's last tokens: nothing after "3 9"
    assert store.continuations(store.longest_match([2, 3, 9], 8, 2), 2, 10).tolist() == [[-1, -1]]
    # 4 occurrences, 2 kept: every second one of the suffix-array range
    lo = match.lo
    kept = store.continuations(match, 1, 2)
    expected = [store.tokens[store.suffix_array[lo + i] + 2] for i in (0, 2)]
    assert kept[:, 0].tolist() == expected


# ---------------------------------------------------------------------------- the trie
def test_continuation_trie_counts_for_a_context():
    """Context "... 1 2": its 4 occurrences continue with "3 1 2", "4 1 2", "3 9" (then
    the document ends) and "3 5 6"."""
    trie = retrieve(toy_store(), [8, 1, 2], options(continuation_length=3))
    assert trie.paths() == {
        (3,): 3, (3, 1): 1, (3, 1, 2): 1, (3, 9): 1, (3, 5): 1, (3, 5, 6): 1,
        (4,): 1, (4, 1): 1, (4, 1, 2): 1,
    }  # fmt: skip
    assert trie.root.count == 4
    assert trie.ranked(trie.root, 8) == ([3, 4], [0.75, 0.25])
    # below "3": three children once each; ties go to the smaller token id
    assert trie.ranked(trie.find([3]), 2) == ([1, 5], [1 / 3, 1 / 3])
    assert trie.chain(5) == [3, 1, 2]
    assert trie.chain(2) == [3, 1]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 3), max_size=4), min_size=1, max_size=12),
    presort=st.booleans(),
)
def test_trie_counts_are_prefix_counts(rows, presort):
    """Every node's count is the number of continuations starting with its path, whether
    the rows arrive sorted or not; the ranking is by count, then token id."""
    width = 4
    conts = [(c + [SEPARATOR] * width)[:width] for c in rows]
    table = sorted(conts) if presort else conts
    trie = ContinuationTrie(np.array(table))
    expected = {}
    for c in conts:
        real = c[: c.index(SEPARATOR)] if SEPARATOR in c else c
        for n in range(1, len(real) + 1):
            expected[tuple(real[:n])] = expected.get(tuple(real[:n]), 0) + 1
    assert trie.paths() == expected
    node = trie.find([])
    tokens, scores = trie.ranked(node, 8)
    kids = {p[0]: n for p, n in expected.items() if len(p) == 1}
    assert tokens == sorted(kids, key=lambda t: (-kids[t], t))
    assert scores == [kids[t] / len(conts) for t in tokens]


def test_trie_of_no_rows_and_of_ended_continuations():
    empty = ContinuationTrie(np.zeros((0, 3), dtype=np.int64))
    assert empty.paths() == {} and empty.chain(4) == [] and empty.count([]) == 0
    ended = ContinuationTrie([[-1, -1], [-1, -1]])
    assert (
        ended.root.count == 2 and ended.chain(3) == [] and ended.ranked(ended.root, 4) == ([], [])
    )
    assert ended.child(ended.root, 5) is None


def test_retrieve_reads_only_the_last_max_match_tokens():
    store = toy_store()
    long_context = [30] * 100 + [1, 2, 3]
    trie = retrieve(store, long_context, options(max_match=4))
    assert trie is not None and trie.root.count == 3  # "1 2 3" three times


# ----------------------------------------------------------------------------- drafting
def test_chain_proposal_is_the_most_frequent_path():
    drafter = RetrievalDrafter(toy_store(), options(continuation_length=4))
    state = drafter.start([1, 2], SamplingParams())
    assert state.propose([5, 1, 2], 3, GENERATOR).token_ids == [3, 1, 2]
    assert state.propose([5, 1, 2], 10, GENERATOR).token_ids == [3, 1, 2, 4]
    assert state.propose([5, 1, 2], 0, GENERATOR).token_ids == []
    assert state.propose([8, 8], 3, GENERATOR).token_ids == []  # no match
    proposal = state.propose([5, 1, 2], 3, GENERATOR)
    assert proposal.draft_probs is None  # deterministic: point masses
    state.close()


def test_chain_and_tree_built_by_a_dynamic_builder():
    """After "1 2": "3 4 5" three times, "3 4 6", "3 7 8", "9 9 9" twice. Path scores
    (products of count / parent count): 3 5/7, 3 4 4/7, 3 4 5 3/7, 9 = 9 9 = 9 9 9 2/7,
    3 7 = 3 4 6 1/7; the budget of 6 keeps the six best."""
    documents = [[1, 2, 3, 4, 5]] * 3 + [[1, 2, 3, 4, 6], [1, 2, 3, 7, 8]] + [[1, 2, 9, 9, 9]] * 2
    drafter = RetrievalDrafter(toy_store(documents), options(continuation_length=3))
    assert drafter.propose([1, 2], 5, GENERATOR).token_ids == [3, 4, 5]
    builder = make_tree_builder(TreeSpec.parse("dynamic:top_k=2,depth=3,budget=6"))
    session = drafter.tree_session([1, 2], SamplingParams())
    tree = builder.build(session, 3, False, GENERATOR).tree
    paths = {tuple(tree.token_ids[n] for n in path) for path in tree.paths()}
    assert paths == {(3, 4, 5), (9, 9, 9)}
    assert tree.num_nodes == 6 and tree.parents[0] == ROOT


def test_tree_session_scores_are_counts_over_the_parent_count():
    drafter = RetrievalDrafter(toy_store(), options(continuation_length=3))
    session = drafter.tree_session([8, 1, 2], SamplingParams())
    (root,) = session.expand([ROOT], 8)
    assert root.tokens == [3, 4] and root.scores == [0.75, 0.25] and root.dist is None
    three = session.add(ROOT, 3)
    missing = session.add(ROOT, 7)  # not in the trie: no candidates below it
    below = session.add(missing, 1)
    exp_three, exp_missing, exp_below = session.expand([three, missing, below], 8)
    assert exp_three.tokens == [1, 5, 9] and exp_three.scores == [1 / 3] * 3
    assert exp_missing.tokens == [] and exp_below.tokens == []
    nothing = drafter.tree_session([8, 8], SamplingParams())
    assert nothing.expand([ROOT], 4)[0].tokens == []
    session.close()


# ---------------------------------------------------------------------------- the file
def test_save_load_round_trip(tmp_path, tokenizer):
    store = Datastore.build([[3, 4, 5, 3, 4], [6, 7]], tokenizer, max_match=4)
    path = tmp_path / "store.npz"
    store.save(path)
    loaded = Datastore.load(path, tokenizer)
    assert loaded.tokens.tolist() == store.tokens.tolist()
    assert loaded.suffix_array.tolist() == store.suffix_array.tolist()
    assert (loaded.max_match, loaded.num_documents, loaded.num_tokens) == (4, 2, 7)
    assert loaded.tokenizer == store.tokenizer == TokenizerInfo.of(tokenizer)
    assert loaded.occurrences([3, 4]).tolist() == store.occurrences([3, 4]).tolist()
    assert loaded.metadata()["version"] == 1
    save_as = tmp_path / "no-suffix"  # the exact name is kept (numpy would add .npz)
    store.save(save_as)
    assert save_as.is_file() and Datastore.load(save_as).num_tokens == 7


def test_another_tokenizer_is_refused(tmp_path, tokenizer):
    path = tmp_path / "store.npz"
    Datastore.build([[3, 4, 5]], tokenizer).save(path)
    other = make_tokenizer(prefix="v")  # same size, other tokens
    with pytest.raises(ValueError, match=r"built with tokenizer .* rebuild it"):
        Datastore.load(path, other)
    with pytest.raises(ValueError, match="vocabulary 8"):
        Datastore.load(path, make_tokenizer(num_words=5))


def test_missing_and_corrupt_files_are_refused(tmp_path, tokenizer):
    missing = tmp_path / "nothing.npz"
    with pytest.raises(ValueError, match=f"not found: {missing}.*specdec datastore build"):
        Datastore.load(missing)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a datastore at all")
    with pytest.raises(ValueError, match=f"cannot read retrieval datastore {garbage}"):
        Datastore.load(garbage)
    good = tmp_path / "good.npz"
    Datastore.build([list(range(3, 30))] * 50, tokenizer).save(good)
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ValueError, match=str(truncated)):
        Datastore.load(truncated)
    with pytest.raises(ValueError, match=str(tmp_path)):
        Datastore.load(tmp_path)  # a directory


def _rewrite(path: Path, out: Path, **changes) -> None:
    with np.load(path) as data:
        arrays = dict(data)
    meta = json.loads(bytes(arrays["metadata"]).decode())
    meta.update(changes.pop("meta", {}))
    arrays.update(changes)
    arrays["metadata"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(out, **arrays)


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"meta": {"version": 99}}, "format version 99"),
        ({"meta": {"format": "other"}}, "does not say format"),
        ({"meta": {"tokenizer": None}}, "lacks the tokenizer"),
        ({"suffix_array": np.array([0, 1], dtype=np.int32)}, "does not match the tokens"),
        ({"tokens": np.array([3, 4, 5], dtype=np.int32)}, "does not end a document"),
        ({"suffix_array": np.array([0, 1, 99], dtype=np.int32)}, "points outside"),
    ],
)
def test_inconsistent_files_are_refused(tmp_path, tokenizer, changes, fragment):
    path, bad = tmp_path / "store.npz", tmp_path / "bad.npz"
    Datastore.build([[3, 4, 5]], tokenizer).save(path)
    _rewrite(path, bad, **changes)
    with pytest.raises(ValueError, match=fragment):
        Datastore.load(bad)


@pytest.mark.parametrize(
    "documents, max_match, fragment",
    [
        ([], 16, "no tokens"),
        ([[], []], 16, "no tokens"),
        ([[3, 40]], 16, r"token id 40 is outside .*\[0, 40\)"),
        ([[3, -2]], 16, "token id -2"),
        ([[3]], 0, r"max_match must be in \[1, 256\]"),
        ([[3]], 300, "max_match must be in"),
        ([[3]], 2.0, "must be an integer"),
    ],
)
def test_bad_builds_are_refused(documents, max_match, fragment):
    with pytest.raises(ValueError, match=fragment):
        Datastore.build(documents, TOY, max_match=max_match)


# ------------------------------------------------------------------------------ options
@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("retrieval:max_match=0", "max_match must be an integer >= 1 and <= 256"),
        ("retrieval:max_match=300", "max_match must be an integer >= 1 and <= 256"),
        ("retrieval:min_match=0", "min_match must be an integer >= 1"),
        ("retrieval:min_match=5,max_match=4", "need min_match <= max_match"),
        ("retrieval:max_occurrences=0", "max_occurrences must be an integer >= 1"),
        ("retrieval:continuation_length=0", "continuation_length must be an integer"),
        ("retrieval:max_match=two", "needs an integer"),
        ("retrieval:radius=3", "has no option 'radius'"),
    ],
)
def test_bad_options_are_refused(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        SpeculativeConfig(method=spec)


def test_options_defaults_are_rest_s_and_non_strings_are_refused():
    default = RetrievalOptions()
    assert (default.max_match, default.min_match) == (16, 2)
    assert (default.max_occurrences, default.continuation_length) == (5000, 10)
    with pytest.raises(ValueError, match="datastore must be a path"):
        RetrievalOptions(datastore=3)
    assert drafter_entry("retrieval").options is RetrievalOptions


def test_factory_needs_a_datastore_and_a_deep_enough_index(tmp_path, target):
    with pytest.raises(ValueError, match="needs a datastore.*specdec datastore build"):
        LLM(target, speculative=SpeculativeConfig(method="retrieval"))
    path = tmp_path / "shallow.npz"
    Datastore.build([[3, 4, 5]], target.tokenizer, max_match=4).save(path)
    spec = f"retrieval:datastore={path},max_match=6"
    with pytest.raises(ValueError, match="max_match=6 exceeds the 4 tokens"):
        LLM(target, speculative=SpeculativeConfig(method=spec))
    with pytest.raises(ValueError, match="not found"):
        LLM(target, speculative=SpeculativeConfig(method=f"retrieval:datastore={path}.x"))
    llm = LLM(
        target, speculative=SpeculativeConfig(method=f"retrieval:datastore={path},max_match=4")
    )
    assert isinstance(llm.drafter(llm.speculative), RetrievalDrafter)


# ---------------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return tiny_model_dir


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_builds_a_store_from_txt_and_jsonl(capsys, tmp_path, model_dir, tokenizer):
    (tmp_path / "a.txt").write_text("w5 w6 w7 w8 w5 w6 w7 w8\n")
    records = [
        {"text": "w20 w21 w22"},
        {"turns": ["w9 w10", "w11 w12 w13"]},
        {"messages": [{"role": "user", "content": "w1 w2"}]},
        {"conversations": [{"from": "gpt", "value": "w3 w4"}]},
    ]
    lines = [json.dumps(r) for r in records]
    (tmp_path / "b.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n")
    out_path = tmp_path / "store.npz"
    code, out, err = run_cli(
        capsys, "datastore", "build", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"),
        "-o", str(out_path), "--model", model_dir, "--max-match", "8",
    )  # fmt: skip
    assert code == 0, err
    assert out.startswith(f"wrote {out_path}: 6 documents, 20 tokens, ")
    assert out.rstrip().endswith(" s") and "MiB" in out and len(out.splitlines()) == 1
    store = Datastore.load(out_path, tokenizer)
    assert store.max_match == 8 and store.num_documents == 6
    w = {f"w{i}": i + 3 for i in range(29)}
    docs = store.tokens.tolist()
    assert docs[:9] == [w["w5"], w["w6"], w["w7"], w["w8"]] * 2 + [SEPARATOR]
    assert docs[9:13] == [w["w20"], w["w21"], w["w22"], SEPARATOR]
    assert store.occurrences([w["w10"], w["w11"]]).tolist() == []  # turns are separate


def test_cli_store_drafts_for_generate(capsys, tmp_path, model_dir):
    """The stored text is the model's own greedy output: the drafter's tokens are accepted
    and the output equals plain decoding."""
    code, out, err = run_cli(
        capsys, "generate", "w20 w9 w11", "--model", model_dir, "--max-new-tokens", "20",
        "--json", "--drafter", "none",
    )  # fmt: skip
    assert code == 0, err
    text = json.loads(out)["text"]
    (tmp_path / "c.txt").write_text(f"w20 w9 w11 {text}")
    store = tmp_path / "c.npz"
    assert run_cli(capsys, "datastore", "build", str(tmp_path / "c.txt"), "-o", str(store),
                   "--model", model_dir)[0] == 0  # fmt: skip
    code, out, err = run_cli(
        capsys, "generate", "w20 w9 w11", "--model", model_dir, "--max-new-tokens", "20",
        "--json", "--compare", "--drafter", f"retrieval:datastore={store}",
    )  # fmt: skip
    assert code == 0, err
    record = json.loads(out)
    assert record["identical"] is True and record["text"] == text
    assert record["metrics"]["num_accepted_tokens"] > 0


@pytest.mark.parametrize(
    "setup, argv, fragment",
    [
        (None, ["a.txt", "-o", "s.npz"], "corpus file not found: "),
        ("a.bin", ["a.bin", "-o", "s.npz"], "looks binary (NUL bytes)"),
        ("a.txt", ["a.txt", "-o", "missing-dir/s.npz"], "does not exist"),
        ("a.txt", ["a.txt", "-o", "."], "is a directory"),
        ("a.txt", ["a.txt", "-o", "s.txt"], "name it *.npz"),
        ("empty.txt", ["empty.txt", "-o", "s.npz"], "the corpus is empty"),
        ("bad.jsonl", ["bad.jsonl", "-o", "s.npz"], "bad.jsonl:2: not JSON"),
        ("odd.jsonl", ["odd.jsonl", "-o", "s.npz"], "odd.jsonl:1: expected an object"),
        ("a.txt", ["a.txt", "-o", "s.npz", "--max-match", "0"], "max_match must be in"),
    ],
)
def test_cli_errors_are_one_line(capsys, tmp_path, model_dir, monkeypatch, setup, argv, fragment):
    monkeypatch.chdir(tmp_path)
    contents = {
        "a.txt": "w1 w2",
        "a.bin": "w1\0w2",
        "empty.txt": " \n",
        "bad.jsonl": '{"text": "w1"}\n{oops\n',
        "odd.jsonl": '{"title": "w1"}\n',
    }
    if setup:
        (tmp_path / setup).write_text(contents[setup])
    code, out, err = run_cli(capsys, "datastore", "build", *argv, "--model", model_dir)
    assert code == 2 and out == ""
    assert err.startswith("specdec: error: ") and len(err.strip().splitlines()) == 1, err
    assert fragment in err, err
    assert not (tmp_path / "s.npz").exists()


def test_cli_argument_errors(capsys):
    for argv in (
        ["datastore"],
        ["datastore", "build", "-o", "s.npz"],
        ["datastore", "build", "a.txt"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("specdec: error: ") and len(err.strip().splitlines()) == 1


def test_drafters_command_lists_retrieval(capsys):
    code, out, _ = run_cli(capsys, "drafters")
    assert code == 0
    assert "retrieval" in out and "max_occurrences=5000" in out and "datastore=" in out


# -------------------------------------------------------------------------- conformance
@pytest.fixture(scope="module")
def stores(tmp_path_factory, target) -> dict[str, Path]:
    """Datastores for the conformance suite: the tiny target's own greedy continuations of
    the suite's prompts (drafts get accepted); copies of them that diverge into random
    tokens after 6, 17 and 29 tokens, each outnumbering every path that goes on (a chain
    follows them and gets rejected there, a tree also holds the right branch); random
    text; and one store for the 8-token ``small`` model."""
    directory = tmp_path_factory.mktemp("retrieval-stores")
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 32, 30).tolist() for _ in range(10)]
    for prompt in PROMPTS:
        greedy = hf_greedy(target, prompt, 70)
        docs.append(prompt + greedy)
        for diverge, copies in ((29, 2), (17, 4), (6, 8)):
            docs += [prompt + greedy[:diverge] + rng.integers(3, 32, 8).tolist()] * copies
    target_store = directory / "target.npz"
    Datastore.build(docs, target.tokenizer).save(target_store)
    small_docs = [STATISTICAL_PROMPT * 2] + [rng.integers(0, 8, 20).tolist() for _ in range(20)]
    small_store = directory / "small.npz"  # the `small` fixture's tokenizer: 8 tokens
    Datastore.build(small_docs, make_tokenizer(num_words=5)).save(small_store)
    return {"target": target_store, "small": small_store}


def test_chain_is_rejected_where_the_store_diverges_and_a_tree_recovers(stores, target):
    """Greedy output equals plain decoding either way; the chain follows the diverging
    copies (some drafts rejected), the tree also holds the target's branch."""
    spec = f"retrieval:datastore={stores['target']}"
    expected = hf_greedy(target, PROMPTS[0], 40)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    chain = LLM(target, speculative=SpeculativeConfig(method=spec, num_speculative_tokens=4))
    out = chain.generate(PROMPTS[0], params)
    assert out.token_ids == expected
    assert 0 < out.metrics.num_accepted_tokens < out.metrics.num_draft_tokens
    config = SpeculativeConfig(method=spec, tree="dynamic:top_k=2,depth=4,budget=8")
    tree = LLM(target, speculative=config).generate(PROMPTS[0], params)
    assert tree.token_ids == expected
    assert tree.metrics.num_accepted_tokens > out.metrics.num_accepted_tokens


class TestRetrievalConformance(DrafterConformance):
    spec = "retrieval"
    #: options after the datastore
    more = ""

    @pytest.fixture(autouse=True)
    def _datastore(self, request, stores):
        """The ``small``-model test needs a store of that model's tokenizer."""
        model = "small" if "small" in request.fixturenames else "target"
        self.spec = f"retrieval:datastore={stores[model]}{self.more}"


class TestRetrievalShortMatchesConformance(TestRetrievalConformance):
    more = ",max_match=4,min_match=1,max_occurrences=3,continuation_length=6"
    trees = ("dynamic:top_k=2,depth=4,budget=8",)

    def test_sampling_follows_the_target_distribution(self):
        pytest.skip("options do not touch verification: checked once, with the defaults")
