"""REST: draft the continuations that followed the context's longest suffix in a datastore.

Source: He et al., "REST: Retrieval-Based Speculative Decoding" (NAACL 2024,
arXiv:2311.08252), §3: a datastore of text tokenized with the target's tokenizer is indexed
by a suffix array (§3.1); each step takes the longest suffix of the context (from
``n_max = 16`` tokens down, REST's reference code stops at 2) that occurs in the datastore,
gathers the continuations that followed its occurrences (§3.2, "exact match"), builds a
trie of them with occurrence counts and drafts its most frequent paths as a token tree
(§3.3, "draft construction"). The reference implementation (``DraftRetriever``) retrieves at
most 5000 occurrences and keeps 10 tokens of each continuation; these are the defaults of
:class:`~specdec.drafters.options.RetrievalOptions`.

Differences from the reference code, all on the drafting side (verification is the
engine's, so output is unchanged):

* documents are separated, so a match or a continuation never crosses a document boundary;
* when a suffix occurs more than ``max_occurrences`` times, the occurrences kept are evenly
  spaced over the suffix array's range (the reference takes the first ones, which are the
  lexicographically smallest continuations);
* a trie node's children are offered to specdec's tree builders ranked by count with score
  ``count / parent's count``; a path's product of scores telescopes to ``count(node) /
  count(root)``, so a builder that keeps the ``budget`` best nodes (``dynamic`` with a
  wide ``top_k``) keeps REST's tree of the ``choices`` most frequent trie nodes. A chain
  follows the most frequent child.

The datastore is one ``.npz`` file: ``tokens`` (``int32``, documents each followed by
:data:`SEPARATOR`), ``suffix_array`` (positions of every non-separator token, sorted by the
``max_match`` tokens that start there) and ``metadata`` (JSON: format, version,
``max_match``, counts, and the tokenizer's identity, checked when the drafter loads it).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from specdec.config import SamplingParams
from specdec.drafters.base import DrafterBase, DraftProposal
from specdec.drafters.options import RetrievalOptions
from specdec.trees.builders import Expansion
from specdec.trees.tree import ROOT

#: Token value that ends every document in the flat token array (never a real token id).
SEPARATOR = -1
#: ``metadata["format"]`` of a datastore file.
FORMAT = "specdec-retrieval-datastore"
#: Version of the file layout; a file of another version is refused.
FORMAT_VERSION = 1
#: Longest ``max_match`` a datastore can be indexed for.
MAX_INDEX_DEPTH = 256


# ------------------------------------------------------------------------- suffix array
def suffix_array(tokens: np.ndarray, depth: int) -> np.ndarray:
    """Positions of the non-separator tokens, sorted by the ``depth`` tokens starting there.

    Prefix doubling (Manber & Myers 1993) in numpy: ranks of windows of ``w`` tokens give
    ranks of windows of ``min(2w, depth)`` tokens by one sort of rank pairs (the two halves
    may overlap), so ``ceil(log2(depth))`` sorts in all. A window is cut at the first
    separator (what follows it sorts as separators), so the order never depends on the
    next document; equal windows keep position order.

    Args:
        tokens: ``[n]`` integer token ids, every document followed by :data:`SEPARATOR`
            (the last element is a separator).
        depth: tokens compared (>= 1).

    Returns:
        ``[n - num_separators]`` positions (``int32``, or ``int64`` beyond 2**31 tokens).

    Example:
        >>> tokens = np.array([5, 6, 5, 7, -1, 5, 6, -1])
        >>> suffix_array(tokens, depth=2).tolist()  # 5 6, 5 6, 5 7, 6 -|, 6 5, 7 -|
        [0, 5, 2, 6, 1, 3]
    """
    n = len(tokens)
    positions = np.arange(n)
    separators = np.flatnonzero(tokens == SEPARATOR)
    room = separators[np.searchsorted(separators, positions)] - positions  # before the next
    # dense ranks: separators (the smallest value) rank 0, below every token
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64).reshape(n)
    num_distinct = n - len(separators) + 1
    width = 1
    while width < depth and rank.max() + 1 < num_distinct:
        shift = min(2 * width, depth) - width
        second = np.zeros(n, np.int64)
        whole = room >= shift  # no separator among the first `shift` tokens
        second[whole] = rank[positions[whole] + shift]
        key = rank * (rank.max() + 1) + second
        order = np.argsort(key, kind="stable")
        ranked = key[order]
        rank = np.empty(n, np.int64)
        rank[order] = np.concatenate(([0], np.cumsum(ranked[1:] != ranked[:-1])))
        width += shift
    order = np.argsort(rank, kind="stable")
    order = order[rank[order] > 0]
    return order.astype(np.int32 if n < 2**31 else np.int64)


def suffix_array_reference(tokens: Sequence[int], depth: int) -> list[int]:
    """:func:`suffix_array` by a plain sort of the cut windows (slow, obviously correct)."""
    tokens = [int(t) for t in tokens]

    def window(i: int) -> tuple[int, ...]:
        cut = tokens[i : i + depth]
        if SEPARATOR in cut:
            cut = cut[: cut.index(SEPARATOR)]
        return tuple(cut + [SEPARATOR] * (depth - len(cut)))

    keep = [i for i, t in enumerate(tokens) if t != SEPARATOR]
    return sorted(keep, key=lambda i: (window(i), i))


# ---------------------------------------------------------------------- tokenizer identity
@dataclass(frozen=True)
class TokenizerInfo:
    """The identity of the tokenizer a datastore was built with.

    Attributes:
        name: a label (the model's name for a specdec Tokenizer, else ``name_or_path``).
        vocab_size: tokens it knows (added tokens included).
        vocab_sha256: SHA-256 of its sorted ``token -> id`` table (what identity means).
    """

    name: str
    vocab_size: int
    vocab_sha256: str

    @classmethod
    def of(cls, tokenizer) -> TokenizerInfo:
        """From a :class:`~specdec.tokenizer.Tokenizer` or a transformers tokenizer (anything
        with ``get_vocab()`` and ``len``)."""
        vocab = tokenizer.get_vocab()
        digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()
        if hasattr(tokenizer, "hf"):  # specdec's Tokenizer: its model's name
            name = tokenizer.name
        else:
            name = getattr(tokenizer, "name_or_path", "")
        return cls(str(name or "tokenizer"), len(tokenizer), digest)

    def same_vocabulary(self, other: TokenizerInfo) -> bool:
        return (self.vocab_size, self.vocab_sha256) == (other.vocab_size, other.vocab_sha256)


def encode_documents(texts: Iterable[str], tokenizer, batch_size: int = 256) -> Iterator[list[int]]:
    """Tokenize documents in batches (no special tokens), one id list per text, in order.

    Args:
        texts: the documents.
        tokenizer: a :class:`~specdec.tokenizer.Tokenizer` or a transformers tokenizer.
        batch_size: texts per call of the (fast, batched) tokenizer.
    """
    hf = getattr(tokenizer, "hf", tokenizer)
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            yield from hf(batch, add_special_tokens=False, verbose=False)["input_ids"]
            batch = []
    if batch:
        yield from hf(batch, add_special_tokens=False, verbose=False)["input_ids"]


# ---------------------------------------------------------------------------- datastore
class Match(NamedTuple):
    """The longest matched suffix: its ``length`` in tokens and its range
    ``[lo, hi)`` of the suffix array (``hi - lo`` occurrences)."""

    length: int
    lo: int
    hi: int


class Datastore:
    """A token corpus with a suffix array: exact search of token sequences of up to
    ``max_match`` tokens, and the continuations that followed them.

    Build one with :meth:`build` (token ids) or ``specdec datastore build`` (text files);
    :meth:`save` / :meth:`load` keep it in one ``.npz`` file.

    Args:
        tokens: ``[n]`` ``int32`` token ids, every document followed by :data:`SEPARATOR`.
        suffix_array: ``[n - num_documents]`` positions, see :func:`suffix_array`.
        max_match: the depth the suffix array is sorted to (longest searchable sequence).
        tokenizer: the :class:`TokenizerInfo` of the tokenizer the ids come from.

    Example:
        >>> toy = TokenizerInfo("toy", vocab_size=10, vocab_sha256="0" * 64)
        >>> store = Datastore.build([[5, 6, 7, 5, 6, 8], [5, 6, 7]], toy, max_match=4)
        >>> store.num_documents, store.num_tokens
        (2, 9)
        >>> store.occurrences([5, 6]).tolist(), store.occurrences([6, 7]).tolist()
        ([7, 0, 3], [8, 1])
        >>> match = store.longest_match([1, 5, 6], max_match=4, min_match=1)  # "5 6"
        >>> match.length, store.suffix_array[match.lo : match.hi].tolist()
        (2, [7, 0, 3])
        >>> store.continuations(match, length=2, max_occurrences=10).tolist()  # -1: the end
        [[7, -1], [7, 5], [8, -1]]
    """

    def __init__(
        self,
        tokens: np.ndarray,
        suffix_array: np.ndarray,
        max_match: int,
        tokenizer: TokenizerInfo,
    ) -> None:
        self.tokens = tokens
        self.suffix_array = suffix_array
        self.max_match = max_match
        self.tokenizer = tokenizer
        self.num_tokens = len(suffix_array)
        self.num_documents = len(tokens) - len(suffix_array)

    @classmethod
    def build(cls, documents: Iterable[Sequence[int]], tokenizer, max_match: int = 16) -> Datastore:
        """Index token-id documents (empty ones are skipped).

        Args:
            documents: token id lists, from the target's tokenizer.
            tokenizer: that tokenizer (or its :class:`TokenizerInfo`).
            max_match: longest searchable context suffix (1 to 256).

        Raises:
            ValueError: ``max_match`` out of range, no tokens at all, or a token id outside
                ``[0, vocab_size)``.
        """
        if isinstance(max_match, bool) or not isinstance(max_match, int):
            raise ValueError(f"max_match must be an integer, got {max_match!r}")
        if not 1 <= max_match <= MAX_INDEX_DEPTH:
            raise ValueError(f"max_match must be in [1, {MAX_INDEX_DEPTH}], got {max_match}")
        info = tokenizer if isinstance(tokenizer, TokenizerInfo) else TokenizerInfo.of(tokenizer)
        parts = []
        for doc in documents:
            if len(doc):
                parts += [np.asarray(doc, dtype=np.int64), np.array([SEPARATOR])]
        if not parts:
            raise ValueError("the corpus has no tokens: nothing to index")
        tokens = np.concatenate(parts)
        real = tokens[tokens != SEPARATOR]
        if real.min() < 0 or real.max() >= info.vocab_size:
            bad = int(real.min()) if real.min() < 0 else int(real.max())
            raise ValueError(
                f"token id {bad} is outside the tokenizer's vocabulary [0, {info.vocab_size})"
            )
        tokens = tokens.astype(np.int32)
        return cls(tokens, suffix_array(tokens, max_match), max_match, info)

    # ------------------------------------------------------------------------- search
    def find(self, pattern: Sequence[int]) -> tuple[int, int]:
        """The range ``[lo, hi)`` of the suffix array whose positions start with
        ``pattern`` (``lo == hi`` when it does not occur).

        Raises:
            ValueError: ``pattern`` is empty or longer than ``max_match``.
        """
        pattern = [int(t) for t in pattern]
        if not 1 <= len(pattern) <= self.max_match:
            raise ValueError(
                f"a search pattern has 1 to {self.max_match} tokens, got {len(pattern)}"
            )
        tokens, m = self.tokens, len(pattern)

        def key(position) -> list[int]:  # compares like the cut window: a separator stops it
            return tokens[position : position + m].tolist()

        lo = bisect.bisect_left(self.suffix_array, pattern, key=key)
        hi = bisect.bisect_right(self.suffix_array, pattern, lo=lo, key=key)
        return lo, hi

    def occurrences(self, pattern: Sequence[int]) -> np.ndarray:
        """Positions where ``pattern`` starts, in suffix-array order (``[count]`` int)."""
        lo, hi = self.find(pattern)
        return self.suffix_array[lo:hi]

    def longest_match(self, context: Sequence[int], max_match: int, min_match: int) -> Match | None:
        """The longest suffix of ``context`` (``min_match`` to ``max_match`` tokens) that
        occurs in the datastore, or ``None`` (REST §3.2).

        Occurrence is monotone in the length (a suffix that occurs has shorter suffixes
        that occur), so the length is found by binary search.
        """
        low, high = min_match, min(max_match, self.max_match, len(context))
        best = None
        while low <= high:
            length = (low + high) // 2
            lo, hi = self.find(context[len(context) - length :])
            if hi > lo:
                best, low = Match(length, lo, hi), length + 1
            else:
                high = length - 1
        return best

    def continuations(self, match: Match, length: int, max_occurrences: int) -> np.ndarray:
        """The ``length`` tokens after up to ``max_occurrences`` occurrences of ``match``
        (evenly spaced over its range when there are more).

        Returns:
            ``[num_occurrences, length]`` ``int64``; :data:`SEPARATOR` from a document's end.
        """
        count = match.hi - match.lo
        keep = min(count, max_occurrences)
        picks = match.lo + np.arange(keep, dtype=np.int64) * count // keep
        starts = self.suffix_array[picks].astype(np.int64) + match.length
        index = np.minimum(starts[:, None] + np.arange(length), len(self.tokens) - 1)
        rows = self.tokens[index].astype(np.int64)
        rows[np.cumsum(rows == SEPARATOR, axis=1) > 0] = SEPARATOR
        return rows

    # ---------------------------------------------------------------------- storage
    def check_tokenizer(self, tokenizer, where: str | os.PathLike = "") -> None:
        """Refuse a tokenizer other than the one the datastore was built with.

        Raises:
            ValueError: the vocabularies differ (the message names both tokenizers).
        """
        other = TokenizerInfo.of(tokenizer)
        label = f"retrieval datastore {where}" if where else "the retrieval datastore"
        if not self.tokenizer.same_vocabulary(other):
            raise ValueError(
                f"{label} was built with tokenizer "
                f"{self.tokenizer.name!r} (vocabulary {self.tokenizer.vocab_size}), but the "
                f"target's tokenizer is {other.name!r} (vocabulary {other.vocab_size}, "
                "different tokens); rebuild it with `specdec datastore build FILES... -o "
                "STORE --model TARGET`"
            )

    def metadata(self) -> dict:
        """What the file's ``metadata`` entry holds."""
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "max_match": self.max_match,
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "tokenizer": asdict(self.tokenizer),
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the datastore to ``path`` (exactly that name; written to a temporary file
        beside it, then renamed, so an interrupted save leaves no half file).

        Raises:
            OSError: ``path`` cannot be written (the message names it).
        """
        path = Path(path).expanduser()
        meta = np.frombuffer(json.dumps(self.metadata()).encode(), dtype=np.uint8)
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        except OSError as error:
            raise OSError(f"cannot write the datastore {path}: {error.strerror or error}") from None
        try:
            with os.fdopen(fd, "wb") as handle:
                np.savez(handle, tokens=self.tokens, suffix_array=self.suffix_array, metadata=meta)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a datastore is shareable data
            os.replace(tmp, path)
        except OSError as error:
            Path(tmp).unlink(missing_ok=True)
            raise OSError(f"cannot write the datastore {path}: {error.strerror or error}") from None

    @classmethod
    def load(cls, path: str | os.PathLike, tokenizer=None) -> Datastore:
        """Read a datastore written by :meth:`save`, optionally checking the tokenizer.

        Raises:
            ValueError: the file is missing, unreadable, corrupt or of another format
                version, or was built with another tokenizer (each names the path).
        """
        path = Path(path).expanduser()
        if not path.is_file():
            raise ValueError(
                f"retrieval datastore not found: {path} (build one with "
                f"`specdec datastore build FILES... -o {path} --model TARGET`)"
            )
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(bytes(data["metadata"]).decode())
                tokens, array = data["tokens"], data["suffix_array"]
        except Exception as error:  # any read failure means "not a datastore / corrupt"
            reason = type(error).__name__  # numpy's text can suggest unsafe pickle loading
            raise ValueError(
                f"cannot read retrieval datastore {path}: not a specdec datastore file, or "
                f"corrupt ({reason}); build one with `specdec datastore build`"
            ) from None
        store = _checked(path, tokens, array, meta)
        if tokenizer is not None:
            store.check_tokenizer(tokenizer, path)
        return store


def _checked(path: Path, tokens: np.ndarray, array: np.ndarray, meta) -> Datastore:
    """A :class:`Datastore` from a file's arrays after consistency checks."""

    def refuse(reason: str):
        raise ValueError(f"retrieval datastore {path} is not usable: {reason}")

    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        refuse(f"its metadata does not say format {FORMAT!r}")
    if meta.get("version") != FORMAT_VERSION:
        refuse(f"format version {meta.get('version')!r}, this specdec reads {FORMAT_VERSION}")
    try:
        info = TokenizerInfo(**meta["tokenizer"])
        max_match = int(meta["max_match"])
    except (KeyError, TypeError, ValueError):
        refuse("its metadata lacks the tokenizer or max_match")
    if tokens.ndim != 1 or tokens.dtype != np.int32 or not len(tokens):
        refuse("'tokens' is not a non-empty int32 vector")
    if tokens[-1] != SEPARATOR or array.ndim != 1 or array.dtype.kind != "i":
        refuse("'tokens' does not end a document or 'suffix_array' is not integer")
    num_tokens = int(np.count_nonzero(tokens != SEPARATOR))
    if not len(array) == num_tokens == meta.get("num_tokens"):
        refuse("the suffix array does not match the tokens (truncated file?)")
    if len(array) and (array.min() < 0 or array.max() >= len(tokens)):
        refuse("the suffix array points outside the tokens")
    return Datastore(tokens, array, max_match, info)


# ----------------------------------------------------------------------- continuation trie
class TrieNode(NamedTuple):
    """A trie node: rows ``[lo, hi)`` of the sorted continuations share its path of
    ``depth`` tokens; ``count = hi - lo`` continuations pass through it."""

    lo: int
    hi: int
    depth: int

    @property
    def count(self) -> int:
        return self.hi - self.lo


class ContinuationTrie:
    """The trie of retrieved continuations with counts (REST §3.3).

    Stored implicitly: the continuations sorted lexicographically, so every node is a
    range of rows and its children are the runs of equal tokens in the next column (no
    per-node objects to build in each step).

    Args:
        continuations: ``[num_occurrences, length]`` token ids, :data:`SEPARATOR` after a
            continuation's end (see :meth:`Datastore.continuations`).

    Example:
        >>> trie = ContinuationTrie([[3, 4, -1], [3, 5, 6], [3, 4, 7], [8, -1, -1]])
        >>> trie.count([]), trie.count([3]), trie.count([3, 4]), trie.count([9])
        (4, 3, 2, 0)
        >>> trie.ranked(trie.find([3]), width=4)  # 4 (2 of 3), then 5 (1 of 3)
        ([4, 5], [0.6666666666666666, 0.3333333333333333])
        >>> trie.chain(5)  # 3 (3 of 4), 4 (2 of 3), 7 (the other continuation ends)
        [3, 4, 7]
    """

    def __init__(self, continuations) -> None:
        rows = np.asarray(continuations, dtype=np.int64)
        if rows.ndim != 2:
            raise ValueError(f"continuations must be [rows, length], got shape {rows.shape}")
        # Rows from a datastore's suffix-array range arrive sorted already (mostly).
        self.rows = rows if _is_sorted(rows) else rows[np.lexsort(rows.T[::-1])]
        self.length = rows.shape[1]
        self.root = TrieNode(0, len(rows), 0)

    def _runs(self, node: TrieNode) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, starts, counts)`` of ``node``'s children: runs of equal tokens in the
        node's rows at its depth (starts relative to ``node.lo``; separators dropped)."""
        if node.depth >= self.length or node.count == 0:
            empty = np.zeros(0, np.int64)
            return empty, empty, empty
        column = self.rows[node.lo : node.hi, node.depth]
        starts = np.flatnonzero(np.concatenate(([True], column[1:] != column[:-1])))
        counts = np.diff(np.append(starts, len(column)))
        tokens = column[starts]
        real = tokens != SEPARATOR
        return tokens[real], starts[real], counts[real]

    def children(self, node: TrieNode) -> dict[int, TrieNode]:
        """``{token: child}`` of ``node``, by token id."""
        tokens, starts, counts = self._runs(node)
        return {
            int(t): TrieNode(node.lo + int(s), node.lo + int(s) + int(c), node.depth + 1)
            for t, s, c in zip(tokens, starts, counts, strict=True)
        }

    def child(self, node: TrieNode, token: int) -> TrieNode | None:
        """The child of ``node`` reached by ``token``, or ``None``."""
        if node.depth >= self.length or token < 0:
            return None
        column = self.rows[node.lo : node.hi, node.depth]
        lo, hi = np.searchsorted(column, [token, token + 1])
        return TrieNode(node.lo + int(lo), node.lo + int(hi), node.depth + 1) if hi > lo else None

    def find(self, path: Sequence[int]) -> TrieNode | None:
        """The node at the end of ``path`` from the root, or ``None``."""
        node = self.root
        for token in path:
            node = self.child(node, int(token))
            if node is None:
                return None
        return node

    def count(self, path: Sequence[int]) -> int:
        """Retrieved continuations that start with ``path`` (0 if none)."""
        node = self.find(path)
        return 0 if node is None else node.count

    def ranked(self, node: TrieNode, width: int) -> tuple[list[int], list[float]]:
        """The ``width`` most frequent children of ``node`` (ties: smaller token id first)
        and their scores ``count / node.count`` (in (0, 1])."""
        tokens, _, counts = self._runs(node)
        best = np.lexsort((tokens, -counts))[:width]
        return tokens[best].tolist(), (counts[best] / node.count).tolist()

    def chain(self, max_tokens: int) -> list[int]:
        """The most frequent path from the root, up to ``max_tokens`` tokens."""
        tokens: list[int] = []
        node = self.root
        while len(tokens) < max_tokens:
            best, _ = self.ranked(node, 1)
            if not best:
                break
            tokens.append(best[0])
            node = self.child(node, best[0])
        return tokens

    def paths(self) -> dict[tuple[int, ...], int]:
        """Every node's path and count (the root excluded), for inspection and tests."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[tuple[int, ...], TrieNode]] = [((), self.root)]
        while stack:
            path, node = stack.pop()
            for token, kid in self.children(node).items():
                out[(*path, token)] = kid.count
                stack.append(((*path, token), kid))
        return out


def _is_sorted(rows: np.ndarray) -> bool:
    """Whether the rows of a ``[R, L]`` array are in lexicographic order."""
    if len(rows) < 2:
        return True
    differ = rows[1:] != rows[:-1]
    first = differ.argmax(axis=1)  # first differing column (0 for equal rows)
    pairs = np.arange(len(rows) - 1)
    increasing = rows[1:][pairs, first] > rows[:-1][pairs, first]
    return bool(np.all(increasing | ~differ.any(axis=1)))


def retrieve(
    store: Datastore, context: Sequence[int], options: RetrievalOptions
) -> ContinuationTrie | None:
    """REST's retrieval step: the trie of continuations of the context's longest matching
    suffix (``None`` when no suffix of ``min_match`` tokens or more occurs).

    Args:
        store: the datastore.
        context: the sequence so far (prompt + output; only its last ``max_match`` tokens
            are read).
        options: ``max_match``, ``min_match``, ``max_occurrences``, ``continuation_length``.
    """
    tail = [int(t) for t in context[max(0, len(context) - options.max_match) :]]
    match = store.longest_match(tail, options.max_match, options.min_match)
    if match is None:
        return None
    rows = store.continuations(match, options.continuation_length, options.max_occurrences)
    return ContinuationTrie(rows)


# ------------------------------------------------------------------------------ drafter
class RetrievalDrafter(DrafterBase):
    """REST (see the module docstring); deterministic (``draft_probs=None``).

    The datastore is read-only and shared by all sequences; a sequence holds no state, so
    :meth:`start` returns the drafter itself.

    Args:
        datastore: a loaded :class:`Datastore` (checked against the target's tokenizer by
            the registry's factory).
        options: :class:`~specdec.drafters.options.RetrievalOptions`.

    Raises:
        ValueError: ``options.max_match`` exceeds the depth the datastore was indexed for.
    """

    supports_trees = True

    def __init__(self, datastore: Datastore, options: RetrievalOptions | None = None) -> None:
        self.options = options or RetrievalOptions()
        if self.options.max_match > datastore.max_match:
            raise ValueError(
                f"retrieval max_match={self.options.max_match} exceeds the {datastore.max_match} "
                "tokens the datastore was indexed for (lower max_match, or rebuild the "
                f"datastore with --max-match {self.options.max_match})"
            )
        self.datastore = datastore

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> RetrievalDrafter:
        return self

    def propose(
        self, token_ids: Sequence[int], num_tokens: int, generator: torch.Generator
    ) -> DraftProposal:
        """The most frequent retrieved continuation, up to ``num_tokens`` tokens."""
        if num_tokens <= 0:
            return DraftProposal([])
        trie = retrieve(self.datastore, token_ids, self.options)
        return DraftProposal([] if trie is None else trie.chain(num_tokens))

    def tree_session(self, token_ids: Sequence[int], params: SamplingParams) -> RetrievalSession:
        """A :class:`~specdec.trees.builders.TreeSession` over this step's trie."""
        return RetrievalSession(retrieve(self.datastore, token_ids, self.options))


class RetrievalSession:
    """Tree drafting in the continuation trie: a node's candidates are its children, most
    frequent first, scored ``count / parent's count``; a token the trie does not have
    below a node gets no candidates."""

    def __init__(self, trie: ContinuationTrie | None) -> None:
        self.trie = trie
        self.nodes: list[TrieNode | None] = []

    def _node(self, node: int) -> TrieNode | None:
        if node == ROOT:
            return None if self.trie is None else self.trie.root
        return self.nodes[node]

    def add(self, parent: int, token: int) -> int:
        base = self._node(parent)
        self.nodes.append(None if base is None else self.trie.child(base, int(token)))
        return len(self.nodes) - 1

    def expand(self, nodes: Sequence[int], width: int) -> list[Expansion]:
        out = []
        for n in nodes:
            node = self._node(n)
            out.append(
                Expansion([], []) if node is None else Expansion(*self.trie.ranked(node, width))
            )
        return out

    def close(self) -> None:
        pass
