"""Logits -> processed logits -> probabilities, and sampling with an explicit generator.

Two stages, both applied to every verified row:

* :func:`process_logits`: the transforms that read a row's history or shift its logits
  (``logit_bias``, ``min_tokens``, repetition / frequency / presence penalties, user
  processors). Greedy decoding takes the argmax of its result.
* :func:`logits_to_probs`: temperature, ``min_p``, top-k, top-p and the softmax.

Rejection sampling is lossless with respect to the processed target distribution (what
plain sampling would draw from). A draft may use any distribution: transforming draft
logits too only raises acceptance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdec.config import SamplingParams


class NoAllowedToken(ValueError):
    """A verified row that the request itself must sample from has no allowed token: its
    transforms (a grammar, ``bad_words``, ``min_tokens``, a user processor) put -inf on
    every token. The request fails with this message; other requests are unaffected."""


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Greedy decoding's choice: ``logits.argmax(-1)``, the first index of each row's
    maximum (a NaN counts as the maximum).

    Args:
        logits: ``[V]`` or ``[N, V]``, any dtype and device.

    Returns:
        ``[]`` or ``[N]`` int64: the same indices as ``torch.argmax``. Float32 CPU rows run
        the native runtime's vectorised scan where its extension is loaded already
        (:func:`specdec.runtime.kernels.argmax_rows`: PyTorch's argmax takes about 0.12 ms
        for one 49152-wide row on a 2-core Xeon, a few percent of a plain decoding step);
        anything else runs PyTorch's.
    """
    if (
        logits.dtype == torch.float32
        and logits.device.type == "cpu"
        and logits.dim() in (1, 2)
        and logits.numel() > 0
        and logits.stride(-1) == 1
    ):
        from specdec.runtime import kernels

        if kernels.loaded():
            if logits.dim() == 1:
                return kernels.argmax_rows(logits.view(1, -1))[0]
            return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def dead_rows(logits: torch.Tensor) -> list[int]:
    """Rows of ``[N, V]`` processed logits where no token is allowed (every entry -inf or
    NaN)."""
    alive = torch.isfinite(logits).any(dim=-1) | (logits == float("inf")).any(dim=-1)
    return torch.nonzero(~alive).flatten().tolist()


def no_allowed_token(history: TokenHistory | None, params) -> NoAllowedToken:
    """The error for a dead end after ``history``'s output."""
    causes = []
    if params.structured_outputs is not None:
        causes.append(f"the {params.structured_outputs.kind} constraint")
    if params.bad_words_token_ids:
        causes.append("bad_words")
    if params.min_tokens:
        causes.append("min_tokens")
    if params.logits_processors:
        causes.append("logits_processors")
    where = "" if history is None else f" after {len(history.output_ids)} output tokens"
    return NoAllowedToken(
        f"no token is allowed{where}: {' and '.join(causes) or 'the transforms'} exclude every "
        "token (e.g. a bad word that the grammar requires)"
    )


