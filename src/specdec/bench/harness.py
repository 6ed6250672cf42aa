"""Run every method over the same prompts, interleaved, and keep one record per turn."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

from specdec.bench.datasets import BenchPrompt
from specdec.bench.methods import OWN_PLAIN, Method, MethodRunner, RunResult
from specdec.bench.peers import start_peer_runners
from specdec.config import SamplingParams
from specdec.llm import LLM


@dataclass
class Record:
    """One method on one turn of one prompt.

    Attributes:
        method: the method's report name.
        prompt_id, category, group, turn: what was asked (turn is 0-based).
        num_prompt_tokens, num_output_tokens: sizes in tokens.
        elapsed_s: wall seconds of the generate call (a peer's: measured in its worker).
        token_ids: generated ids (EOS kept).
        metrics: specdec :class:`SpecStats` as a dict (``None`` for external baselines
            and peers).
        matches_baseline: greedy runs: output ids equal the autoregressive baseline's
            for the same turn (``None`` for the baseline itself and for sampled runs;
            ``False`` for a turn that raised an error).
        trace: specdec's step trace (:class:`~specdec.control.simulate.TraceStep` dicts)
            when the run recorded one; written apart from the records (``traces.jsonl.gz``).
        matches_own_plain: greedy runs of a peer's speculative method (``vllm-ngram``,
            ``llama-cpp-lookup``) when the same peer's plain decoding (``vllm-ar``,
            ``llama-cpp``) ran too: output ids equal that method's for the same turn
            (``False`` when this turn raised an error, ``None`` when the plain one did).
        error: the error a peer's generate call raised on this turn (``"Type: message"``),
            else ``None``; ``token_ids`` then holds what it generated before raising.
    """

    method: str
    prompt_id: str
    category: str
    group: str
    turn: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_s: float
    token_ids: list[int]
    metrics: dict | None = None
    matches_baseline: bool | None = None
    trace: list[dict] | None = None
    matches_own_plain: bool | None = None
    error: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict:
        """The record without its trace, plus ``tokens_per_s``."""
        data = asdict(self)
        del data["trace"]
        return {**data, "tokens_per_s": self.tokens_per_s}


def run_benchmark(
    llm: LLM,
    methods: Sequence[Method],
    prompts: Sequence[BenchPrompt],
    params: SamplingParams,
    draft=None,
    warmup: bool = True,
    progress: Callable[[int], None] | None = None,
    peer_python: Mapping[str, str | None] | None = None,
    threads: int | None = None,
) -> list[Record]:
    """Benchmark ``methods`` (the first is the baseline) on ``prompts``.

    For each prompt every method runs in turn (interleaving spreads machine noise evenly).
    A second turn is asked after the method's *own* first answer. For greedy runs each
    record is compared with the baseline's record of the same turn, and a peer's
    speculative method's also with the same peer's plain decoding (``matches_own_plain``).

    Peer methods (vLLM, llama.cpp) run in worker processes
    (:class:`~specdec.bench.peers.PeerRunner`), started together before the first prompt
    and closed at the end, also when the run fails or is interrupted.

    Args:
        llm: holds the target (and is reused by every specdec method).
        methods: methods to run; ``methods[0]`` is the baseline (normally ``ar``). An item
            may also be a ready runner (any object with ``method`` and ``run``).
        prompts: the prompts.
        params: sampling parameters shared by all methods.
        draft: loaded draft model for ``draft-model`` / ``hf-assisted``.
        warmup: run each method once on a short generation before timing; drafters are
            then rebuilt (``LLM.reset_drafters``), so nothing the warm-up taught them
            reaches the timed runs.
        progress: called with 1 after each generation (e.g. a tqdm ``update``).
        peer_python: the interpreter of each peer library (``{"vllm": PATH,
            "llama-cpp": PATH}``); a missing one is this interpreter.
        threads: CPU threads of the peers (default: PyTorch's current count).

    Returns:
        records in run order.

    Raises:
        ValueError: two prompts share a ``prompt_id``, or two methods a name (records
            are matched by them), or a peer that cannot run (see
            :class:`~specdec.bench.peers.PeerRunner`).
        PeerError: a peer's worker failed to load or died.
    """
    check_unique("prompt ids", [p.prompt_id for p in prompts])
    check_unique("method names", [m.name for m in (getattr(x, "method", x) for x in methods)])
    peers = start_peer_runners(methods, llm, peer_python, threads)
    try:
        runners = [
            peers[i] if i in peers else m if hasattr(m, "run") else MethodRunner(m, llm, draft)
            for i, m in enumerate(methods)
        ]
        return _run(llm, runners, prompts, params, warmup, progress)
    finally:
        for runner in peers.values():
            runner.close()


def _run(llm, runners, prompts, params, warmup, progress) -> list[Record]:
    if warmup and prompts:
        warm_ids = _encode(llm, prompts[0], [], prompts[0].turns[0])
        warm_params = SamplingParams(
            max_new_tokens=8, temperature=params.temperature, seed=params.seed
        )
        for runner in runners:
            runner.run(warm_ids, warm_params)
            reset = getattr(getattr(runner, "llm", None), "reset_drafters", None)
            if reset is not None:  # what the warm-up taught a drafter must not leak into
                reset()  # the timed runs (suffix's global cache, recycling's table)
    kinds = [r.method.kind for r in runners]
    records: list[Record] = []
    for prompt in prompts:
        per_method = [_run_turns(llm, runner, prompt, params, progress) for runner in runners]
        baseline = per_method[0]
        for kind, method_records in zip(kinds, per_method, strict=True):
            if params.greedy and method_records is not baseline:
                for record, base in zip(method_records, baseline, strict=True):
                    record.matches_baseline = _same(record, base)
                if OWN_PLAIN.get(kind) in kinds:
                    plain = per_method[kinds.index(OWN_PLAIN[kind])]
                    for record, own in zip(method_records, plain, strict=True):
                        record.matches_own_plain = _same(record, own)
            records.extend(method_records)
    return records


def _same(record: Record, reference: Record) -> bool | None:
    """Equal outputs; ``False`` if ``record`` errored, ``None`` if only ``reference`` did."""
    if record.error is not None:
        return False
    if reference.error is not None:
        return None
    return record.token_ids == reference.token_ids


def check_unique(what: str, names: Sequence[str]) -> None:
    """Raise ``ValueError`` naming the repeated items if ``names`` has any."""
    repeated = sorted(name for name, n in Counter(names).items() if n > 1)
    if repeated:
        raise ValueError(f"{what} must be unique (records are matched by them): {repeated[:5]}")


def _run_turns(llm: LLM, runner: MethodRunner, prompt: BenchPrompt, params, progress):
    history: list[dict] = []
    records = []
    for turn, question in enumerate(prompt.turns):
        prompt_ids = _encode(llm, prompt, history, question)
        result: RunResult = runner.run(prompt_ids, params)
        records.append(
            Record(
                method=runner.method.name,
                prompt_id=prompt.prompt_id,
                category=prompt.category,
                group=prompt.group,
                turn=turn,
                num_prompt_tokens=len(prompt_ids),
                num_output_tokens=len(result.token_ids),
                elapsed_s=result.elapsed_s,
                token_ids=result.token_ids,
                metrics=result.stats.to_dict() if result.stats is not None else None,
                trace=(
                    [step.to_dict() for step in result.stats.trace]
                    if result.stats is not None and result.stats.trace
                    else None
                ),
                error=result.error,
            )
        )
        answer_ids = [t for t in result.token_ids if t not in llm.tokenizer.eos_token_ids]
        history += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": llm.tokenizer.decode(answer_ids)},
        ]
        if progress:
            progress(1)
    return records


def _encode(llm: LLM, prompt: BenchPrompt, history: list[dict], question: str) -> list[int]:
    if prompt.chat and llm.tokenizer.has_chat_template:
        return llm.encode(history + [{"role": "user", "content": question}])
    # Raw completion: earlier turns and answers are concatenated before the question.
    return llm.encode("\n".join([m["content"] for m in history] + [question]), chat=False)
