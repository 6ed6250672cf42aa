"""Aggregate benchmark records into per-method, per-group summaries; write tables and plots.

Speedup conventions (both reported, always relative to the baseline method of the same run):

* ``speedup_mean``: the per-turn ratio (method tokens/s over baseline tokens/s on the same
  turn), averaged — Spec-Bench's convention;
* ``speedup_total``: total tokens/s of the method over total tokens/s of the baseline
  (long outputs weigh more).

A turn whose generate call raised an error (peers only: vLLM, llama.cpp) is counted in
``num_errors``, left out of every speed figure (tokens/s and both speedups: its time and
tokens are not a completed generation) and never counted as identical.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.datasets import GROUP_ORDER
from specdec.bench.harness import Record
from specdec.bench.methods import PEERS

OVERALL = "overall"


@dataclass
class Summary:
    """Aggregates of one method over one group of turns (or ``overall``).

    Attributes:
        num_turns: turns run (errored ones included).
        num_output_tokens, elapsed_s: totals over the turns that did not raise an error.
        tokens_per_s: total output tokens / total seconds (the same turns).
        speedup_mean, speedup_total: see the module docstring.
        mean_acceptance_length, acceptance_rate: pooled over all steps (specdec only).
        per_position_acceptance_rate: pooled, unconditional (specdec only).
        draft_share, verify_share: fractions of specdec's wall time in drafting and in
            verification (target forward + acceptance); prefill is the rest.
        num_identical: greedy turns whose output equals the baseline's (None if unchecked;
            an errored turn is not identical).
        num_identical_own_plain, num_compared_own_plain: a peer's speculative method
            (``vllm-ngram``, ``llama-cpp-lookup``): greedy turns whose output equals the
            same peer's plain decoding, of the turns compared (those where the plain one did
            not raise); None when none was compared (e.g. that plain method did not run).
        num_errors: turns whose generate call raised an error (see the module docstring).
        accepted_length_counts: histogram of accepted draft tokens per step.
        off_share: fraction of steps the speculation controller switched drafting off.
        mean_chosen_k: mean draft length the controller chose (over its choices).
        draft_sources: a drafter that chooses a source per step (``hybrid``): the steps
            each source drafted, pooled over the turns (empty for other methods).
    """

    num_turns: int = 0
    num_output_tokens: int = 0
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0
    speedup_mean: float | None = None
    speedup_total: float | None = None
    mean_acceptance_length: float | None = None
    acceptance_rate: float | None = None
    per_position_acceptance_rate: list[float] = field(default_factory=list)
    draft_share: float | None = None
    verify_share: float | None = None
    num_identical: int | None = None
    accepted_length_counts: list[int] = field(default_factory=list)
    off_share: float | None = None
    mean_chosen_k: float | None = None
    num_identical_own_plain: int | None = None
    num_compared_own_plain: int | None = None
    num_errors: int = 0
    draft_sources: dict[str, int] = field(default_factory=dict)


def summarize(records: Sequence[Record], baseline: str) -> dict[str, dict[str, Summary]]:
    """``{method: {group or "overall": Summary}}`` with speedups against ``baseline``."""
    base: dict[tuple[str, int], Record] = {}
    for r in records:
        if r.method == baseline:
            if (r.prompt_id, r.turn) in base:
                raise ValueError(f"two baseline records for {r.prompt_id} turn {r.turn + 1}")
            base[(r.prompt_id, r.turn)] = r
    methods = list(dict.fromkeys(r.method for r in records))
    groups = [g for g in GROUP_ORDER if any(r.group == g for r in records)]
    groups += sorted({r.group for r in records} - set(groups))
    out: dict[str, dict[str, Summary]] = {}
    for method in methods:
        mine = [r for r in records if r.method == method]
        out[method] = {g: _summary([r for r in mine if r.group == g], base) for g in groups}
        out[method][OVERALL] = _summary(mine, base)
    return out


def _summary(all_records: Sequence[Record], base: dict) -> Summary:
    s = Summary(num_turns=len(all_records))
    records = [r for r in all_records if r.error is None]  # speed: completed turns only
    s.num_errors = len(all_records) - len(records)
    checked = [r.matches_baseline for r in all_records if r.matches_baseline is not None]
    s.num_identical = sum(checked) if checked else None
    own = [r.matches_own_plain for r in all_records if r.matches_own_plain is not None]
    if own:
        s.num_identical_own_plain, s.num_compared_own_plain = sum(own), len(own)
    if not records:
        return s
    s.num_output_tokens = sum(r.num_output_tokens for r in records)
    s.elapsed_s = sum(r.elapsed_s for r in records)
    s.tokens_per_s = s.num_output_tokens / s.elapsed_s if s.elapsed_s else 0.0
    pairs = [(r, base[(r.prompt_id, r.turn)]) for r in records if (r.prompt_id, r.turn) in base]
    ratios = [r.tokens_per_s / b.tokens_per_s for r, b in pairs if b.tokens_per_s > 0]
    if ratios:
        s.speedup_mean = sum(ratios) / len(ratios)
        base_tokens = sum(b.num_output_tokens for _, b in pairs)
        base_time = sum(b.elapsed_s for _, b in pairs)
        mine_tokens = sum(r.num_output_tokens for r, _ in pairs)
        mine_time = sum(r.elapsed_s for r, _ in pairs)
        if base_tokens and mine_time:
            s.speedup_total = (mine_tokens / mine_time) / (base_tokens / base_time)
    _add_spec_metrics(s, [r.metrics for r in records if r.metrics is not None])
    return s


def _add_spec_metrics(s: Summary, metrics: list[dict]) -> None:
    if not metrics:
        return
    steps = sum(m["num_steps"] for m in metrics)
    drafts = sum(m["num_drafts"] for m in metrics)
    drafted = sum(m["num_draft_tokens"] for m in metrics)
    accepted = sum(m["num_accepted_tokens"] for m in metrics)
    output = sum(m["num_output_tokens"] for m in metrics)
    elapsed = sum(m["elapsed_s"] for m in metrics)
    s.mean_acceptance_length = output / steps if steps else None
    s.acceptance_rate = accepted / drafted if drafted else None
    width = max((len(m["per_position_acceptance_rate"]) for m in metrics), default=0)
    pos = [0.0] * width
    for m in metrics:
        for i, rate in enumerate(m["per_position_acceptance_rate"]):
            pos[i] += rate * m["num_drafts"]
    s.per_position_acceptance_rate = [p / drafts for p in pos] if drafts else []
    s.draft_share = sum(m["draft_s"] for m in metrics) / elapsed if elapsed else None
    s.verify_share = sum(m["verify_s"] for m in metrics) / elapsed if elapsed else None
    chosen = [0] * max(len(m.get("chosen_k_counts", [])) for m in metrics)
    for m in metrics:
        for k, n in enumerate(m.get("chosen_k_counts", [])):
            chosen[k] += n
    if sum(chosen):
        s.off_share = chosen[0] / sum(chosen)
        s.mean_chosen_k = sum(k * n for k, n in enumerate(chosen)) / sum(chosen)
    for m in metrics:
        for name, n in m.get("draft_sources", {}).items():
            s.draft_sources[name] = s.draft_sources.get(name, 0) + n
    hist_width = max(len(m["accepted_length_counts"]) for m in metrics)
    s.accepted_length_counts = [
        sum(m["accepted_length_counts"][i] for m in metrics if i < len(m["accepted_length_counts"]))
        for i in range(hist_width)
    ]


def _fmt(value, spec: str, empty: str = "-") -> str:
    return empty if value is None else format(value, spec)


def markdown_tables(summary: dict[str, dict[str, Summary]], baseline: str) -> str:
    """Leaderboard-style tables: rows = methods, columns = groups + overall."""
    columns = list(next(iter(summary.values())).keys())
    head = "| method | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns) + "\n"

    def table(title: str, cell) -> str:
        rows = "".join(
            f"| {m} | " + " | ".join(cell(s[c]) for c in columns) + " |\n"
            for m, s in summary.items()
        )
        return f"**{title}**\n\n{head}{rows}\n"

    return "".join(
        [
            table(
                f"Speedup over {baseline} (per-turn tokens/s ratio, averaged)",
                lambda s: _fmt(s.speedup_mean, ".2f") + ("x" if s.speedup_mean else ""),
            ),
            table(
                f"Speedup over {baseline} (total tokens/s ratio)",
                lambda s: _fmt(s.speedup_total, ".2f") + ("x" if s.speedup_total else ""),
            ),
            table(
                "Tokens per second",
                lambda s: "-" if s.num_errors == s.num_turns else _fmt(s.tokens_per_s, ".1f"),
            ),
            table(
                "Mean acceptance length (tokens per verification step, bonus included)",
                lambda s: _fmt(s.mean_acceptance_length, ".2f"),
            ),
            table("Acceptance rate (accepted / drafted)", lambda s: _fmt(s.acceptance_rate, ".1%")),
            table(
                "Draft / verification share of wall time",
                lambda s: (
                    "-" if s.draft_share is None else f"{s.draft_share:.0%} / {s.verify_share:.0%}"
                ),
            ),
            table(
                "Speculation controller: steps with speculation off / mean chosen k "
                "(capped by the tokens left)",
                lambda s: (
                    "-" if s.off_share is None else f"{s.off_share:.0%} / {s.mean_chosen_k:.1f}"
                ),
            ),
            table(
                f"Outputs identical to {baseline} (greedy)",
                lambda s: "-" if s.num_identical is None else f"{s.num_identical}/{s.num_turns}",
            ),
            sources_table(summary, table),
            hf_note(summary),
            peer_tables(summary, table),
            per_position_table(summary),
        ]
    )


def sources_table(summary: dict[str, dict[str, Summary]], table) -> str:
    """Where a method chooses a draft source per step (``hybrid``), the share of its
    steps each source drafted; ``""`` when none does."""
    if not any(s.draft_sources for groups in summary.values() for s in groups.values()):
        return ""

    def cell(s: Summary) -> str:
        total = sum(s.draft_sources.values())
        if not total:
            return "-"
        return ", ".join(f"{name} {n / total:.0%}" for name, n in sorted(s.draft_sources.items()))

    return table("Draft sources (share of the steps each source drafted)", cell)


def hf_note(summary: dict[str, dict[str, Summary]]) -> str:
    """A note when a transformers method (``hf-*``) ran: it computes with transformers'
    arithmetic on the model's dense weights, so against a baseline on another backend or
    weights its speed and identity measure the arithmetic too ('' without one)."""
    if not any(m.startswith("hf-") for m in summary):
        return ""
    return (
        "The `hf-*` methods run transformers' `generate` on the model's dense weights. "
        "Against a baseline on the native runtime or on a GGUF's blocks, their speedup and "
        "identity compare two arithmetics as well as two ways of speculating (a near-tie "
        "can flip, an end-of-sequence token can come earlier or later). To compare the "
        "speculation alone, run `--backend hf --quantization none` (what `make bench` "
        "does).\n\n"
    )


def _is_peer(method: str) -> bool:
    """``method`` (a report name such as ``vllm-ngram:k=5``) is a vLLM / llama.cpp method."""
    return method.split(":")[0].split("@")[0].split("+")[0] in PEERS


def peer_tables(summary: dict[str, dict[str, Summary]], table) -> str:
    """When a peer (vLLM, llama.cpp) ran or a turn raised an error: identity of each peer's
    speculative method with the same peer's plain decoding, and errors per method."""
    overall = [s[OVERALL] for s in summary.values()]
    if not any(map(_is_peer, summary)) and not any(s.num_errors for s in overall):
        return ""
    text = ""
    if any(s.num_compared_own_plain is not None for s in overall):
        text += table(
            "Outputs identical to the peer's own plain decoding (greedy; vllm-ngram vs "
            "vllm-ar, llama-cpp-lookup vs llama-cpp; turns where the plain one raised are "
            "not compared)",
            lambda s: (
                "-"
                if s.num_compared_own_plain is None
                else f"{s.num_identical_own_plain}/{s.num_compared_own_plain}"
            ),
        )
    text += table(
        "Turns whose generate call raised an error (left out of every speed figure above; "
        "never counted as identical)",
        lambda s: f"{s.num_errors}/{s.num_turns}",
    )
    return text