@dataclass(frozen=True)
class TokenHistory:
    """What the history-dependent transforms read about one sequence.

    Attributes:
        prompt_ids: the prompt (read by ``repetition_penalty``).
        output_ids: the output so far, committed tokens only (the pending last token
            included): rows of a verification add their own draft prefix to it.
        stop_token_ids: what ``min_tokens`` suppresses (EOS, end-of-turn and the
            request's ``stop_token_ids``; empty with ``ignore_eos`` and no stop ids).
        grammar: the sequence's grammar state at the committed output (structured
            output), anything with :meth:`~specdec.structured.GrammarState.allowed`
            ``(prefixes) -> [N, V] bool``; ``None`` without a grammar.
    """

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    stop_token_ids: Sequence[int] = ()
    grammar: object | None = None


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    history: TokenHistory | None = None,
    prefixes: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """The history-dependent and additive transforms, row by row with each row's own
    history (vLLM's order):

    0. a grammar (``history.grammar``, structured output): ``z[t] = -inf`` for every token
       the grammar does not allow after the row's history; applied first, so nothing
       after it can bring a forbidden token back;
    1. ``logit_bias``: ``z[t] += bias[t]``;
    2. ``min_tokens``: ``z[s] = -inf`` for every stop token ``s`` while the row's output
       length (history + prefix) is below ``min_tokens`` (except where the grammar allows
       nothing else: a complete grammar ends the output);
    2b. bad words (``bad_words_token_ids``): for each sequence ``s``, ``z[s[-1]] = -inf``
       when the row's output (history + prefix) ends with ``s[:-1]`` (always for one
       token), as vLLM's bad-words processor;
    3. ``repetition_penalty`` r (CTRL, Keskar et al. 2019, eq. 2): for each token of the
       prompt or the row's output, ``z / r`` if ``z > 0`` else ``z * r``;
    4. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI): ``z[t] -= f c[t] + p
       [c[t] > 0]`` with ``c[t]`` the count of ``t`` in the row's output;
    5. ``logits_processors``, in order, on each row with its output ids.

    Args:
        logits: ``[N, V]`` raw logits (any float dtype).
        params: the request's sampling parameters.
        history: the sequence's prompt and committed output (needed when
            ``params.needs_history``).
        prefixes: per row, the tokens between the committed output and that row (a
            chain's row i: its first i draft tokens; a tree node's row: the tokens of its
            root-to-node path); ``None`` = every row right after the committed output.

    Returns:
        ``[N, V]`` float32 processed logits (``logits`` itself, as float32, when
        ``params.transforms_logits`` is false).

    Raises:
        ValueError: a transform needs ``history`` and got none (or ``structured_outputs``
            without ``history.grammar``), ``prefixes`` does not have
            one entry per row, or a ``logit_bias`` id is outside the vocabulary.
    """
    z = logits.float()
    if not params.transforms_logits:
        return z
    n, vocab = z.shape
    if prefixes is None:
        prefixes = [()] * n
    if len(prefixes) != n:
        raise ValueError(f"{len(prefixes)} prefixes for {n} rows")
    if params.needs_history and history is None:
        raise ValueError(
            "penalties, min_tokens, logits_processors and structured output need the token history"
        )
    if params.structured_outputs is not None and history.grammar is None:
        raise ValueError("structured_outputs needs the sequence's grammar state in the history")
    z = z.clone()
    device = z.device
    grammar = None if history is None else history.grammar
    allowed = None
    if grammar is not None:
        allowed = grammar.allowed(prefixes).to(device)
        if allowed.shape[1] < vocab:  # the grammar's vocabulary is narrower: never allowed
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        z.masked_fill_(~allowed[:, :vocab], float("-inf"))
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        if int(ids.max()) >= vocab:
            raise ValueError(f"logit_bias names token {int(ids.max())}; the vocabulary has {vocab}")
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
        z[:, ids.to(device)] += bias.to(device)
    if not params.needs_history:
        return z
    done = len(history.output_ids)
    if params.min_tokens > 0 and history.stop_token_ids:
        early = [i for i, pre in enumerate(prefixes) if done + len(pre) < params.min_tokens]
        stops = [s for s in history.stop_token_ids if 0 <= s < vocab]
        if early and stops and allowed is not None:  # keep what a complete grammar needs
            others = allowed.clone()
            others[:, stops] = False
            early = [i for i in early if bool(others[i].any())]
        if early and stops:
            rows = torch.tensor(early, dtype=torch.long, device=device)
            cols = torch.tensor(stops, dtype=torch.long, device=device)
            z[rows.unsqueeze(1), cols.unsqueeze(0)] = float("-inf")
    if params.bad_words_token_ids:
        _ban_bad_words(z, params.bad_words_token_ids, history.output_ids, prefixes)
    penalties = (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )
    if penalties:
        counts = _output_counts(history.output_ids, prefixes, vocab, device)
        seen = counts > 0
        if params.repetition_penalty != 1.0:
            prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = torch.as_tensor(list(history.prompt_ids), dtype=torch.long, device=device)
            prompt[ids[ids < vocab]] = True
            hit = seen | prompt
            r = params.repetition_penalty
            z = torch.where(hit, torch.where(z > 0, z / r, z * r), z)
        if params.frequency_penalty != 0.0:
            z = z - params.frequency_penalty * counts
        if params.presence_penalty != 0.0:
            z = z - params.presence_penalty * seen.float()
    for processor in params.logits_processors:
        for i, pre in enumerate(prefixes):
            out = processor(list(history.output_ids) + list(pre), z[i])
            z[i] = torch.as_tensor(out, dtype=torch.float32, device=device)
    return z


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability under the target's raw distribution.

    Attributes:
        token_id: the emitted token.
        logprob: ``log p(token_id)`` (float, natural log, <= 0).
        top: the most probable tokens as ``(token id, log-probability)`` pairs, most
            probable first (``SamplingParams.logprobs`` of them; ties by lower id).
        rank: 1 + how many tokens are strictly more probable (vLLM's ``rank``).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """Log-probabilities of ``token_ids[i]`` under row i of ``logits`` (raw target logits).

    Args:
        logits: ``[n, V]`` raw logits, row i the distribution ``token_ids[i]`` was drawn
            at.
        token_ids: ``n`` emitted tokens.
        top: how many most probable tokens to list per row (0 to 20).

    Returns:
        ``n`` :class:`TokenLogprob` (``log_softmax`` in float32; each row's ``top`` most
        probable first, equal ones in token id order, as ``argmax`` breaks ties).
    """
    if logits.shape[0] != len(token_ids):
        raise ValueError(f"{logits.shape[0]} rows for {len(token_ids)} tokens")
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen_t = logp[torch.arange(len(token_ids)), torch.as_tensor(list(token_ids))]
    ranks = ((logp > chosen_t.unsqueeze(1)).sum(dim=-1) + 1).tolist()
    chosen = chosen_t.tolist()
    tops: list[tuple] = [()] * len(token_ids)
    if top > 0:
        # the `top` largest, equal ones in id order, as argmax (greedy decoding) breaks
        # ties: the greedy token is first among its equals and never left out for one of
        # them (topk leaves both open; a bfloat16 model's logits tie often)
        kth = torch.topk(logp, top, dim=-1).values[:, -1:]
        tops = []
        for row, bound in zip(logp, kth, strict=True):
            above = torch.nonzero(row > bound).flatten()
            equal = torch.nonzero(row == bound).flatten()[: top - above.numel()]
            ids = torch.cat([above, equal]).tolist()
            pairs = zip(ids, row[ids].tolist(), strict=True)
            tops.append(tuple(sorted(pairs, key=lambda p: (-p[1], p[0]))))
    return [
        TokenLogprob(int(t), float(lp), tp, int(r))
        for t, lp, tp, r in zip(token_ids, chosen, tops, ranks, strict=True)
    ]


def _ban_bad_words(z: torch.Tensor, words, output_ids, prefixes) -> None:
    """``z[i, s[-1]] = -inf`` for each bad sequence ``s`` whose other tokens end row i's
    output (in place)."""
    vocab = z.shape[1]
    output = list(output_ids)
    for i, prefix in enumerate(prefixes):
        history = output + list(prefix)
        for word in words:
            if word[-1] >= vocab:
                continue
            head = list(word[:-1])
            if not head or history[len(history) - len(head) :] == head:
                z[i, word[-1]] = float("-inf")


def _output_counts(output_ids, prefixes, vocab: int, device) -> torch.Tensor:
    """``[N, V]`` float32: how often each token occurs in each row's output (the
    committed output plus the row's prefix)."""
    base = torch.zeros(vocab, dtype=torch.float32, device=device)
    ids = torch.as_tensor(list(output_ids), dtype=torch.long, device=device)
    if ids.numel():
        ids = ids[ids < vocab]
        base.index_add_(0, ids, torch.ones(ids.numel(), device=device))
    counts = base.expand(len(prefixes), vocab).clone()
    rows = [i for i, pre in enumerate(prefixes) for _ in pre]
    if rows:
        tokens = torch.tensor([t for pre in prefixes for t in pre], dtype=torch.long, device=device)
        keep = tokens < vocab
        counts.index_put_(
            (torch.tensor(rows, device=device)[keep], tokens[keep]),
            torch.ones(int(keep.sum()), device=device),
            accumulate=True,
        )
    return counts


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits into the sampling distribution.

    Args:
        logits: ``[N, V]`` float tensor of raw logits.
        params: temperature (> 0 here), ``min_p``, top-k and top-p settings (applied in
            that order, vLLM's; the history transforms come before, see
            :func:`process_logits`).

    Returns:
        ``[N, V]`` float32 probabilities; each row sums to 1. Tokens removed by top-k /
        top-p get probability exactly 0.

    Raises:
        ValueError: if ``params.temperature`` is 0 (greedy has no distribution; use argmax).

    Example:
        >>> import torch
        >>> params = SamplingParams(temperature=1.0, top_k=2)
        >>> p = logits_to_probs(torch.tensor([[2.0, 1.0, 0.0]]), params)
        >>> [round(x, 4) for x in p[0].tolist()]
        [0.7311, 0.2689, 0.0]
    """
    if params.temperature == 0:
        raise ValueError("greedy decoding (temperature 0) has no distribution; use argmax")
    logits = _apply_temperature(logits.float(), params.temperature)
    if params.min_p > 0.0:
        logits = _apply_min_p(logits, params.min_p)
    vocab_size = logits.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = _apply_top_p(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def _apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``(logits - row max) / T``, safe for every finite ``T > 0``.

    Shifting by the row maximum first (softmax is shift-invariant) keeps the maximum at 0,
    so a tiny temperature sends the other logits to ``-inf`` instead of overflowing the
    maximum to ``+inf`` (``inf - inf = nan``). ``T`` is floored at float32's smallest
    normal number, below which it would round to 0 in float32 arithmetic: a temperature
    that small is greedy in effect (the distribution is uniform over the tied maxima). It
    is capped at float32's largest number, above which it would round to ``inf`` and turn
    the ``-inf`` of masked tokens (a draft vocabulary's, top-k's) into ``nan``
    (``-inf / inf``): a temperature that large is uniform over the unmasked tokens either
    way.
    """
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    info = torch.finfo(torch.float32)
    return shifted / min(max(temperature, info.tiny), info.max)


def _apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's largest (Nguyen
    et al. 2024): ``p_t < min_p p_max`` iff ``z_t - z_max < log(min_p)`` (``logits`` are
    shifted so that ``z_max = 0``, see :func:`_apply_temperature`); the most probable
    token always stays."""
    return logits.masked_fill(logits < math.log(min_p), float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask all but the smallest prefix of sorted tokens whose mass reaches ``top_p``."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    remove_sorted = mass_before >= top_p
    remove_sorted[..., 0] = False  # the most probable token always stays (top_p may be ~0)
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row.

    The draw runs on the generator's device (a CPU draft's probabilities beside a GPU
    target's generator, or the reverse), so a seeded generation is the same stream of
    draws wherever each model runs.

    Args:
        probs: ``[N, V]`` float probabilities (rows need not be exactly normalised).
        generator: the ``torch.Generator`` every random draw of a generation uses.

    Returns:
        ``[N]`` int64 token ids, on ``probs``' device.
    """
    if probs.device != generator.device:
        ids = torch.multinomial(probs.to(generator.device), 1, generator=generator)
        return ids.squeeze(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed`` (a fresh seed if ``None``)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@runtime_checkable
class RandomSource(Protocol):
    """Where a verifier's random draws come from.

    Production code passes a ``torch.Generator`` (wrapped by :func:`as_random_source`);
    the exact-law oracle (:mod:`specdec.verify.exact`) passes a source that replays
    scripted values, so it can integrate the production verifier's output over every draw.
    """

    def uniform(self, n: int, device: torch.device | str) -> torch.Tensor:
        """``[n]`` floats uniform on [0, 1)."""

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        """``[N]`` int64: one token per row of ``[N, V]`` (unnormalised) probabilities."""


class GeneratorSource:
    """A :class:`RandomSource` over a ``torch.Generator`` (``torch.rand`` and
    ``torch.multinomial``, exactly the draws the verifiers have always made)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def uniform(self, n: int, device: torch.device | str) -> torch.Tensor:
        """Drawn on the generator's device (see :func:`sample`), returned on ``device``."""
        return torch.rand(n, generator=self.generator, device=self.generator.device).to(device)

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        return sample(probs, self.generator)


def as_random_source(generator: torch.Generator | RandomSource) -> RandomSource:
    """``generator`` as a :class:`RandomSource` (a ``torch.Generator`` is wrapped)."""
    if isinstance(generator, torch.Generator):
        return GeneratorSource(generator)
    return generator
