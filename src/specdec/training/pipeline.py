"""``specdec train-head``: from nothing to a head folder, resumable at every stage.

Stages, each kept under ``OUT/work/`` and skipped when already done (so an interrupted run
continues where it stopped with the same command):

1. ``prompts.jsonl``: prompts from the offline sources (:mod:`specdec.training.data`).
2. ``data.jsonl``: the target's greedy answers (appended batch by batch).
3. ``contamination.json``: the word 8-gram check of every prompt and answer against every
   Spec-Bench turn and HumanEval prompt; overlapping conversations are dropped before
   training (the report counts what remains: 0 shared 8-grams).
4. ``features-LAYERS.pt``: the target's captured hidden states and greedy labels (computed
   again when the target's dtype or quantization changed).
5. ``checkpoint-KIND-HASH.pt``: training (:mod:`specdec.training.train`), saved every 100
   steps; ``HASH`` names the head's shape and the training settings (all but the step and
   time limits, :func:`checkpoint_name`), so the same command resumes it, a longer run
   continues it, and other settings in the same work folder train afresh.
6. ``OUT/config.json`` + ``OUT/head.safetensors`` (the head), ``OUT/report.json`` and
   ``OUT/training.png`` (loss and acceptance per position).
"""

from __future__ import annotations

import json
import platform
import random
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.heads.format import save_head, target_fingerprint
from specdec.heads.modules import (
    SINGLE_STATE_KINDS,
    HeadConfig,
    default_capture,
    init_from_target,
    make_head,
)
from specdec.training import data as D
from specdec.training.contamination import OUTSIDE_PROMPTS
from specdec.training.train import (
    Features,
    TrainConfig,
    choose_vocabulary,
    draft_index,
    evaluate,
    extract_features,
    loss_function,
    release_freed_memory,
    train,
)


@dataclass
class HeadRecipe:
    """Everything ``train-head`` needs besides the target (defaults: the shipped head's).

    Attributes:
        kind: ``"eagle"``, ``"medusa"`` or ``"parallel"``.
        num_prompts: prompts to answer (self-distillation).
        magpie_share: share of them the target writes itself.
        max_new_tokens: longest answer.
        capture: hidden-state indices (default: :func:`default_capture`).
        vocab_sizes: candidate draft-vocabulary sizes; the smallest covering ``coverage``
            of the answer tokens is chosen.
        coverage: see ``vocab_sizes``.
        medusa_heads: Medusa's number of heads.
        block_size: tokens a parallel head proposes per forward.
        init_from: a trained head folder for the same target whose matching weights start
            this one (an EAGLE head starts a parallel head: its layer already predicts the
            first draft position); ``None``: the target's LM head and random layers.
        held_out: share of conversations kept out of training for the report.
        seed: of every random choice.
        train: the optimizer settings.
        spec_bench: Spec-Bench's ``question.jsonl`` for the contamination check
            (``None``: :func:`specdec.bench.datasets.default_spec_bench_path`).
    """

    kind: str = "eagle"
    num_prompts: int = 2400
    magpie_share: float = 0.5
    max_new_tokens: int = 160
    capture: list[int] | None = None
    vocab_sizes: tuple[int, ...] = (2048, 4096, 8192, 12288, 16384)
    coverage: float = 0.97
    medusa_heads: int = 4
    block_size: int = 4
    init_from: str | None = None
    held_out: float = 0.05
    seed: int = 0
    train: TrainConfig = field(default_factory=TrainConfig)
    spec_bench: str | None = None


def _say(message: str) -> None:
    import sys

    print(f"specdec train-head: {message}", file=sys.stderr, flush=True)


def _bar(total: int, desc: str, unit: str):
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None)