def per_position_table(summary: dict[str, dict[str, Summary]]) -> str:
    """Overall per-position acceptance rate per method: column i is the fraction of
    drafting steps whose i-th draft token (tree: a node at depth i) was accepted."""
    rates = {
        m: s[OVERALL].per_position_acceptance_rate
        for m, s in summary.items()
        if s[OVERALL].per_position_acceptance_rate
    }
    if not rates:
        return ""
    width = max(len(r) for r in rates.values())
    head = "| method | " + " | ".join(str(i + 1) for i in range(width)) + " |\n"
    head += "|---|" + "---|" * width + "\n"
    rows = ""
    for method, rate in rates.items():
        cells = [f"{x:.1%}" for x in rate] + ["-"] * (width - len(rate))
        rows += f"| {method} | " + " | ".join(cells) + " |\n"
    title = "Per-position acceptance rate (overall; position = draft token, or tree depth)"
    return f"**{title}**\n\n{head}{rows}\n"


def mismatches(records: Sequence[Record]) -> str:
    """Markdown lists of greedy turns whose output differs from the baseline's and of turns
    that raised an error, with the error ('' if none)."""
    text = ""
    bad = [r for r in records if r.matches_baseline is False and r.error is None]
    if bad:
        lines = "".join(f"- {r.method}: {r.prompt_id} turn {r.turn + 1}\n" for r in bad)
        text += f"**Outputs that differ from the baseline ({len(bad)})**\n\n{lines}\n"
    failed = [r for r in records if r.error is not None]
    if failed:
        lines = "".join(
            f"- {r.method}: {r.prompt_id} turn {r.turn + 1}: {r.error}\n" for r in failed
        )
        text += f"**Turns that raised an error ({len(failed)})**\n\n{lines}\n"
    return text


