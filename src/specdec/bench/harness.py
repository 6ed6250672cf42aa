"""Run every method over the same prompts, interleaved, and keep one record per turn."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from specdec.bench.datasets import BenchPrompt
from specdec.bench.methods import Method, MethodRunner, RunResult
from specdec.config import SamplingParams
from specdec.llm import LLM


@dataclass
class Record:
    """One method on one turn of one prompt.

    Attributes:
        method: the method's report name.
        prompt_id, category, group, turn: what was asked (turn is 0-based).
        num_prompt_tokens, num_output_tokens: sizes in tokens.
        elapsed_s: wall seconds of the generate call.
        token_ids: generated ids (EOS kept).
        metrics: specdec :class:`SpecStats` as a dict (``None`` for external baselines).
        matches_baseline: greedy runs: output ids equal the autoregressive baseline's
            for the same turn (``None`` for the baseline itself and for sampled runs).
        trace: specdec's step trace (:class:`~specdec.control.simulate.TraceStep` dicts)
            when the run recorded one; written apart from the records (``traces.jsonl.gz``).
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
) -> list[Record]:
    """Benchmark ``methods`` (the first is the baseline) on ``prompts``.

    For each prompt every method runs in turn (interleaving spreads machine noise evenly).
    A second turn is asked after the method's *own* first answer. For greedy runs each
    record is compared with the baseline's record of the same turn.

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

    Returns:
        records in run order.

    Raises:
        ValueError: two prompts share a ``prompt_id``, or two methods a name (records
            are matched by them).
    """
    check_unique("prompt ids", [p.prompt_id for p in prompts])
    runners = [m if hasattr(m, "run") else MethodRunner(m, llm, draft) for m in methods]
    check_unique("method names", [r.method.name for r in runners])
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
    records: list[Record] = []
    for prompt in prompts:
        per_method = [_run_turns(llm, runner, prompt, params, progress) for runner in runners]
        baseline = per_method[0]
        for method_records in per_method:
            for record, base in zip(method_records, baseline, strict=True):
                if params.greedy and method_records is not baseline:
                    record.matches_baseline = record.token_ids == base.token_ids
            records.extend(method_records)
    return records


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
