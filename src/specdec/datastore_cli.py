"""``specdec datastore build``: a retrieval datastore for the ``retrieval`` (REST) drafter.

Corpus files:

* any file but ``.jsonl`` (``.txt``, ``.md``, source code, ...): the whole file is one
  document (a file with NUL bytes is refused as binary);
* ``.jsonl``: one JSON object per line, each giving one or more documents: ``"text"``
  (a string: one document), ``"turns"`` (a list of strings, e.g. Spec-Bench / MT-Bench
  questions), ``"messages"`` (a list of ``{"role", "content"}``) or ``"conversations"``
  (ShareGPT: a list of ``{"from", "value"}``). Every turn or message is its own document,
  as in REST's datastores (He et al. 2024, arXiv:2311.08252, whose build scripts index
  each utterance of a conversation separately): a draft continues the text of a message,
  never across two of them. Blank lines are skipped.

Documents are tokenized with the target's tokenizer (``--model``), without special tokens.

Text rule: corpus files are read as UTF-8. A corpus is bulk text (source trees, dumps) in
which a stray byte should not cost the whole build, so bytes that are not UTF-8, and lone
surrogates from JSON escapes, are replaced by U+FFFD; the build says on standard error how
many it replaced in which file. (Prompts are stricter: see :mod:`specdec.unicode`.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from specdec.models.loading import DEFAULT_MODEL
from specdec.unicode import decode_lenient, replace_invalid

#: Corpus files with this suffix hold JSON records; any other file is one text document.
RECORDS_SUFFIX = ".jsonl"


def add_parser(sub) -> None:
    """Add ``datastore build`` to the CLI's subcommands."""
    p = sub.add_parser(
        "datastore",
        help="build a datastore for the retrieval (REST) drafter",
        description="Datastores for the retrieval drafter (REST): a corpus tokenized with "
        "the target's tokenizer and indexed for exact suffix search.",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    build = actions.add_parser(
        "build",
        help="index text files into one datastore file",
        description="Tokenize FILES with the target's tokenizer and index them into STORE "
        "(one .npz file); use it with --drafter retrieval:datastore=STORE. FILES: any text "
        "file (.txt, .md, source code: one document per file) or .jsonl (one object per "
        "line with 'text', or 'turns', 'messages' or 'conversations': each turn / message "
        "is one document).",
    )
    build.add_argument("files", nargs="+", metavar="FILES", help="text or .jsonl corpus files")
    build.add_argument("-o", "--output", required=True, metavar="STORE", help="file to write")
    build.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"the target whose tokenizer is used (default: {DEFAULT_MODEL})",
    )
    build.add_argument(
        "--max-match",
        type=int,
        default=16,
        metavar="N",
        help="longest context suffix the store can match, in tokens (default: 16, as REST)",
    )
    build.set_defaults(func=_cmd_build)


def _cmd_build(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specdec.drafters.retrieval import Datastore, encode_documents

    output = _checked_output(args.output)
    paths = _checked_files(args.files)
    start = time.perf_counter()
    texts = [text for path in paths for text in read_documents(path)]
    if not texts:
        raise ValueError(f"the corpus is empty: no documents in {', '.join(args.files)}")
    tokenizer = load_tokenizer(args.model)
    documents = tqdm(
        encode_documents(texts, tokenizer),
        total=len(texts),
        desc="tokenizing",
        unit="doc",
        file=sys.stderr,
        disable=None,  # only on a terminal
    )
    store = Datastore.build(documents, tokenizer, args.max_match)
    store.save(output)
    seconds = time.perf_counter() - start
    size = output.stat().st_size / 2**20
    print(
        f"wrote {output}: {store.num_documents} documents, {store.num_tokens} tokens, "
        f"{size:.1f} MiB, {seconds:.1f} s"
    )
    return 0


def _checked_output(text: str) -> Path:
    """The output path, refused before any work when it cannot be written."""
    output = Path(text).expanduser()
    if output.is_dir():
        raise ValueError(f"output {output} is a directory; give a file, e.g. {output}/store.npz")
    if output.suffix != ".npz":
        raise ValueError(f"output {output}: a datastore is a NumPy .npz archive; name it *.npz")
    if not output.parent.is_dir():
        raise ValueError(f"cannot write {output}: directory {output.parent} does not exist")
    return output


def _checked_files(names: list[str]) -> list[Path]:
    """The corpus files, refused up front when missing or of an unknown kind."""
    paths = [Path(name).expanduser() for name in names]
    for path in paths:
        if path.is_dir():
            raise ValueError(
                f"corpus path {path} is a folder; give the files in it, e.g. "
                f"$(find {path} -type f -name '*.txt')"
            )
        if not path.is_file():
            raise ValueError(f"corpus file not found: {path}")
        if path.suffix.lower() != RECORDS_SUFFIX:
            with path.open("rb") as handle:
                if b"\0" in handle.read(8192):
                    raise ValueError(f"corpus file {path} looks binary (NUL bytes), not text")
    return paths


def read_documents(path: Path) -> Iterator[str]:
    """The documents of one corpus file (see the module docstring); blank ones skipped.

    Raises:
        ValueError: a ``.jsonl`` line that is not JSON or has no text field (file:line).
        OSError: the file cannot be read.
    """
    replaced = 0
    if path.suffix.lower() != RECORDS_SUFFIX:
        text, replaced = decode_lenient(path.read_bytes())
        if text.strip():
            yield text
    else:
        with path.open("rb") as handle:
            for number, raw in enumerate(handle, 1):
                line, count = decode_lenient(raw)
                replaced += count
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
                for text in record_texts(record, f"{path}:{number}"):
                    text, count = replace_invalid(text)
                    replaced += count
                    if text.strip():
                        yield text
    if replaced:
        print(
            f"specdec: {path}: {replaced} characters that were not valid UTF-8 text "
            "replaced by U+FFFD",
            file=sys.stderr,
        )


def record_texts(record, where: str) -> list[str]:
    """The documents of one ``.jsonl`` record.

    Example:
        >>> record_texts({"turns": ["Hi.", "Why?"]}, "x.jsonl:1")
        ['Hi.', 'Why?']
        >>> record_texts({"messages": [{"role": "user", "content": "Hi."}]}, "x.jsonl:2")
        ['Hi.']

    Raises:
        ValueError: none of ``text``, ``turns``, ``messages``, ``conversations`` holds text.
    """
    if isinstance(record, dict):
        if isinstance(record.get("text"), str):
            return [record["text"]]
        turns = record.get("turns")
        if isinstance(turns, list) and all(isinstance(t, str) for t in turns):
            return turns
        for key, field in (("messages", "content"), ("conversations", "value")):
            items = record.get(key)
            if isinstance(items, list) and all(isinstance(m, dict) for m in items):
                texts = [m.get(field, m.get("content")) for m in items]
                if all(isinstance(t, str) for t in texts):
                    return texts
    raise ValueError(
        f"{where}: expected an object with 'text' (a string), 'turns' (strings), "
        "'messages' or 'conversations' (objects with text)"
    )


def load_tokenizer(model: str):
    """The tokenizer of ``model``: from a local HF directory without loading the weights;
    otherwise through :func:`specdec.models.loading.load` (embedded, GGUF, hub id).

    Raises:
        FileNotFoundError, ValueError: as :func:`~specdec.models.loading.load`.
    """
    from specdec.models.loading import load
    from specdec.tokenizer import Tokenizer

    directory = Path(model).expanduser()
    if directory.is_dir():
        from transformers import AutoTokenizer

        return Tokenizer(AutoTokenizer.from_pretrained(str(directory)), name=model)
    return load(model).tokenizer