def write_outputs(
    out_dir: Path,
    records: Sequence[Record],
    summary,
    baseline: str,
    environment: dict,
    config: dict,
) -> list[Path]:
    """Write ``results.json``, ``report.md`` and PNG plots into ``out_dir``; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "environment": environment,
        "config": config,
        "baseline": baseline,
        "summary": {
            m: {g: vars(s) for g, s in by_group.items()} for m, by_group in summary.items()
        },
        "records": [r.to_dict() for r in records],
    }
    paths = [out_dir / "results.json", out_dir / "report.md"]
    paths[0].write_text(json.dumps(results, indent=1))
    traced = [r for r in records if r.trace]
    if traced:
        paths.append(write_traces(out_dir / TRACES, traced))
    env = "\n".join(f"- {k}: {v}" for k, v in environment.items())
    cfg = "\n".join(f"- {k}: {v}" for k, v in config.items())
    paths[1].write_text(
        f"# specdec bench\n\n## Environment\n\n{env}\n\n## Configuration\n\n"
        f"{cfg}\n\n## Results\n\n{markdown_tables(summary, baseline)}{mismatches(records)}"
    )
    plots = {
        out_dir / "speedup_by_category.png": plot_speedups,
        out_dir / "accepted_lengths.png": plot_accepted_lengths,
    }
    for path, plot in plots.items():
        written = plot(path, summary, baseline)
        if not written and path.exists():
            path.unlink()  # a plot of an earlier run in the same folder would mislead
        paths += written
    return paths


#: The step traces of a bench run (one JSON line per traced record, gzip).
TRACES = "traces.jsonl.gz"


def write_traces(path: Path, records: Sequence[Record]) -> Path:
    """One line per record: method, prompt id, turn, output tokens, prefill seconds,
    elapsed seconds and its step trace."""
    with gzip.open(path, "wt") as f:
        for r in records:
            line = {
                "method": r.method, "prompt_id": r.prompt_id, "group": r.group,
                "turn": r.turn, "num_output_tokens": r.num_output_tokens,
                "prefill_s": r.metrics["prefill_s"] if r.metrics else 0.0,
                "elapsed_s": r.elapsed_s, "trace": r.trace,
            }  # fmt: skip
            f.write(json.dumps(line) + "\n")
    return path


def read_traces(path: Path) -> list[dict]:
    """The lines :func:`write_traces` wrote.

    Raises:
        ValueError: the file is missing or not a trace file.
    """
    if not path.is_file():
        raise ValueError(f"no step traces at {path} (run `specdec bench --out DIR` first)")
    try:
        with gzip.open(path, "rt") as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except (OSError, EOFError, json.JSONDecodeError) as error:  # EOF: a cut-off file
        raise ValueError(f"{path} is not a complete specdec trace file: {error}") from None
    if not all(isinstance(x, dict) and "trace" in x and "method" in x for x in lines):
        raise ValueError(f"{path} is not a specdec trace file")
    return lines


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedups(path: Path, summary, baseline: str) -> list[Path]:
    """Grouped bars: speedup (per-turn mean) by group, one bar per non-baseline method."""
    plt = pyplot()

    methods = [m for m in summary if m != baseline]
    if not methods:
        return []
    columns = list(summary[methods[0]].keys())
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(columns)), 4))
    for i, method in enumerate(methods):
        values = [summary[method][c].speedup_mean or 0.0 for c in columns]
        ax.bar([x + i * width for x in range(len(columns))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(columns))])
    ax.set_xticklabels([c.replace(" ", "\n", 1) for c in columns], fontsize=8)
    ax.set_ylabel(f"speedup over {baseline}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def plot_accepted_lengths(path: Path, summary, baseline: str | None = None) -> list[Path]:
    """Per method: fraction of steps that accepted n draft tokens."""
    plt = pyplot()

    methods = [
        m
        for m, s in summary.items()
        if s[OVERALL].accepted_length_counts and s[OVERALL].acceptance_rate is not None
    ]
    if not methods:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in methods:
        counts = summary[method][OVERALL].accepted_length_counts
        total = sum(counts)
        ax.plot(range(len(counts)), [c / total for c in counts], marker="o", label=method)
    ax.set_xlabel("accepted draft tokens in a step (steps without a draft count as 0)")
    ax.set_ylabel("fraction of steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
