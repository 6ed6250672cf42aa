"""The batched speculative engine: every live sequence drafts, one forward verifies them all.

One :meth:`Engine.step`:

1. **schedule** (continuous batching, vLLM-style): running sequences first, in arrival
   order, each costing its largest verification (pending token + draft or tree) against a
   per-step token budget that counts draft tokens; then prompt chunks of admitted
   sequences; then new admissions while KV slots are free. A step that verifies a
   sequence for the first time (its prompt just prefilled) runs no prompt chunk: the
   pending token of a prefilled prompt gives its first token, and sharing that step with
   the next wave's prompts would wait for them. KV is accounted per sequence
   in 16-slot blocks as it grows; when the running sequences' next step does not fit, the
   latest arrival is *preempted*: its cache and drafter state are dropped and it waits
   again, to be recomputed from its tokens (prompt + output) when readmitted.
2. **control and draft**: each scheduled sequence's speculation controller
   (:mod:`specdec.control`) chooses how many tokens it drafts this step (0 = a plain
   step; at most its k, capped by its remaining budget; for a tree, the most depth), then
   its own drafter state proposes a chain or a token tree of that size.
3. **one forward**: prompt chunks and verification inputs of every sequence, a ragged
   batch (``forward_batch`` of the backend protocol: one pass on the native backend, one
   forward per sequence on transformers).
4. **verify and commit** per sequence: greedy match, lossless rejection sampling, or tree
   verification; the cache is truncated or compacted (cursor rule); stops apply.

What a sequence computes never depends on the rest of the batch: its tree and its
drafts come from its own settings and state (a sequence that does not fit the token
budget waits a step rather than drafting less), a seeded sampled sequence's controller
decides from that sequence alone (``isolated``: no measured times, no batch; adaptive
controllers of other sequences may look at both, which changes how many tokens they
draft but, greedy verification being exact, never their output), every random draw comes from
its own generator, prompt chunk boundaries are fixed per sequence (``prefill_chunk``), and
on the native backend's exact mode every row's logits are bit-identical whatever the
batch. So each request's output equals single-sequence generation (greedy: token for
token; sampled with a seed: the same tokens), which the tests check against
:func:`specdec.engine.generate.generate_steps` — itself a loop over this engine with one
sequence.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from specdec.config import LOSSY_VERIFIERS, SamplingParams, parse_verifier
from specdec.control.base import (
    SequenceInfo,
    SpeculationController,
    StepOutcome,
    StepView,
    check_choice,
)
from specdec.control.controllers import FixedController
from specdec.control.cost import CostModel
from specdec.control.simulate import TraceStep
from specdec.drafters.base import (
    AuxRows,
    ChainRequest,
    Drafter,
    DraftProposal,
    NoDrafter,
    VerificationFeedback,
    check_drafter,
    needs_isolation,
)
from specdec.engine.commit import StepOutput, finish_step, verify
from specdec.engine.prefix_cache import PrefixCache
from specdec.engine.sequence import Sequence, SequenceStatus
from specdec.engine.stops import WHOLE_TEXT, StopChecker
from specdec.models.base import Backend, BatchItem, check_capture
from specdec.sampling import NoAllowedToken, TokenHistory, token_logprobs
from specdec.structured import GrammarState
from specdec.trees.builders import TreeBuilder, TreeProposal
from specdec.trees.tree import TokenTree
from specdec.verify.tree import verify_tree

logger = logging.getLogger(__name__)

#: KV accounting granularity (slots).
KV_BLOCK = 16
#: ``prefill_chunk``'s default with prefix caching on: the cache's block is one chunk, so
#: smaller chunks share more (measured on the Zen 4 VM, bfloat16: a cold prefill of 0.5-2k
#: tokens costs 5-9% more in chunks of 256 than of 2048, 0-4% in chunks of 512).
PREFIX_CACHE_CHUNK = 256
#: The prefix cache's block with ``invariant_prefill`` (where a block need not be a chunk):
#: vLLM's default block size.
INVARIANT_BLOCK = 16
#: A new sequence's cache starts with room for this many tokens beyond its prompt (or
#: its whole budget if smaller), then grows by doubling.
INITIAL_HEADROOM = 512


def check_prompt_fits(target, prompt_ids: list[int]) -> None:
    """Refuse a prompt that the target cannot generate after.

    Raises:
        ValueError: an empty prompt, or one of at least ``target.max_context`` tokens.
    """
    if not prompt_ids:
        raise ValueError("prompt is empty")
    if len(prompt_ids) >= target.max_context:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens; {target.name} holds at most "
            f"{target.max_context} tokens in total, so nothing could be generated: shorten "
            f"the prompt below {target.max_context} tokens, leaving room for the output"
        )


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler limits.

    Attributes:
        max_num_seqs: most sequences admitted at once (prefilling or running).
        max_num_batched_tokens: most tokens one forward runs: prompt-chunk tokens plus,
            per verified sequence, its pending token and largest draft or tree.
        max_kv_tokens: most KV cache slots accounted over all admitted sequences (in
            16-slot blocks as sequences grow); a sequence's own limit, too: its prompt
            plus output never exceeds this minus its largest verification. A slot of a
            sequence of 2,048 tokens or more takes twice its bytes on the native backend
            in bfloat16 with AVX512-BF16, which keeps that cache's blocks packed as well
            (:meth:`~specdec.runtime.cache.NativeKVCache.pack_tiles`;
            ``SPECDEC_PACKED_KV=off`` turns that off).
        prefill_chunk: prompt tokens per prefill forward (chunked prefill; default:
            2048, or ``max_num_batched_tokens`` if smaller). Fixed per sequence, so a prompt
            is split the same way whatever else runs.
        record_trace: keep every sequence's step trace in ``stats.trace`` (one
            :class:`~specdec.control.simulate.TraceStep` per verification step) for
            the what-if simulator.
        enable_prefix_caching: share prompt-chunk KV across requests
            (:mod:`specdec.engine.prefix_cache`; native backend; vLLM's
            ``enable_prefix_caching``). A hit changes no bit: outputs equal those with the
            cache off at the same ``prefill_chunk``. A block is one prefill chunk, so
            ``prefill_chunk`` then defaults to :data:`PREFIX_CACHE_CHUNK` (256), which like
            any chunk size gives some outputs other bits than the default 2048.
        prefix_cache_bytes: most bytes of KV the prefix cache keeps (default 1 GiB).
        invariant_prefill: compute prompt chunks with the batch-invariant arithmetic of
            decoding rows (``BatchItem.prefill=False``) instead of one product of the
            chunk's own (native backend, exact mode): a token's KV is then the same bits
            whatever chunk, batch or step computed it, prompt or output, so outputs no
            longer depend on ``prefill_chunk``, and the prefix cache shares blocks of
            :data:`INVARIANT_BLOCK` tokens of any earlier sequence, its output included (a
            conversation's next turn reuses the previous answer). Prompts cost more to
            compute: 1.5x for a 1.5k-token prompt on the Zen 4 VM.

    Raises:
        ValueError: a limit that is not a positive integer, or ``prefill_chunk`` above
            ``max_num_batched_tokens``.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_kv_tokens: int = 1 << 16
    prefill_chunk: int | None = None
    record_trace: bool = False
    enable_prefix_caching: bool = False
    prefix_cache_bytes: int = 1 << 30
    invariant_prefill: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.invariant_prefill, bool):
            raise ValueError(f"invariant_prefill must be a bool, got {self.invariant_prefill!r}")
        if self.prefill_chunk is None:
            limit = self.max_num_batched_tokens
            chunked = self.enable_prefix_caching and not self.invariant_prefill
            chunk = PREFIX_CACHE_CHUNK if chunked else 2048
            if isinstance(limit, int) and not isinstance(limit, bool):
                chunk = min(chunk, limit)
            object.__setattr__(self, "prefill_chunk", chunk)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )
        value = self.prefix_cache_bytes
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"prefix_cache_bytes must be an integer >= 0, got {value!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_kv_tokens", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.prefill_chunk > self.max_num_batched_tokens:
            raise ValueError(
                f"prefill_chunk ({self.prefill_chunk}) must not exceed max_num_batched_tokens "
                f"({self.max_num_batched_tokens})"
            )


class Engine:
    """Continuous-batching speculative decoding over one target model.

    Args:
        target: the target backend (its ``forward_batch`` runs each step's rows).
        config: scheduler limits (default :class:`EngineConfig`).
        cost_model: the online :class:`~specdec.control.cost.CostModel` the engine feeds
            with every verification forward's time and every draft's time, and that
            controllers read (default: a new one; pass one to share what it learned).
        prefix_cache: with ``config.enable_prefix_caching``, the
            :class:`~specdec.engine.prefix_cache.PrefixCache` to share (default: a new
            one; pass one to keep it across engines, as :class:`~specdec.LLM` does).

    Raises:
        ValueError: prefix caching on a backend other than the native runtime, or a
            ``prefix_cache`` whose block is not ``config.prefill_chunk``.

    Not thread-safe: one thread drives ``add_request`` / ``step`` / ``abort``.
    """

    def __init__(
        self,
        target: Backend,
        config: EngineConfig | None = None,
        cost_model: CostModel | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.target = target
        self.config = config or EngineConfig()
        self.prefix_cache = None
        if self.config.invariant_prefill:
            check_invariant_prefill(target)
        if self.config.enable_prefix_caching:
            self.prefix_cache = (
                new_prefix_cache(target, self.config) if prefix_cache is None else prefix_cache
            )
            check_prefix_cache(target, self.config, self.prefix_cache)
        self.cost_model = cost_model if cost_model is not None else CostModel()
        self._frozen_cost = CostModel(frozen=True)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted: prefilling or running
        self._live: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        #: tokens run through the target as prefill chunks so far (prompts, and the output
        #: a preempted sequence recomputes; tokens the prefix cache served are not run):
        #: the server's load line reads it per interval
        self.num_prompt_tokens_computed = 0

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        params: SamplingParams,
        *,
        drafter: Drafter | None = None,
        num_speculative_tokens: int = 0,
        tree_builder: TreeBuilder | None = None,
        stop_checker: StopChecker | None = None,
        generator: torch.Generator | None = None,
        controller: SpeculationController | None = None,
        verifier: str = "rejection",
        grammar: GrammarState | None = None,
    ) -> Sequence:
        """Queue a request.

        Args:
            request_id: unique among live requests.
            prompt_ids: ``[L]`` token ids, ``1 <= L < target.max_context``.
            params: sampling parameters.
            drafter: proposes drafts (default: none, plain decoding).
            num_speculative_tokens: most draft tokens per step (k >= 0); capped per step by
                the remaining budget and by ``max_num_batched_tokens - 1``.
            tree_builder: draft a token tree per step (the drafter must support trees).
            stop_checker: stop tokens / strings (default: none).
            generator: this request's random source (default: unseeded).
            controller: chooses each step's number of draft tokens within
                ``num_speculative_tokens`` (default: fixed, always all of them).
            verifier: how a sampled chain is verified: ``"rejection"`` or ``"block"``
                (see :attr:`~specdec.config.SpeculativeConfig.verifier`).
            grammar: the request's fresh grammar state, required with
                ``params.structured_outputs`` (from
                :meth:`specdec.structured.GrammarCompiler.matcher`); it masks every
                verified row and ends the output when complete.

        Returns:
            the queued :class:`Sequence` (its ``status`` and ``tokens`` update as it runs).

        Raises:
            ValueError: duplicate id, empty prompt, a prompt that fills the context or the
                KV limit, k < 0, a ``logit_bias`` id outside the vocabulary,
                ``structured_outputs`` without a grammar state (or one without it), a tree with a
                drafter that cannot draft trees, or a tree larger than
                ``max_num_batched_tokens``.
        """
        cfg = self.config
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already running")
        target = self.target
        check_prompt_fits(target, prompt_ids)
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        outside = [t for t, _ in params.logit_bias if t >= target.vocab_size]
        if outside:
            raise ValueError(
                f"logit_bias names token ids outside the vocabulary ({target.vocab_size} "
                f"tokens): {outside[:5]}"
            )
        if params.bad_words and not params.bad_words_token_ids:
            raise ValueError(
                "bad_words need the tokenizer: pass the params through LLM.resolve_params, "
                "or give bad_words_token_ids"
            )
        outside = [w for w in params.bad_words_token_ids if max(w) >= target.vocab_size]
        if outside:
            raise ValueError(
                f"bad_words_token_ids name token ids outside the vocabulary "
                f"({target.vocab_size} tokens): {list(outside[0])}"
            )
        if (params.structured_outputs is None) != (grammar is None):
            raise ValueError(
                "params.structured_outputs and the grammar state go together: compile it "
                "with specdec.structured.GrammarCompiler(...).matcher(spec)"
            )
        drafter = drafter or NoDrafter()
        check_drafter(drafter)
        aux = getattr(drafter, "max_aux_rows", 0)
        if 1 + aux > cfg.max_num_batched_tokens:
            raise ValueError(
                f"{type(drafter).__name__} adds {aux} rows to a verification; that does not "
                f"fit max_num_batched_tokens={cfg.max_num_batched_tokens}"
            )
        num_speculative_tokens = min(num_speculative_tokens, cfg.max_num_batched_tokens - 1 - aux)
        largest = 1 + num_speculative_tokens + aux
        if tree_builder is not None:
            check_tree_drafter(drafter)
            largest = 1 + tree_builder.max_nodes + aux
            if largest > cfg.max_num_batched_tokens:
                raise ValueError(
                    f"a tree of {tree_builder.max_nodes} nodes (and {aux} auxiliary rows) "
                    f"does not fit max_num_batched_tokens={cfg.max_num_batched_tokens}"
                )
        kv_room = cfg.max_kv_tokens - largest
        if len(prompt_ids) >= kv_room:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; with its largest verification "
                f"({largest}) it needs more than max_kv_tokens={cfg.max_kv_tokens}"
            )
        captures = tuple(getattr(drafter, "captures", ()))
        if captures:
            check_capture(captures, getattr(target, "num_layers", max(captures)))
        max_k = tree_builder.max_depth if tree_builder is not None else num_speculative_tokens
        most = getattr(drafter, "max_draft_tokens", None)
        if most is not None:  # Medusa's heads, a parallel head's block (a tree's depth too)
            max_k = min(max_k, most)
        info = SequenceInfo(
            request_id=request_id,
            max_k=max_k,
            params=params,
            drafter=type(drafter).__name__ + (":tree" if tree_builder is not None else ""),
            tree_nodes_per_depth=(
                tree_builder.max_nodes / max(1, tree_builder.max_depth) if tree_builder else 1.0
            ),
            isolated=needs_isolation(params),
            aux_rows=aux,
            acceptance_prior=getattr(drafter, "acceptance_prior", None),
        )
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            drafter=drafter,
            num_speculative_tokens=num_speculative_tokens,
            tree_builder=tree_builder,
            stop_checker=stop_checker or StopChecker(()),
            generator=generator or torch.Generator(device=target.device),
            max_total=min(len(prompt_ids) + params.max_new_tokens, target.max_context, kv_room),
            arrival=next(self._arrivals),
            observes=bool(getattr(drafter, "observes", False)) or bool(captures),
            max_aux_rows=getattr(drafter, "max_aux_rows", 0),
            captures=captures,
            control=(controller or FixedController()).start(info),
            control_info=info,
            verifier=verifier,
            grammar=grammar,
        )
        seq.stats.verifier = "greedy" if params.greedy else verifier  # what verifies it
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(prompt_ids)
        seq.stats.lossy = not params.greedy and parse_verifier(verifier)[0] in LOSSY_VERIFIERS
        self.waiting.append(seq)
        self._live[request_id] = seq
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV cache and drafter state.

        Returns:
            whether a live request had that id.
        """
        seq = self._live.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort", SequenceStatus.ABORTED)
        return True

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or admitted."""
        return bool(self.waiting or self.running)

    @property
    def num_kv_tokens_used(self) -> int:
        """KV slots accounted to admitted sequences (see :class:`EngineConfig`)."""
        return sum(s.num_kv_reserved for s in self.running)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[tuple[Sequence, StepOutput]]:
        """Schedule, draft, run one forward, verify and commit (see the module docstring).

        Returns:
            ``(sequence, StepOutput)`` for every sequence that ran a verification step
            this time (a step that only prefilled returns ``[]``). A sequence whose step
            had to emit where its transforms allow no token
            (:class:`~specdec.sampling.NoAllowedToken`) finishes with ``finish_reason``
            ``"error"`` and the message in ``StepOutput.error``; the others go on.
        """
        t_step = time.perf_counter()
        budget = self.config.max_num_batched_tokens
        verified = self._schedule_running(budget)
        budget -= sum(s.max_step_tokens for s in verified)
        first = any(len(s.tokens) == len(s.prompt_ids) for s in verified)
        chunks = [] if first else self._schedule_prefill(budget)  # first tokens first
        if not verified and not chunks:
            return []
        context = _context(verified)  # the KV the verification reads: the cost model's key
        plans = self._plan(verified, context)
        chains = self._batched_chains(verified, plans)
        drafts = [
            self._draft(s, k, chains.get(i))
            for i, (s, k) in enumerate(zip(verified, plans, strict=True))
        ]
        items = [
            (
                s,
                s.tokens[start:end],
                None,
                None,
                0 if _scores(s, end) else 1,
                end < len(s.prompt_ids) and not self.config.invariant_prefill,
            )
            for s, start, end in chunks
        ]  # a chunk of the prompt, or of earlier output recomputed after preemption
        # (num_logits 0 = every row: a prompt chunk whose prompt_logprobs are wanted)
        for seq, (draft, aux) in zip(verified, drafts, strict=True):
            items.append(_verification_input(seq, draft, aux))
        rows = sum(len(item[1]) for item in items)
        t_forward = time.perf_counter()
        logits, captured = self._forward(items)
        forward_s = time.perf_counter() - t_forward
        if not chunks:  # verification-only forwards define the verification cost
            self.cost_model.observe_forward(rows, forward_s, context)
        for (seq, start, end), chunk_logits in zip(chunks, logits, strict=False):
            if _scores(seq, end):
                _record_prompt_logprobs(seq, start, end, chunk_logits)
        for (seq, start, end), hidden in zip(chunks, captured, strict=False):
            if hidden is not None:  # a draft head reads the prompt's hidden states
                t0 = time.perf_counter()
                seq.drafter_state.observe_prefill(start, hidden)
                seq.stats.draft_s += time.perf_counter() - t0
            seq.num_prefilled = end
            self.num_prompt_tokens_computed += end - start
            seq.stats.prefill_s += forward_s
            if self.prefix_cache is not None:
                self._share_chunk(seq, start, end, hidden)
            if seq.num_to_prefill == 0:
                seq.status = SequenceStatus.RUNNING
        outputs = []
        for seq, k, (draft, aux), seq_logits, hidden in zip(
            verified, plans, drafts, logits[len(chunks) :], captured[len(chunks) :], strict=True
        ):
            try:
                step = self._commit(seq, k, draft, aux, seq_logits, forward_s, rows, hidden)
            except NoAllowedToken as error:  # this request is ill-posed here; no other is
                step = StepOutput([], "error", seq.stats, error=str(error))
                seq.error = str(error)
                self._finish(seq, "error", SequenceStatus.FINISHED)
            outputs.append((seq, step))
        elapsed = time.perf_counter() - t_step
        for seq in {id(s): s for s in [*verified, *(c[0] for c in chunks)]}.values():
            seq.stats.elapsed_s += elapsed
        if self.config.record_trace:
            for seq in verified:
                seq.stats.trace[-1].step_s = elapsed
        return outputs

    # ------------------------------------------------------------------ control

    def _plan(self, verified: list[Sequence], context: int) -> list[int]:
        """Each verified sequence's draft size this step (arrival order), chosen by its
        controller from a :class:`StepView` of the batch so far, with the cost model read
        at ``context`` (:func:`_context` of ``verified``).

        The view leaves out the step's prompt chunks. Their time is the same whatever the
        drafts, and counting it in the step's goodput made drafts look cheap in every step
        that also prefilled. Measured with the `q8` kernel and 16 streaming clients: the
        server drafted only in the steps that prefilled the next wave (one of them 144
        draft tokens, 3 accepted) and lost 6-9% against speculation off. Exact mode runs
        the chunks as forwards of their own anyway (``_prefill_groups`` in
        :mod:`specdec.runtime.model`)."""
        plans = []
        other_tokens = len(verified)
        cost = self.cost_model.at(context)  # forward times at this KV length
        for seq in verified:
            cap = seq.last_cap = self._step_cap(seq)
            if cap == 0:
                plans.append(0)
                continue
            if seq.control_info.isolated:
                view = StepView(cap, self._frozen_cost)
            else:
                view = StepView(cap, cost, len(verified), other_tokens - 1, len(verified) - 1.0)
            k = check_choice(seq.control, seq.control.choose(view), cap)
            k = _forced_k(seq, k, cap)
            if k and seq.tree_builder is not None and seq.tree_builder.uses_row_cost:
                seq.row_cost = _row_cost(view.cost, view.other_tokens + 1 + seq.max_aux_rows)
            other_tokens += math.ceil(k * seq.control_info.tree_nodes_per_depth)
            if k and seq.max_aux_rows:
                other_tokens += seq.max_aux_rows
            plans.append(k)
        return plans

    def _step_cap(self, seq: Sequence) -> int:
        """Most draft tokens (tree: depth) this step: k capped by the budget left."""
        left = seq.max_total - len(seq.tokens) - 1
        if isinstance(seq.drafter, NoDrafter):
            return 0
        return max(0, min(seq.control_info.max_k, left))

    def _control_observe(self, seq, k, draft, result, position, forward_s, rows) -> None:
        """Tell the sequence's controller (and the cost model, and the trace) how the
        step went."""
        tree = isinstance(draft, TreeProposal)
        drafted = len(draft.tree) if tree else len(draft)
        outcome = StepOutcome(
            k=k,
            num_drafted=drafted,
            num_accepted=result.num_accepted,
            num_emitted=len(result.output_token_ids),
            confidences=None if tree else _confidences(draft),
            draft_s=seq.last_draft_s,
            forward_s=forward_s,
            forward_tokens=rows,
            tree=tree,
            deterministic=not tree and draft.draft_probs is None,
        )
        # trees: draft time per unit of depth. A sequence's first draft also sets its
        # drafter up (suffix decoding's prompt tree, a draft model's or head's pass over
        # the prompt): no price per draft token, and as one of the first samples it had
        # the cost controller turn a suffix drafter off for 50-80 steps of a repetitive
        # answer (2.7 ms for one token, against 0.2-0.4 ms per draft after it)
        if k and (drafted or tree) and seq.stats.num_drafts:
            self.cost_model.observe_draft(
                seq.control_info.drafter, k if tree else drafted, seq.last_draft_s
            )
        if seq.last_cap:
            seq.stats.record_choice(k)
            seq.control.observe(outcome)
        if self.config.record_trace:
            seq.stats.trace.append(
                TraceStep(
                    position=position, k=k, cap=seq.last_cap, num_drafted=drafted,
                    num_accepted=outcome.num_accepted, num_emitted=outcome.num_emitted,
                    draft_s=outcome.draft_s, forward_s=forward_s, forward_tokens=rows,
                    tree=tree,
                )
            )  # fmt: skip

    # ------------------------------------------------------------------ scheduling

    def _schedule_running(self, budget: int) -> list[Sequence]:
        """Running sequences to verify this step (earliest arrivals first), after making
        room in the KV accounting for their next step (preempting latest arrivals)."""
        limit = self.config.max_kv_tokens
        while True:
            needs = {
                id(s): min(_round_up(s.cache.num_tokens + s.max_step_tokens), limit)
                for s in self.running
                if s.status is SequenceStatus.RUNNING
            }
            total = sum(max(s.num_kv_reserved, needs.get(id(s), 0)) for s in self.running)
            if total <= self.config.max_kv_tokens or len(self.running) <= 1:
                break
            self._preempt(max(self.running, key=lambda s: s.arrival))
        chosen = []
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_kv_reserved = max(seq.num_kv_reserved, needs[id(seq)])
            if seq.max_step_tokens <= budget:
                chosen.append(seq)
                budget -= seq.max_step_tokens
        return chosen

    def _schedule_prefill(self, budget: int) -> list[tuple[Sequence, int, int]]:
        """Prompt chunks ``(sequence, start, end)`` of admitted sequences, then of new
        admissions while sequences, KV slots and the token budget allow."""
        chunks = []
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status is SequenceStatus.PREFILL:
                start, end = self._next_chunk(seq)
                if end - start <= budget:
                    chunks.append((seq, start, end))
                    budget -= end - start
        cfg = self.config
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            need = min(_round_up(len(seq.tokens) + seq.max_step_tokens), cfg.max_kv_tokens)
            if self.num_kv_tokens_used + need > cfg.max_kv_tokens and self.running:
                break  # first come, first served: no overtaking
            self.waiting.popleft()
            self._admit(seq, need)
            if seq.status is SequenceStatus.PREFILL:
                start, end = self._next_chunk(seq)
                if end - start <= budget:
                    chunks.append((seq, start, end))
                    budget -= end - start
        return chunks

    def _next_chunk(self, seq: Sequence) -> tuple[int, int]:
        """The next prefill chunk: the prompt (minus its pending last token) in
        ``prefill_chunk`` pieces, then, for a recomputed sequence, its earlier output.
        Boundaries depend only on the sequence."""
        size = self.config.prefill_chunk
        start = seq.num_prefilled
        prompt_end = len(seq.prompt_ids) - 1
        if start < prompt_end:
            return start, min(start + size, prompt_end)
        return start, min(start + size, len(seq.tokens) - 1)

    def _admit(self, seq: Sequence, need: int) -> None:
        t0 = time.perf_counter()
        # a chain never verifies past max_total; a tree may hold more nodes than remain
        largest_tree = seq.tree_builder.max_nodes if seq.tree_builder is not None else 0
        extra = largest_tree + seq.max_aux_rows
        capacity = min(seq.max_total + extra, len(seq.tokens) + INITIAL_HEADROOM)
        seq.cache = self.target.new_cache(capacity)
        seq.num_prefilled = 0
        seq.num_kv_reserved = need
        seq.drafter_state = seq.drafter.start(seq.tokens, seq.params)
        if getattr(seq.drafter, "uses_target_cache", False):
            seq.drafter_state.attach_cache(seq.cache)
        if self.prefix_cache is not None and seq.params.prompt_logprobs is None:
            # (prompt_logprobs need the prompt's logits, which the cache does not keep)
            for kv, hidden in self.prefix_cache.lookup(self._shared_tokens(seq), seq.captures):
                if hidden is not None:  # a draft head reads the prompt's hidden states
                    seq.drafter_state.observe_prefill(seq.cache.num_tokens, hidden)
                seq.cache.append_slots(kv)
            seq.num_prefilled = seq.cache.num_tokens
            if not seq.num_preemptions:
                seq.stats.num_cached_tokens = seq.num_prefilled
        seq.status = SequenceStatus.PREFILL if seq.num_to_prefill else SequenceStatus.RUNNING
        self.running.append(seq)
        seq.stats.draft_s += time.perf_counter() - t0

    def _preempt(self, seq: Sequence) -> None:
        """Drop ``seq``'s cache and drafter state; it waits (in arrival order) to be
        recomputed from its tokens."""
        self._release(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        position = next((i for i, s in enumerate(self.waiting) if s.arrival > seq.arrival), None)
        if position is None:
            self.waiting.append(seq)
        else:
            self.waiting.insert(position, seq)

    def _share_chunk(self, seq: Sequence, start: int, end: int, hidden) -> None:
        """Give the prefix cache the blocks a prompt chunk ``[start, end)`` completed, and
        the hidden states it captured (a block straddling two chunks gets the rows of
        both: the tail of the one before is carried in ``seq.hidden_carry``)."""
        block, carry = self.prefix_cache.block_size, seq.hidden_carry
        hidden_start = start
        if hidden is not None and carry is not None and carry[0] + len(carry[1]) == start:
            hidden, hidden_start = torch.cat([carry[1], hidden]), carry[0]
        if end // block > start // block:  # a block is complete
            self.prefix_cache.insert(
                self._shared_tokens(seq), end, seq.cache.read_slots, seq.captures, hidden,
                hidden_start,
            )  # fmt: skip
        boundary = end // block * block
        seq.hidden_carry = None
        if hidden is not None and boundary < end:
            seq.hidden_carry = (boundary, hidden[boundary - hidden_start :])

    def _shared_tokens(self, seq: Sequence) -> list[int]:
        """What the prefix cache may key ``seq``'s KV by: its prompt, or with
        ``invariant_prefill`` (every token's KV computed alike) all its tokens."""
        return seq.tokens if self.config.invariant_prefill else seq.prompt_ids

    def _release(self, seq: Sequence) -> None:
        cache = self.prefix_cache
        if cache is not None and self.config.invariant_prefill and seq.cache is not None:
            # finished, aborted or preempted: its verified tokens' KV, for later requests
            # (a conversation's next turn) or for its own readmission
            cache.insert(seq.tokens, seq.cache.num_tokens, seq.cache.read_slots)
        seq.hidden_carry = None
        if seq.drafter_state is not None:
            seq.drafter_state.close()
            seq.drafter_state = None
        seq.cache = None
        seq.num_kv_reserved = 0
        seq.num_prefilled = 0

    def _finish(self, seq: Sequence, reason: str, status: SequenceStatus) -> None:
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._live.pop(seq.request_id, None)
        seq.status, seq.finish_reason = status, reason

    # ------------------------------------------------------------------ draft, forward, commit

    def _batched_chains(
        self, seqs: list[Sequence], plans: list[int]
    ) -> dict[int, tuple[DraftProposal, float]]:
        """The chains of sequences whose shared drafter drafts several at once
        (``propose_batch``: self-drafts, one forward per draft step for all of them),
        where at least two of them draft this step: ``{index in seqs: (raw proposal,
        this sequence's share of the batched drafting's seconds)}``. The others draft
        alone in :meth:`_draft`."""
        groups: dict[int, list[int]] = {}
        for i, (seq, k) in enumerate(zip(seqs, plans, strict=True)):
            if k > 0 and seq.tree_builder is None and hasattr(seq.drafter, "propose_batch"):
                groups.setdefault(id(seq.drafter), []).append(i)
        out: dict[int, tuple[DraftProposal, float]] = {}
        for indices in groups.values():
            if len(indices) < 2:
                continue
            t0 = time.perf_counter()
            requests = [
                ChainRequest(
                    seqs[i].drafter_state, seqs[i].tokens, plans[i], seqs[i].generator,
                    self._drafter_stop(seqs[i], plans[i]),
                )
                for i in indices
            ]  # fmt: skip
            proposals = seqs[indices[0]].drafter.propose_batch(requests)
            share = (time.perf_counter() - t0) / len(indices)
            for i, proposal in zip(indices, proposals, strict=True):
                out[i] = (proposal, share)
        return out

    def _drafter_stop(self, seq: Sequence, k: int):
        """The controller's ``stop_drafting`` where the drafter applies it while drafting
        (it declares ``confidence_stop``), else ``None``."""
        stop = getattr(seq.control, "stop_drafting", None) if k else None
        return stop if getattr(seq.drafter, "confidence_stop", False) else None

    def _draft(
        self, seq: Sequence, k: int, batched: tuple[DraftProposal, float] | None = None
    ) -> tuple[DraftProposal | TreeProposal, AuxRows | None]:
        """The step's draft (a chain of at most ``k`` tokens, or a tree at most ``k``
        deep) and the drafter's auxiliary rows, if any (none for a plain step);
        ``batched``: the chain :meth:`_batched_chains` drafted and its share of the time."""
        t0 = time.perf_counter()
        if seq.tree_builder is not None:
            draft = _draft_tree(seq, k)
        else:
            draft = self._propose(seq, k, None if batched is None else batched[0])
        aux = seq.drafter_state.aux_rows(seq.tokens) if seq.max_aux_rows and k else None
        if aux is not None and len(aux) > seq.max_aux_rows:
            raise ValueError(
                f"{type(seq.drafter).__name__} returned {len(aux)} auxiliary rows, more than "
                f"its max_aux_rows={seq.max_aux_rows}"
            )
        seq.last_draft_s = time.perf_counter() - t0 + (0.0 if batched is None else batched[1])
        seq.stats.draft_s += seq.last_draft_s
        return draft, (aux or None)

    def _propose(self, seq: Sequence, k: int, raw: DraftProposal | None = None) -> DraftProposal:
        """A chain of at most ``k`` tokens, ended early where the controller's
        ``stop_drafting`` says so (inside the drafter when it declares
        ``confidence_stop``, else on the proposal's confidences), then cut to the prefix
        its ``trim`` chooses, if it has one. ``raw``: the drafter's chain, drafted already
        in a batch (:meth:`_batched_chains`, with the same ``stop_drafting``).

        Raises:
            ValueError: a proposal the drafter should not make, or a ``trim`` outside
                ``[1, length]``.
        """
        state = seq.drafter_state
        stop = getattr(seq.control, "stop_drafting", None) if k else None
        inside = self._drafter_stop(seq, k)
        if raw is not None:
            draft = raw
        elif inside is not None:
            draft = state.propose(seq.tokens, k, seq.generator, stop_drafting=inside)
        else:
            draft = state.propose(seq.tokens, k, seq.generator)
        if inside is not None:
            stop = None
        _check_proposal(seq, draft, k, self.target.vocab_size)
        confidences = _confidences(draft) if stop is not None else None
        keep = len(draft)
        if confidences:
            keep = next((i for i, c in enumerate(confidences) if stop(i, c)), len(draft))
        trim = getattr(seq.control, "trim", None) if keep > 1 else None
        if trim is not None:  # a controller may verify a prefix only (lossless)
            chosen = trim(keep)
            if isinstance(chosen, bool) or not isinstance(chosen, int) or not 1 <= chosen <= keep:
                raise ValueError(
                    f"{type(seq.control).__name__}.trim({keep}) returned {chosen!r}; it must "
                    f"be an int in [1, {keep}]"
                )
            keep = chosen
        grammar = seq.grammar
        if grammar is not None and keep and (seq.params.greedy or draft.draft_probs is None):
            # Tokens after the first one the grammar forbids can never be accepted: verify
            # without them. Only where the draft is a function of the history (greedy
            # target, or deterministic drafts): cutting a *sampled* draft on its drawn
            # values would change the rejection sampler's output law.
            keep = min(keep, grammar.valid_prefix_length(draft.token_ids[:keep]))
        if keep < len(draft):
            probs, confidence = draft.draft_probs, draft.confidence
            draft = DraftProposal(
                draft.token_ids[:keep],
                None if probs is None else probs[:keep],
                None if confidence is None else confidence[:keep],
                draft.source,
            )
        if grammar is not None and k and (seq.params.greedy or draft.draft_probs is None):
            draft = _with_forced(draft, grammar.forced_tokens(k))
        return draft

    def _forward(self, items) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """One ragged forward through the backend protocol (the native runtime computes it
        in one pass; transformers as a loop).

        Returns:
            per item, its logits and, for a sequence whose drafter reads hidden states,
            ``[T, len(seq.captures) * hidden_size]`` of every row (else ``None``).
        """
        batch = [BatchItem(ids, seq.cache, *rest) for seq, ids, *rest in items]
        wanted = sorted({i for seq, *_ in items for i in seq.captures})
        if not wanted:
            return self.target.forward_batch(batch), [None] * len(items)
        outputs = self.target.forward_batch_full(batch, capture=wanted)
        captured: list[torch.Tensor | None] = []
        for (seq, *_), out in zip(items, outputs, strict=True):
            if not seq.captures:
                captured.append(None)
            elif list(seq.captures) == wanted:
                captured.append(out.captured)
            else:  # another sequence's head reads other layers: keep this one's
                size = out.captured.shape[-1] // len(wanted)
                parts = out.captured.split(size, dim=-1)
                captured.append(torch.cat([parts[wanted.index(i)] for i in seq.captures], -1))
        return [out.logits for out in outputs], captured

    def _commit(
        self,
        seq: Sequence,
        k: int,
        draft,
        aux: AuxRows | None,
        logits: torch.Tensor,
        forward_s: float,
        rows: int,
        hidden: torch.Tensor | None = None,
    ) -> StepOutput:
        t0 = time.perf_counter()
        position = len(seq.tokens) - len(seq.prompt_ids)
        cache, params = seq.cache, seq.params
        past = cache.num_tokens - logits.shape[0]  # before this step's rows
        aux_logits = None
        if aux is not None:  # the last rows; dropped from the cache with the rejected
            logits, aux_logits = logits[: -len(aux)], logits[-len(aux) :]
            hidden = None if hidden is None else hidden[: -len(aux)]
        history = _history(seq) if params.needs_history else None
        if isinstance(draft, TreeProposal):
            tree = draft.tree
            result = verify_tree(tree, logits, params, seq.generator, history)
            cache.compact([past + 1 + n for n in result.accepted_nodes], start=past + 1)
            seq.tree_builder.observe(draft, result.accepted_nodes, result.output_token_ids)
            num_drafted, max_depth = len(tree), tree.max_depth
        else:
            result = verify(draft, logits, params, seq.generator, history, seq.verifier)
            cache.truncate(past + 1 + result.num_accepted)  # the last emitted is pending
            num_drafted = max_depth = len(draft)
        stats = seq.stats
        stats.verify_s += forward_s + time.perf_counter() - t0
        if seq.observes:
            t_observe = time.perf_counter()
            feedback = _feedback(seq.tokens[-1], draft, logits, result)
            feedback.aux_logits = aux_logits
            feedback.hidden = hidden
            seq.drafter_state.observe(feedback)
            stats.draft_s += time.perf_counter() - t_observe
        self._control_observe(seq, k, draft, result, position, forward_s, rows)
        emitted = result.output_token_ids
        if seq.grammar is not None:  # the grammar's end is a terminal condition, in order
            emitted = emitted[: seq.grammar.commit(emitted)]
        seq.tokens.extend(emitted)
        step = finish_step(
            seq.tokens, len(seq.prompt_ids), len(emitted), seq.max_total,
            seq.stop_checker, stats,
        )  # fmt: skip
        if step.finish_reason != "stop" and seq.grammar is not None and seq.grammar.is_stopped:
            # the grammar is complete (nothing but EOS may follow): the last token is text
            step.finish_reason, step.text_end = "stop", WHOLE_TEXT
        # Draft tokens dropped by a stop are not counted as accepted.
        num_accepted = min(result.num_accepted, len(step.new_token_ids))
        stats.record_step(num_drafted, num_accepted, len(step.new_token_ids), max_depth)
        source = getattr(draft, "source", None)  # a chain's (a tree has none)
        if source is not None:
            stats.draft_sources[source] = stats.draft_sources.get(source, 0) + 1
        if params.logprobs is not None:
            step.logprobs = _emitted_logprobs(draft, logits, result, step, params.logprobs)
            seq.logprobs.extend(step.logprobs)
        if params.prompt_logprobs is not None and position == 0:
            step.prompt_logprobs = list(seq.prompt_logprobs)
        if step.finish_reason is not None:
            seq.text_end = step.text_end
            self._finish(seq, step.finish_reason, SequenceStatus.FINISHED)
        return step


def prefix_block_size(config: EngineConfig) -> int:
    """The prefix cache's block (tokens) under ``config``: one prefill chunk, or
    :data:`INVARIANT_BLOCK` with ``invariant_prefill``."""
    return INVARIANT_BLOCK if config.invariant_prefill else config.prefill_chunk


def new_prefix_cache(target: Backend, config: EngineConfig) -> PrefixCache:
    """An empty :class:`PrefixCache` for ``config`` (its block: ``config.prefill_chunk``).

    Raises:
        ValueError: prefix caching on a backend other than the native runtime.
    """
    check_prefix_cache(target, config)
    tokens = prefix_block_size(config)
    block = getattr(target.new_cache(1), "bytes_per_token", 0) * tokens
    if config.prefix_cache_bytes < block:
        logger.warning(
            "prefix cache: a budget of %d bytes holds no block (%d bytes: %d tokens of KV); "
            "nothing will be cached",
            config.prefix_cache_bytes, block, tokens,
        )  # fmt: skip
    return PrefixCache(tokens, config.prefix_cache_bytes)


def check_invariant_prefill(target: Backend) -> None:
    """Refuse ``invariant_prefill`` where decoding's arithmetic is not batch-invariant.

    Raises:
        ValueError: a backend other than the native runtime, or its fast mode
            (``exact=False``).
    """
    if getattr(target, "backend", None) != "native" or not getattr(target, "exact", False):
        where = (
            "the native runtime's fast mode (exact=False)"
            if getattr(target, "backend", None) == "native"
            else f"the {getattr(target, 'backend', 'other')!r} backend"
        )
        raise ValueError(
            "invariant_prefill needs the native backend in exact mode (the default): "
            f"{where} computes a row's bits differently in different batches"
        )


def check_prefix_cache(target: Backend, config: EngineConfig, cache=None) -> None:
    """Refuse prefix caching where a hit could change bits (see
    :mod:`specdec.engine.prefix_cache`).

    Raises:
        ValueError: a backend other than the native runtime, or a cache whose block is
            not ``config.prefill_chunk``.
    """
    if getattr(target, "backend", None) != "native":
        raise ValueError(
            "prefix caching needs the native backend (backend='native', or 'auto' on a "
            f"model it supports); {getattr(target, 'name', 'the target')} runs on "
            f"{getattr(target, 'backend', 'another backend')!r}"
        )
    if (
        cache is not None
        and not config.invariant_prefill
        and cache.block_size != config.prefill_chunk
    ):
        raise ValueError(
            f"the prefix cache's blocks hold {cache.block_size} tokens but prefill_chunk is "
            f"{config.prefill_chunk}: a block must be one prefill chunk"
        )


def _emitted_logprobs(draft, logits: torch.Tensor, result, step: StepOutput, top: int) -> list:
    """The raw target log-probabilities of the tokens a step kept (after stop trimming):
    emitted token j was drawn at the verification row after the first j accepted tokens
    (a chain's row j; in a tree, the row of the j-th accepted node)."""
    kept = len(step.new_token_ids)
    if isinstance(draft, TreeProposal):
        rows = [0] + [1 + n for n in result.accepted_nodes]
    else:
        rows = list(range(result.num_accepted + 1))
    index = torch.tensor(rows[:kept], dtype=torch.long, device=logits.device)
    return token_logprobs(logits.index_select(0, index), step.new_token_ids, top)


def _scores(seq: Sequence, end: int) -> bool:
    """Whether a prefill chunk ending at ``end`` needs its logits for
    ``prompt_logprobs`` (a prompt chunk, not recomputed output, not already scored)."""
    return (
        seq.params.prompt_logprobs is not None
        and end <= len(seq.prompt_ids) - 1
        and seq.prompt_logprobs[end] is None
    )


def _record_prompt_logprobs(seq: Sequence, start: int, end: int, logits: torch.Tensor) -> None:
    """Prompt tokens ``start + 1 .. end`` scored by the chunk's rows (row j predicts token
    ``start + j + 1``); the raw target distribution, as ``logprobs``."""
    targets = seq.prompt_ids[start + 1 : end + 1]
    scored = token_logprobs(logits[-len(targets) :], targets, seq.params.prompt_logprobs)
    seq.prompt_logprobs[start + 1 : end + 1] = scored


def _context(verified: list[Sequence]) -> int:
    """Tokens the verified sequences hold in total: what their forward's attention reads
    (the cost model's context, :func:`specdec.control.cost.context_bucket`)."""
    return sum(len(seq.tokens) for seq in verified)


def _history(seq: Sequence) -> TokenHistory:
    """What the history-dependent sampling transforms read about ``seq``: the prompt, the
    output so far (the pending token included) and the stop tokens ``min_tokens`` holds
    back."""
    return TokenHistory(
        seq.prompt_ids,
        seq.output_ids,
        tuple(sorted(seq.stop_checker.stop_token_ids)),
        seq.grammar,
    )


def _check_proposal(seq: Sequence, draft, k: int, vocab_size: int) -> None:
    """Refuse a drafter's broken chain: not a DraftProposal, more than ``k`` tokens (the
    engine sized the step and the KV cache for ``k``), or ids outside the vocabulary.

    Raises:
        ValueError: naming the drafter and what it returned.
    """
    name = type(seq.drafter).__name__
    if not isinstance(draft, DraftProposal):
        raise ValueError(f"{name}.propose must return a DraftProposal, got {type(draft).__name__}")
    if len(draft.token_ids) > k:
        raise ValueError(f"{name} proposed {len(draft.token_ids)} tokens; it was asked for {k}")
    bad = [t for t in draft.token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"{name} proposed token ids outside the vocabulary: {bad[:5]}")


def _confidences(draft) -> list[float] | None:
    """A chain's per-position draft confidence: given, or the top of ``draft_probs``."""
    if draft.confidence is not None:
        return list(draft.confidence)
    if draft.draft_probs is not None and len(draft):
        return draft.draft_probs.max(dim=-1).values.tolist()
    return None


def _feedback(pending: int, draft, logits: torch.Tensor, result) -> VerificationFeedback:
    """The drafter's view of one verification (chain or tree)."""
    if isinstance(draft, TreeProposal):
        tree = draft.tree
        accepted = [0, *(1 + n for n in result.accepted_nodes)]
        return VerificationFeedback(
            [pending, *tree.token_ids], list(tree.parents), logits, accepted,
            result.output_token_ids,
        )  # fmt: skip
    accepted = list(range(result.num_accepted + 1))
    return VerificationFeedback(
        [pending, *draft.token_ids], None, logits, accepted, result.output_token_ids
    )


def _verification_input(seq: Sequence, draft, aux: AuxRows | None = None):
    """``(sequence, token ids, positions, tree mask, num_logits, prefill)`` of one verification:
    the pending token, the draft (chain or tree), then any auxiliary rows."""
    pending = seq.tokens[-1]
    if isinstance(draft, TreeProposal):
        tree = draft.tree
        ids, offsets, mask = (
            [pending, *tree.token_ids],
            tree.position_offsets(),
            tree.attention_mask(),
        )
    else:
        ids, offsets, mask = [pending, *draft.token_ids], None, None
    if aux is None:
        positions = None if offsets is None else seq.cache.num_tokens + offsets
        return (seq, ids, positions, mask, 0, False)
    n, m = len(ids), len(aux)
    if offsets is None:  # a chain
        offsets = torch.arange(n)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
    full = torch.zeros(n + m, n + m, dtype=torch.bool)
    full[:n, :n] = mask
    full[n:, 0] = True  # auxiliary rows see the pending token, never the draft
    full[n:, n:] = torch.as_tensor(aux.mask, dtype=torch.bool)
    offsets = torch.cat([offsets, torch.as_tensor(aux.position_offsets, dtype=offsets.dtype)])
    return (seq, [*ids, *aux.token_ids], seq.cache.num_tokens + offsets, full, 0, False)


def _draft_tree(seq: Sequence, max_depth: int) -> TreeProposal:
    """One step's tree (empty when no token may be drafted); an adaptive builder
    (:attr:`~specdec.trees.builders.TreeBuilder.uses_row_cost`) also gets the step's
    ``seq.row_cost`` (:func:`_row_cost`, set by the plan)."""
    if max_depth < 1:
        return TreeProposal(TokenTree((), ()))
    session = seq.drafter_state.tree_session(seq.tokens, seq.params)
    builder, sampling = seq.tree_builder, not seq.params.greedy
    try:
        if builder.uses_row_cost:
            return builder.build(session, max_depth, sampling, seq.generator, row_cost=seq.row_cost)
        return builder.build(session, max_depth, sampling, seq.generator)
    finally:
        session.close()


def _forced_k(seq: Sequence, k: int, cap: int) -> int:
    """The step's draft size ``k`` raised to the tokens the request's grammar forces (at
    most ``cap``): they are accepted whatever the controller expects of the drafter, so a
    controller that chose few or none (``cost`` where drafts have not paid) still gets the
    scaffolding in one step. Chains only; a function of the history, so lossless."""
    if k >= cap or seq.grammar is None or seq.tree_builder is not None:
        return k
    return max(k, len(seq.grammar.forced_tokens(cap)))


def _with_forced(draft: DraftProposal, forced: list[int]) -> DraftProposal:
    """``draft``, or the tokens the request's grammar forces (``forced``,
    :meth:`~specdec.structured.GrammarState.forced_tokens`) where the draft does not
    extend them: the only continuation the mask allows, drafted as a point mass (source
    ``"grammar"``), so the JSON scaffolding of a tool call or a schema costs one
    verification, not a step per token. Called only where the draft is a function of the
    history (greedy target or deterministic draft), so the choice keeps the output law."""
    if not forced or list(draft.token_ids[: len(forced)]) == forced:
        return draft
    return DraftProposal(list(forced), None, [1.0] * len(forced), "grammar")


def _row_cost(cost, rows: int):
    """:data:`~specdec.trees.builders.RowCost` of a step whose forward runs ``rows`` rows
    besides the tree's draft nodes (the pending token, auxiliary rows and the other
    sequences'), from the cost model (``cost``: a :class:`~specdec.control.cost.CostModel`
    or its :class:`~specdec.control.cost.ContextCost` at the step's context)."""
    base = cost.forward_time(rows)
    return lambda n: cost.forward_time(rows + n) / base


def _round_up(slots: int) -> int:
    return -(-slots // KV_BLOCK) * KV_BLOCK


def check_tree_drafter(drafter) -> None:
    """Refuse token trees with a drafter that drafts chains only (its ``tree_refusal``
    says why, where it has one).

    Raises:
        ValueError: the drafter does not declare ``supports_trees``.
    """
    if getattr(drafter, "supports_trees", False):
        return
    why = getattr(drafter, "tree_refusal", None)
    if why:
        raise ValueError(why)
    raise ValueError(
        f"{type(drafter).__name__} (the drafter) cannot draft token trees: use "
        "a chain (no --tree / tree=None) or a drafter that drafts trees"
    )