def build_data(llm, work: Path, recipe: HeadRecipe) -> list[D.Example]:
    """Stages 1-2: prompts and the target's answers (resumed from ``work``)."""
    prompts_path, data_path = work / "prompts.jsonl", work / "data.jsonl"
    asked_path = work / "prompts.asked"  # the --num-prompts the prompts were gathered for
    if prompts_path.exists():
        asked = int(asked_path.read_text()) if asked_path.exists() else None
        if asked is not None and recipe.num_prompts > asked:
            raise ValueError(
                f"{work} holds the prompts of --num-prompts {asked}, not {recipe.num_prompts}: "
                "give a new --work folder to gather more (or the same number to resume)"
            )
        prompts = D.read_jsonl(prompts_path)[: recipe.num_prompts]
    else:
        _say(f"gathering {recipe.num_prompts} prompts ({recipe.magpie_share:.0%} Magpie)")
        with _bar(int(recipe.num_prompts * recipe.magpie_share), "magpie prompts", "prompt") as bar:
            prompts = D.gather_prompts(
                llm, recipe.num_prompts, recipe.seed, recipe.magpie_share, progress=bar.update
            )
        D.write_jsonl(prompts_path, prompts)
        asked_path.write_text(f"{recipe.num_prompts}\n")
    done = D.read_jsonl(data_path) if data_path.exists() else []
    if len(done) < len(prompts):
        D.write_jsonl(data_path, done)  # drop a torn last line
        todo = prompts[len(done) :]
        with _bar(len(prompts), "answers", "answer") as bar:
            bar.update(len(done))
            for _ in D.self_distill(
                llm, todo, recipe.max_new_tokens,
                on_batch=lambda b: (D.write_jsonl(data_path, b, "a"), bar.update(len(b))),
            ):  # fmt: skip
                pass
        done = D.read_jsonl(data_path)
    return done


def check_data(
    examples: list[D.Example], work: Path, spec_bench: str | None = None
) -> tuple[list[D.Example], dict]:
    """Stage 3: drop conversations sharing a word 8-gram with the test sets, then prove
    the rest shares none (the report written to ``work/contamination.json``)."""
    from specdec.training.contamination import benchmark_items, check_contamination

    items = benchmark_items(spec_bench)
    kept, dropped = D.filter_contaminated(examples, items)
    report = check_contamination((f"{e.prompt}\n{e.answer}" for e in kept), items)
    result = {
        "n": report.n,
        "conversations_checked": len(examples),
        "conversations_dropped": dropped,
        "conversations_kept": len(kept),
        "test_items": report.num_test_items,
        "test_ngrams": report.num_test_ngrams,
        "overlapping_test_items": len(report.contaminated),
        "shared_ngrams_after_filter": sum(report.contaminated.values()),
    }
    (work / "contamination.json").write_text(json.dumps(result, indent=2) + "\n")
    return kept, result


def outside_evaluation(llm, target, head, capture, recipe: HeadRecipe) -> dict:
    """The head's acceptance per draft position on the target's greedy answers to
    :data:`~specdec.training.contamination.OUTSIDE_PROMPTS` (prompts from none of the training
    sources; :func:`~specdec.training.train.evaluate`'s measure, as held out), the answers
    generated by ``llm`` (``None``: a new :class:`~specdec.llm.LLM` on ``target``).

    Returns:
        ``{"prompts", "answer_tokens", "acceptance": [...], "tau", "loss"}``.
    """
    if llm is None:  # the answers of training were on disk already
        from specdec.llm import LLM

        llm = LLM(target)
    conversations = answered(llm, OUTSIDE_PROMPTS, recipe.max_new_tokens)
    _, steps = loss_function(head)
    result = head_acceptance(target, head, conversations, steps or recipe.train.ttt_steps)
    return {"prompts": len(conversations), **result}


