"""``specdec bench --simulate DIR``: predict methods' speed from a bench run's step traces.

For each specdec method asked for, the traces of the recorded run with the same drafter
(same options, chains, the largest k) are replayed (:func:`specdec.control.simulate.simulate`)
under the method's controller and k; each turn is charged its recorded prefill and
per-generation overhead plus the simulated steps, at the costs fitted on that turn's
recorded steps and on the baseline's plain steps of the same turn (so that a 1-row forward
is measured even when the replayed run never ran one). Where the trace directory also holds a
measured run of the method itself, the prediction is compared with it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from specdec import registry
from specdec.bench.methods import Method, parse_method
from specdec.bench.report import TRACES, read_traces
from specdec.control.simulate import Timing, Trace, simulate

#: Engine cost-model key of each drafter's traces (simulation only uses it as a label).
SIM_DRAFTER = "drafter"


def _source(method: Method, recorded: dict[str, list[dict]]) -> tuple[str, int]:
    """The recorded method to replay for ``method``: same drafter and options, a chain,
    the ``fixed`` controller (an adaptive run's short drafts say nothing about longer
    ones), the largest k.

    Raises:
        ValueError: a tree method, no compatible recorded run, or one with a smaller k.
    """
    if method.tree:
        raise ValueError(f"{method.name}: token trees cannot be simulated (chains only)")
    mine = {k: v for k, v in method.options if k != "k"}
    best = None
    for name in recorded:
        try:
            other = parse_method(name)
        except ValueError:
            continue
        if other.kind != method.kind or other.tree or other.controller != "fixed":
            continue
        if {k: v for k, v in other.options if k != "k"} != mine:
            continue
        k = other.option("k")
        if best is None or k > best[1] or (k == best[1] and other.controller == "fixed"):
            best = (name, k)
    if best is None:
        raise ValueError(
            f"{method.name}: the traces hold no fixed-length chain run of drafter "
            f"{method.kind!r} with these options (recorded: {', '.join(recorded)})"
        )
    asked = method.option("k")
    if asked > best[1]:
        raise ValueError(
            f"{method.name}: the largest recorded k of this drafter is {best[1]} "
            f"({best[0]}); a replay cannot draft more than was recorded (record k >= {asked})"
        )
    return best


def run_simulation(trace_dir: Path, methods: Sequence[Method]) -> list[dict]:
    """Predict every specdec method of ``methods`` (``ar`` and external ones skipped).

    Returns:
        one dict per method: ``method``, ``source`` (the replayed run), ``predicted_tps``,
        ``measured_tps`` and ``error`` (relative; ``None`` without a measured run),
        ``predicted_tau``, ``chosen_k_counts``.

    Raises:
        ValueError: no trace file, a tree method, or no compatible recorded run.
    """
    lines = read_traces(trace_dir / TRACES)
    results = trace_dir / "results.json"
    if results.is_file():
        try:
            temperature = json.loads(results.read_text())["config"]["temperature"]
        except (ValueError, KeyError, TypeError):
            temperature = 0.0
        if temperature:
            raise ValueError(
                f"{trace_dir} holds a sampled run (temperature {temperature}); only greedy "
                "traces can be replayed (their output does not depend on the drafts)"
            )
    recorded: dict[str, list[dict]] = {}
    for line in lines:
        recorded.setdefault(line["method"], []).append(line)
    rows = []
    try:
        plain = {  # the baseline's plain steps of the same turn: what a 1-row forward costs
            (t["prompt_id"], t["turn"]): Trace.from_stats(t)
            for t in recorded.pop("autoregressive", [])
        }
        for method in methods:
            row = _predict(method, recorded, plain)
            if row is not None:
                rows.append(row)
    except (TypeError, KeyError, AttributeError) as error:
        raise ValueError(f"{trace_dir / TRACES} holds a malformed trace ({error!r})") from None
    return rows


def _predict(method: Method, recorded: dict, plain: dict) -> dict | None:
    """The prediction row of one method (``None`` for ``ar`` and external baselines)."""
    if not method.is_specdec or method.kind == "ar":
        return None
    source, max_k = _source(method, recorded)
    turns = recorded[source]
    traces = [Trace.from_stats(t) for t in turns]
    overall = Timing.fit(traces, SIM_DRAFTER)
    config = method.speculative_config()
    controller = registry.controller_entry(config.controller).factory(config.controller_options)
    k = min(config.num_speculative_tokens, max_k)
    tokens = seconds = steps = 0.0
    chosen: list[int] = []
    for turn, trace in zip(turns, traces, strict=True):
        outside = turn["elapsed_s"] - turn["prefill_s"] - sum(s.step_s for s in trace.steps)
        # each turn's own costs (its context length), the run's when it has no step
        baseline = plain.get((turn["prompt_id"], turn["turn"]))
        extra = [baseline] if baseline is not None else []
        timing = Timing.fit([trace], SIM_DRAFTER, extra) if trace.steps else overall
        one = simulate(trace, controller, k, timing)
        tokens += one.num_output_tokens
        seconds += one.seconds + max(0.0, outside)
        steps += one.num_steps
        for i, n in enumerate(one.chosen_k_counts):
            chosen.extend([0] * (i + 1 - len(chosen)))
            chosen[i] += n
    measured = recorded.get(method.name)
    measured_tps = (
        sum(t["num_output_tokens"] for t in measured) / sum(t["elapsed_s"] for t in measured)
        if measured
        else None
    )
    predicted = tokens / seconds if seconds else 0.0
    return {
        "method": method.name,
        "source": source,
        "predicted_tps": predicted,
        "measured_tps": measured_tps,
        "error": None if not measured_tps else predicted / measured_tps - 1,
        "predicted_tau": tokens / steps if steps else None,
        "chosen_k_counts": chosen,
    }


def simulation_table(rows: Sequence[dict]) -> str:
    """Markdown: method, replayed run, predicted and measured tokens/s, error."""
    out = [
        "| method | replayed trace | predicted tok/s | measured tok/s | error | predicted τ |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        measured = "-" if r["measured_tps"] is None else f"{r['measured_tps']:.1f}"
        error = "-" if r["error"] is None else f"{r['error']:+.1%}"
        tau = "-" if r["predicted_tau"] is None else f"{r['predicted_tau']:.2f}"
        out.append(
            f"| {r['method']} | {r['source']} | {r['predicted_tps']:.1f} | {measured} | "
            f"{error} | {tau} |"
        )
    return "\n".join(out) + "\n"


def write_simulation(out_dir: Path, rows: Sequence[dict], trace_dir: Path) -> list[Path]:
    """``simulation.json`` and ``simulation.md`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "simulation.json", out_dir / "simulation.md"]
    paths[0].write_text(json.dumps({"traces": str(trace_dir), "rows": list(rows)}, indent=1))
    paths[1].write_text(
        f"# specdec bench --simulate\n\nTraces: `{trace_dir}`\n\n{simulation_table(rows)}"
    )
    return paths
