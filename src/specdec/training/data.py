"""Training data for draft heads: prompts from offline sources, answers from the target.

Draft heads learn to predict what the *target* says next, so the data set is the target's
own answers (self-distillation: Medusa-2, Cai et al. 2024, Sec. 3.3; EAGLE's "fixed
dataset" ablation, Li et al. 2024, Sec. 5.3.1 shows the gap is small but self-distilled
data is what the head will see at inference). Prompts come from:

* ``magpie``: the target writes user queries itself (Magpie, Xu et al. 2024,
  arXiv:2406.08464): given only the chat template up to the user turn, optionally after a
  system prompt naming a domain (coding, mathematics, writing, ...), it samples a query.
* ``chitchat``: openings of the chitchat-dataset conversations (MIT licence,
  ``pip install chitchat-dataset``).
* ``chatterbot``: questions of the chatterbot-corpus (BSD-3-Clause, ``pip install
  chatterbot-corpus``), English ones as asked, other languages as translation tasks.
* ``tasks``: templated tasks over those corpora (summarize a conversation, rewrite a
  sentence) and generated arithmetic word problems, whose numbers are drawn at random.

Everything is seeded, so the same options build the same data set. No text of Spec-Bench
or HumanEval is used; :func:`filter_contaminated` drops any example that shares a word
8-gram with them (:mod:`specdec.training.contamination`). BIG-bench data is never used:
its canary asks to keep it out of training.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

#: Sources and their licences, for the training report.
SOURCE_LICENCES = {
    "magpie": "text written by the target itself (its model licence: Apache-2.0 for SmolLM2)",
    "chitchat": "chitchat-dataset 0.9 (MIT)",
    "chatterbot": "chatterbot-corpus 1.3 (BSD-3-Clause)",
    "tasks": "templates of this module over chitchat / chatterbot text, random arithmetic",
}

#: Magpie system prompts: one per domain, plus none (the model's default).
MAGPIE_SYSTEMS = (
    None,
    "You are a Python programming assistant. Users ask you to write, explain or fix code.",
    "You are a mathematics tutor. Users ask you to solve math word problems step by step.",
    "You are a creative writing assistant. Users ask for stories, poems, emails and essays.",
    "You are a knowledgeable assistant for science, history and geography questions.",
    "You are a role-play partner. Users ask you to act as a character and stay in role.",
    "You are an assistant that summarizes and extracts information from texts users give.",
    "You are a helpful assistant that explains everyday topics clearly and briefly.",
    "You are a translator. Users give you a sentence in German, French or Spanish and ask "
    "for its English translation.",
    "You are a reading assistant. Users paste a short passage and ask a question about it.",
)

_LANGUAGES = {
    "german": "German", "french": "French", "spanish": "Spanish", "italian": "Italian",
    "portuguese": "Portuguese", "indonesian": "Indonesian", "swedish": "Swedish",
}  # fmt: skip


@dataclass
class Example:
    """One training conversation.

    Attributes:
        source: where the prompt came from (a key of :data:`SOURCE_LICENCES`).
        prompt: the user message.
        answer: the target's greedy answer (empty until generated).
        prompt_ids: the prompt after the chat template, as the target saw it.
        answer_ids: the answer's token ids (its end-of-turn token included when it ended).
    """

    source: str
    prompt: str
    answer: str = ""
    prompt_ids: list[int] | None = None
    answer_ids: list[int] | None = None


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the training corpus {name!r} is not installed: pip install "
            f"{name.replace('_', '-')} (or make train-setup)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def chitchat_prompts(rng: random.Random, limit: int) -> list[Example]:
    """Up to ``limit`` conversation openings (1-3 messages of the first speaker) of the
    chitchat-dataset, and as many conversations to summarize (``tasks``).

    Raises:
        FileNotFoundError: ``chitchat-dataset`` is not installed.
    """
    data = json.loads((_package_dir("chitchat_dataset") / "dataset.json").read_text("utf-8"))
    keys = sorted(data)
    rng.shuffle(keys)
    out: list[Example] = []
    for key in keys[:limit]:
        turns = [" ".join(m["text"].strip() for m in turn) for turn in data[key]["messages"]]
        turns = [t for t in turns if t]
        if not turns:
            continue
        out.append(Example("chitchat", turns[0]))
        if len(turns) >= 4 and rng.random() < 0.3:
            convo = "\n".join(f"{'AB'[i % 2]}: {t}" for i, t in enumerate(turns[:10]))
            out.append(Example("tasks", f"Summarize this conversation in two sentences:\n{convo}"))
    return out


def chatterbot_prompts(rng: random.Random) -> list[Example]:
    """English questions of the chatterbot-corpus as asked, and lines of its other
    languages as translation tasks into English.

    Raises:
        FileNotFoundError: ``chatterbot-corpus`` is not installed.
    """
    import yaml

    root = _package_dir("chatterbot_corpus") / "data"
    out: list[Example] = []
    for path in sorted(root.glob("*/*.yml")):
        language = path.parent.name
        if language != "english" and language not in _LANGUAGES:
            continue
        try:
            convs = yaml.safe_load(path.read_text("utf-8")).get("conversations") or []
        except (yaml.YAMLError, AttributeError, UnicodeDecodeError):
            continue
        for conv in convs:
            if not conv or not isinstance(conv[0], str):
                continue
            text = conv[0].strip()
            if len(text.split()) < 2:
                continue
            if language == "english":
                out.append(Example("chatterbot", text[0].upper() + text[1:]))
            elif rng.random() < 0.5:
                name = _LANGUAGES[language]
                out.append(Example("tasks", f"Translate from {name} to English: {text}"))
    return out


_ITEMS = ["apples", "pencils", "books", "stickers", "marbles", "cookies", "tickets", "shirts"]
_NAMES = ["Maya", "Liam", "Noah", "Ava", "Omar", "Zoe", "Ivan", "Lena", "Ken", "Rosa"]


def arithmetic_prompts(rng: random.Random, count: int) -> list[Example]:
    """``count`` arithmetic word problems with random names and numbers (``tasks``).

    Example:
        >>> len(arithmetic_prompts(random.Random(0), 3))
        3
    """
    out = []
    for _ in range(count):
        name, other = rng.sample(_NAMES, 2)
        item = rng.choice(_ITEMS)
        a, b, c = rng.randint(3, 60), rng.randint(2, 12), rng.randint(2, 9)
        price = rng.choice([0.5, 1.25, 2, 3.5, 4, 7.5, 12])
        templates = [
            f"{name} has {a} {item}. {other} gives {name} {b} times as many. How many "
            f"{item} does {name} have now?",
            f"{name} buys {a} {item} at ${price} each and pays with ${a * price + c * 5:g}. "
            "How much change does {name} get?".replace("{name}", name),
            f"A box holds {b} {item}. {name} has {a * b + c} {item}. How many full boxes can "
            f"{name} fill, and how many {item} are left?",
            f"{name} saves ${a} every week for {b} weeks, then spends ${c * 10}. How much is left?",
            f"What is {a} * {b} + {c * 11} - {a + b}? Show the steps.",
            f"If {c} workers build a wall in {b} days, how many days do {c * 2} workers need "
            "at the same pace?",
        ]
        out.append(Example("tasks", rng.choice(templates)))
    return out


def magpie_prefix(tokenizer, system: str | None) -> list[int]:
    """The chat template up to the start of the user's text (Magpie's pre-query
    template), optionally after ``system``.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not tokenizer.has_chat_template:
        raise ValueError("Magpie prompts need a chat template")
    marker = "\ue000MAGPIE\ue000"
    messages = [{"role": "user", "content": marker}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    text = tokenizer.hf.apply_chat_template(messages, tokenize=False)
    return tokenizer.hf.encode(text[: text.index(marker)], add_special_tokens=False)


def magpie_prompts(
    llm, count: int, seed: int, batch_size: int = 64, progress=None
) -> list[Example]:
    """``count`` user queries sampled by the target from Magpie pre-query templates
    (temperature 1, top-k 50, at most 48 tokens, one seed per query), cycling through
    :data:`MAGPIE_SYSTEMS`; queries that do not end within 48 tokens, shorter than 4
    words or repeated are dropped (at most ``3 * count`` tries).
    """
    from specdec.config import SamplingParams, SpeculativeConfig

    prefixes = [magpie_prefix(llm.tokenizer, s) for s in MAGPIE_SYSTEMS]
    seen: set[str] = set()
    out: list[Example] = []
    attempt = 0
    while len(out) < count and attempt < 3 * count:
        n = min(batch_size, 2 * (count - len(out)))
        batch = [prefixes[(attempt + i) % len(prefixes)] for i in range(n)]
        params = [
            SamplingParams(temperature=1.0, top_k=50, max_new_tokens=48, seed=seed + attempt + i)
            for i in range(n)
        ]
        attempt += n
        results = llm.generate(batch, params, speculative=SpeculativeConfig(method="none"))
        for r in results:
            text = r.text.strip()
            if r.finish_reason != "stop" or len(text.split()) < 4 or text.lower() in seen:
                continue
            if len(out) < count:
                seen.add(text.lower())
                out.append(Example("magpie", text))
                if progress is not None:
                    progress(1)
    return out


def filter_contaminated(examples: list[Example], test_items=None) -> tuple[list[Example], int]:
    """Drop every example whose prompt or answer shares a word 8-gram with the test
    sets (default: every Spec-Bench turn and HumanEval prompt).

    Returns:
        ``(kept, number dropped)``.
    """
    from specdec.training.contamination import DEFAULT_N, benchmark_items, word_ngrams

    items = benchmark_items() if test_items is None else test_items
    test = set()
    for _, text in items:
        test |= word_ngrams(text, DEFAULT_N)
    kept = [e for e in examples if not (word_ngrams(f"{e.prompt}\n{e.answer}", DEFAULT_N) & test)]
    return kept, len(examples) - len(kept)


def self_distill(
    llm,
    examples: list[Example],
    max_new_tokens: int,
    batch_size: int = 64,
    on_batch: Callable[[list[Example]], None] | None = None,
) -> Iterator[Example]:
    """The target's greedy answers to ``examples``' prompts, in batches (the batched
    engine, plain decoding). Yields each example with ``answer``, ``prompt_ids`` and
    ``answer_ids`` filled; ``on_batch`` sees each finished batch.
    """
    from specdec.config import SamplingParams, SpeculativeConfig

    params = SamplingParams(max_new_tokens=max_new_tokens)
    plain = SpeculativeConfig(method="none")
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        results = llm.generate([e.prompt for e in batch], params, speculative=plain)
        for example, result in zip(batch, results, strict=True):
            example.answer = result.text
            example.prompt_ids = list(result.prompt_token_ids)
            example.answer_ids = list(result.token_ids)
        if on_batch is not None:
            on_batch(batch)
        yield from batch


def gather_prompts(
    llm, num_prompts: int, seed: int = 0, magpie_share: float = 0.5, progress=None
) -> list[Example]:
    """About ``num_prompts`` prompts: ``magpie_share`` of them sampled by the target, the
    rest from the offline corpora and templates, shuffled with ``seed``; prompts longer
    than 400 tokens are dropped.

    Raises:
        FileNotFoundError: a corpus package is missing.
    """
    rng = random.Random(seed)
    n_magpie = int(num_prompts * magpie_share)
    rest = num_prompts - n_magpie
    corpus = chatterbot_prompts(rng)
    rng.shuffle(corpus)
    corpus = corpus[: rest // 3]
    corpus += arithmetic_prompts(rng, rest // 6)
    corpus += chitchat_prompts(rng, rest - len(corpus))
    corpus = corpus[:rest]
    prompts = magpie_prompts(llm, n_magpie, seed, progress=progress) + corpus
    seen: set[str] = set()
    unique = []
    for p in prompts:
        key = p.prompt.lower()
        if key not in seen and len(llm.tokenizer.encode(p.prompt)) <= 400:
            seen.add(key)
            unique.append(p)
    rng.shuffle(unique)
    return unique


def write_jsonl(path: Path, examples: Iterable[Example], mode: str = "w") -> None:
    """Append (``mode="a"``) or write examples as JSON lines."""
    with open(path, mode, encoding="utf-8") as f:
        for e in examples:
            f.write(json.dumps(asdict(e), ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[Example]:
    """Examples written by :func:`write_jsonl` (a torn last line, from an interrupted
    run, is skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(Example(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                continue
    return out