def answered(llm, prompts, max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, answer ids)`` of the target's greedy answers to ``prompts`` (text,
    through the chat template), batched."""
    examples = [D.Example("eval", prompt) for prompt in prompts]
    return [(e.prompt_ids, e.answer_ids) for e in D.self_distill(llm, examples, max_new_tokens)]


def head_acceptance(target, head, conversations, steps: int) -> dict:
    """:func:`~specdec.training.train.evaluate` of ``head`` over ``steps`` draft positions
    on ``conversations`` (``(prompt ids, answer ids)``, the target's features extracted
    here), with ``answer_tokens``."""
    features = extract_features(target, conversations, list(head.config.capture))
    index = draft_index(head.vocab_map, head.config.vocab_size)
    result = evaluate(head, features, index, steps)
    return {"answer_tokens": sum(len(a) for _, a in conversations), **result}


def build_features(target, examples, capture, work: Path, top_k: int = 0) -> Features:
    """Stage 4 (cached in ``work/features-LAYERS.pt`` for the same capture, target and
    examples; features that kept at least ``top_k`` tokens per row serve a smaller
    ``top_k``)."""
    path = work / f"features-{'-'.join(str(i) for i in capture)}.pt"
    # which model computed them: another dtype or quantization is another target
    model = f"{getattr(target, 'quantization', 'none')}/{getattr(target, 'dtype', '')}"
    if path.exists():
        saved = torch.load(path, weights_only=False)
        same = saved["capture"] == list(capture) and saved["count"] == len(examples)
        kept = saved["features"].top_k
        if same and saved.get("model", model) == model and kept >= top_k:
            return saved["features"]
    convs = [(e.prompt_ids, e.answer_ids) for e in examples]
    with _bar(len(convs), "target features", "conv") as bar:
        features = extract_features(target, convs, capture, progress=bar.update, top_k=top_k)
    torch.save({"capture": list(capture), "count": len(examples), "model": model,
                "features": features}, path)  # fmt: skip
    return features


def check_init_from(recipe: HeadRecipe, view) -> None:
    """Refuse ``recipe.init_from`` before any stage runs: a head for another target, or
    one reading other hidden states than this head will (:func:`warm_start` needs both).

    Raises:
        ValueError: either mismatch, with the flag to change.
    """
    from specdec.heads.format import check_target, read_config

    config = read_config(recipe.init_from)
    check_target(config, view, f"--init-from {recipe.init_from}")
    capture = recipe.capture or default_capture(recipe.kind, view.num_layers)
    if recipe.kind in SINGLE_STATE_KINDS and len(config.capture) != 1:
        raise ValueError(
            f"--init-from {recipe.init_from} is {config.kind} head reading hidden states "
            f"{config.capture}; a {recipe.kind} head reads one (its last), so start it "
            f"from a medusa or hydra head, or from nothing"
        )
    if list(config.capture) != list(capture):
        raise ValueError(
            f"--init-from {recipe.init_from} reads hidden states {config.capture}, this "
            f"{recipe.kind} head {list(capture)}; pass --layers "
            f"{','.join(str(i) for i in config.capture)} to match"
        )


def checkpoint_name(recipe: HeadRecipe, config: HeadConfig) -> str:
    """``checkpoint-KIND-HASH.pt``: ``HASH`` (8 hex digits) of what makes a training run
    another one: the head's config (kind, layers read, heads, block size, draft
    vocabulary), the warm start and every training setting but ``steps``,
    ``max_minutes`` and ``checkpoint_every`` (a longer run continues a shorter one).

    Example:
        >>> from specdec.heads.modules import HeadConfig
        >>> c = HeadConfig("eagle", "m", "f", 2, 8, 2, 1, 4, 16, 32, 1e-6, 1e4, [1], 16)
        >>> a = checkpoint_name(HeadRecipe(), c)
        >>> a == checkpoint_name(HeadRecipe(train=TrainConfig(steps=5)), c), a[:17]
        (True, 'checkpoint-eagle-')
        >>> a == checkpoint_name(HeadRecipe(train=TrainConfig(distill_top_k=10)), c)
        False
    """
    import hashlib

    head = {k: v for k, v in config.to_dict().items() if k not in ("training", "target_name")}
    train = {k: v for k, v in asdict(recipe.train).items()
             if k not in ("steps", "max_minutes", "checkpoint_every")}  # fmt: skip
    key = json.dumps({"head": head, "train": train, "init_from": recipe.init_from},
                     sort_keys=True)  # fmt: skip
    return f"checkpoint-{config.kind}-{hashlib.sha256(key.encode()).hexdigest()[:8]}.pt"


def warm_start(head, folder: str | Path, view) -> int:
    """Copy every tensor of the head in ``folder`` (trained for the same target) whose
    name and shape match ``head``'s -- its vocabulary map included.

    Returns:
        the number of tensors copied.

    Raises:
        ValueError: not a head for this target, or one reading other hidden states.
    """
    from safetensors.torch import load_file

    from specdec.heads.format import WEIGHTS_FILE, check_target, read_config

    config = read_config(folder)
    check_target(config, view, f"--init-from {folder}")
    mine = head.config
    if config.capture != mine.capture:
        raise ValueError(f"--init-from {folder} reads hidden states {config.capture}, this "
                         f"head {mine.capture}; pass --layers to match")  # fmt: skip
    state = load_file(str(Path(folder) / WEIGHTS_FILE))
    own = head.state_dict()
    copied = {k: v.to(own[k].dtype) for k, v in state.items()
              if k in own and tuple(v.shape) == tuple(own[k].shape)}  # fmt: skip
    with torch.no_grad():
        for name, tensor in copied.items():
            own[name].copy_(tensor)
        if hasattr(head, "mask_embed"):  # mask rows start as an average token
            embed = view.embed.float()
            head.mask_embed.copy_(embed.mean(0).expand_as(head.mask_embed))
    return len(copied)


def vocabulary_report(vocab_map, labels, vocab_size: int, source: str) -> dict:
    """Coverage of ``labels`` by a given draft vocabulary (the report's format of
    :func:`~specdec.training.train.choose_vocabulary`)."""
    coverage = float(torch.isin(labels, vocab_map).float().mean()) if len(labels) else 1.0
    return {"size": len(vocab_map), "coverage": coverage, "candidates": {}, "source": source,
            "distinct_labels": int(labels.unique().numel()), "num_labels": len(labels)}  # fmt: skip


def plot(
    history: list[dict], evaluation: dict, path: Path, kind: str, outside: dict | None = None
) -> None:
    """Training loss and acceptance per draft position (training windows, held out and,
    with ``outside``, on the outside prompts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [h["step"] for h in history]
    left.plot(steps, [h["loss"] for h in history])
    left.set_xlabel("optimizer step")
    left.set_ylabel("training loss (weighted cross-entropy)")
    left.set_title(f"{kind} head: loss")
    positions = len(evaluation["acceptance"])
    for s in range(positions):
        right.plot(steps, [h["acceptance"][s] for h in history], label=f"position {s + 1}")
    right.set_xlabel("optimizer step")
    right.set_ylabel("acceptance (given earlier positions accepted)")
    right.set_ylim(0, 1)
    held = ", ".join(f"{a:.2f}" for a in evaluation["acceptance"])
    title = f"held out: {held}; tau {evaluation['tau']:.2f}"
    if outside is not None:
        title += "\noutside: " + ", ".join(f"{a:.2f}" for a in outside["acceptance"])
        title += f"; tau {outside['tau']:.2f}"
    right.set_title(title, fontsize=9)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train_head(
    target, llm, out: str | Path, recipe: HeadRecipe, work: str | Path | None = None
) -> dict:
    """Run every stage for ``target`` (loaded; ``llm`` generates with it) into ``out``;
    intermediate files go to ``work`` (default ``out/work``; heads of both kinds may
    share one, so the data is built once).

    Returns:
        the training report (also written to ``out/report.json``).

    Raises:
        ValueError: nothing left to train on.
    """
    out = Path(out)
    work = Path(work) if work is not None else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    view = target.head_view()
    capture = recipe.capture or default_capture(recipe.kind, view.num_layers)
    if recipe.init_from:  # another target's head or other layers: refused now, not in an hour
        check_init_from(recipe, view)

    examples = build_data(llm, work, recipe)
    timings["data_s"] = time.perf_counter() - t0
    examples, contamination = check_data(examples, work, recipe.spec_bench)
    if not examples:
        raise ValueError("no training conversations left")
    t1 = time.perf_counter()
    features = build_features(target, examples, capture, work, recipe.train.distill_top_k)
    timings["features_s"] = time.perf_counter() - t1
    release_freed_memory()

    rng = random.Random(recipe.seed)
    order = list(range(len(features)))
    rng.shuffle(order)
    n_held = max(1, int(len(order) * recipe.held_out))
    held_out, train_set = features.subset(order[:n_held]), features.subset(order[n_held:])
    if recipe.init_from:  # the warm start's draft vocabulary
        from specdec.heads.format import read_config

        vocab_size = read_config(recipe.init_from).draft_vocab_size
    else:
        vocab_map, vocab_report = choose_vocabulary(
            train_set.answer_labels(), view.vocab_size, recipe.vocab_sizes, recipe.coverage
        )
        vocab_size = len(vocab_map)
    config = HeadConfig.for_target(
        recipe.kind, view, target_fingerprint(view), capture, vocab_size, recipe.medusa_heads,
        recipe.block_size if recipe.kind == "parallel" else 0,
    )  # fmt: skip
    torch.manual_seed(recipe.seed)
    head = make_head(config)
    if recipe.init_from:
        copied = warm_start(head, recipe.init_from, view)
        vocab_map = head.vocab_map.clone()
        vocab_report = vocabulary_report(
            vocab_map, train_set.answer_labels(), view.vocab_size,
            f"the vocabulary of {recipe.init_from}",
        )  # fmt: skip
        _say(f"starting from {recipe.init_from} ({copied} tensors)")
    else:
        head.vocab_map.copy_(vocab_map)
        init_from_target(head, view)
    vocab_report["draft_cost"] = vocab_report["size"] / view.vocab_size
    held_labels = held_out.answer_labels()
    vocab_report["held_out_coverage"] = float(torch.isin(held_labels, vocab_map).float().mean())
    head.bind(view.embed.float())
    _say(
        f"training the {recipe.kind} head: {len(train_set)} conversations "
        f"({train_set.num_tokens} tokens), draft vocabulary {len(vocab_map)} "
        f"({vocab_report['coverage']:.1%} of answer tokens)"
    )
    t2 = time.perf_counter()
    with _bar(recipe.train.steps, "training", "step") as bar:

        def progress(n, loss):
            bar.update(n)
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

        result = train(
            head, train_set, held_out, recipe.train, str(work / checkpoint_name(recipe, config)),
            progress=progress,
        )  # fmt: skip
    timings["train_s"] = time.perf_counter() - t2
    t3 = time.perf_counter()
    outside = outside_evaluation(llm, target, head, capture, recipe)
    timings["outside_eval_s"] = time.perf_counter() - t3
    _say(
        "acceptance per position held out: "
        + ", ".join(f"{a:.2f}" for a in result["eval"]["acceptance"])
        + "; on the outside prompts: "
        + ", ".join(f"{a:.2f}" for a in outside["acceptance"])
    )
    sources: dict[str, int] = {}
    for e in examples:
        sources[e.source] = sources.get(e.source, 0) + 1
    answer_tokens = sum(len(e.answer_ids or []) for e in examples)
    prompt_tokens = sum(len(e.prompt_ids or []) for e in examples)
    report = {
        "kind": recipe.kind,
        "target": view.name,
        "target_fingerprint": config.target_fingerprint,
        "capture": capture,
        "recipe": {k: v for k, v in asdict(recipe).items() if k != "train"},
        "train_config": asdict(recipe.train),
        "sources": {
            name: {"conversations": n, "licence": D.SOURCE_LICENCES.get(name, "")}
            for name, n in sorted(sources.items())
        },
        "tokens": {
            "prompt": prompt_tokens,
            "answer": answer_tokens,
            "train_conversations": len(train_set),
            "held_out_conversations": len(held_out),
        },
        "contamination": contamination,
        "vocabulary": vocab_report,
        "training": {k: v for k, v in result.items() if k not in ("history", "eval")},
        "held_out": result["eval"],
        "outside": outside,
        "history": result["history"],
        "timings": timings,
        "wall_s": time.perf_counter() - t0,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
        },
    }
    head.config.training = {
        "held_out_acceptance": result["eval"]["acceptance"],
        "held_out_tau": result["eval"]["tau"],
        "outside_acceptance": outside["acceptance"],
        "outside_tau": outside["tau"],
        "steps": result["steps"],
        "conversations": len(train_set),
    }
    save_head(head, out)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(result["history"], result["eval"], out / "training.png", recipe.kind, outside)
    return report
