"""Slow, obviously-correct references for the verifiers (test oracles).

Each reference consumes the generator exactly like its fast counterpart, so both give the
same tokens under the same seed.
"""

from __future__ import annotations

import torch

from specdec.sampling import sample
from specdec.trees.tree import ROOT, TokenTree
from specdec.verify.result import VerifyResult
from specdec.verify.tree import SiblingRejection, TreeVerifyResult


def greedy_reference(draft_token_ids: list[int], target_logits: torch.Tensor) -> VerifyResult:
    """Position-by-position greedy check: accept while the draft equals the argmax."""
    output = []
    for i, token in enumerate(draft_token_ids):
        best = int(torch.argmax(target_logits[i]))
        output.append(best)
        if best != token:
            return VerifyResult(i, output)
    output.append(int(torch.argmax(target_logits[len(draft_token_ids)])))
    return VerifyResult(len(draft_token_ids), output)


def rejection_reference(
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> VerifyResult:
    """Leviathan et al. 2023, Algorithm 1, one position at a time with Python scalars."""
    k = len(draft_token_ids)
    uniforms = torch.rand(k, generator=generator, device=generator.device).tolist()
    for i, token in enumerate(draft_token_ids):
        target_p = float(target_probs[i, token])
        draft_p = 1.0 if draft_probs is None else float(draft_probs[i, token])
        if uniforms[i] < min(1.0, target_p / draft_p):
            continue
        if draft_probs is None:
            draft_row = torch.zeros_like(target_probs[i])
            draft_row[token] = 1.0
        else:
            draft_row = draft_probs[i]
        residual = torch.where(target_probs[i] > draft_row, target_probs[i] - draft_row, 0.0)
        if float(residual.sum()) <= 0:
            residual = target_probs[i]
        recovered = torch.multinomial(residual / residual.sum(), 1, generator=generator)
        return VerifyResult(i, list(draft_token_ids[:i]) + [int(recovered)])
    bonus = torch.multinomial(target_probs[k], 1, generator=generator)
    return VerifyResult(k, list(draft_token_ids) + [int(bonus)])


def first_token_marginal(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Exact distribution of the first output token of one rejection-sampling step.

    P(x) = draft(x) * a(x) + (1 - sum_y draft(y) * a(y)) * residual(x), with
    a = ``acceptance_probability`` and residual = ``residual_distribution`` (the
    production functions). Lossless iff this equals ``target_probs``.

    Args:
        target_probs, draft_probs: ``[V]`` float64 probabilities.

    Returns:
        ``[V]`` float64 probabilities.
    """
    from specdec.verify.rejection import acceptance_probability, residual_distribution

    accept = acceptance_probability(target_probs, draft_probs)
    accepted_mass = draft_probs * accept
    return accepted_mass + (1.0 - accepted_mass.sum()) * residual_distribution(
        target_probs, draft_probs
    )


def tree_greedy_reference(tree: TokenTree, target_logits: torch.Tensor) -> TreeVerifyResult:
    """Check every root-to-node path on its own; keep the deepest that matches the argmax
    (ties: first node in flattened order)."""
    best_path: list[int] = []
    for node in range(tree.num_nodes):
        path = tree.path_to(node)
        contexts = [ROOT, *path[:-1]]
        if all(
            tree.token_ids[n] == int(torch.argmax(target_logits[c + 1]))
            for n, c in zip(path, contexts, strict=True)
        ) and len(path) > len(best_path):
            best_path = path
    last = ROOT if not best_path else best_path[-1]
    tokens = [tree.token_ids[n] for n in best_path]
    last_token = int(torch.argmax(target_logits[last + 1]))
    return TreeVerifyResult(len(best_path), tokens + [last_token], best_path)


def tree_rejection_reference(
    tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator
) -> TreeVerifyResult:
    """Multi-draft recursive rejection sampling written out step by step (SpecInfer,
    Miao et al. 2024, Algorithm 2; without replacement: RSD-C, Jeon et al. 2024, Alg. 3).

    Same generator use as :func:`specdec.verify.tree.verify_tree_sampling`: one uniform
    per child tried, then one categorical draw.
    """
    vocab = target_probs.shape[-1]
    node, path = ROOT, []
    while True:
        p = target_probs[node + 1].clone()
        kids = [i for i, parent in enumerate(tree.parents) if parent == node]
        proposal = None
        if tree.without_replacement and tree.draft_probs is not None and kids:
            proposal = tree.draft_probs[kids[0]].clone()
        chosen = None
        for child in kids:
            token = tree.token_ids[child]
            if tree.draft_probs is None:
                q = torch.zeros(vocab)
                q[token] = 1.0
            elif proposal is not None:
                q = proposal
            else:
                q = tree.draft_probs[child]
            ratio = float(p[token]) / float(q[token]) if float(q[token]) > 0 else 1.0
            u = float(torch.rand(1, generator=generator, device=generator.device))
            if u < min(1.0, ratio):
                chosen = child
                break
            residual = torch.where(p > q, p - q, torch.zeros_like(p))
            if float(residual.sum()) > 0:
                p = residual / residual.sum()
            if proposal is not None:
                proposal = proposal.clone()
                proposal[token] = 0.0
                if float(proposal.sum()) > 0:
                    proposal = proposal / proposal.sum()
        if chosen is None:
            last = int(sample(p.unsqueeze(0), generator))
            tokens = [tree.token_ids[n] for n in path]
            return TreeVerifyResult(len(path), tokens + [last], path)
        path.append(chosen)
        node = chosen


def sibling_outcome(
    target_probs: torch.Tensor,
    child_tokens: list[int],
    child_draft_probs: torch.Tensor | None,
    without_replacement: bool,
) -> tuple[list[float], torch.Tensor]:
    """Exact outcome of the production sibling loop for fixed children (no sampling).

    Uses :class:`specdec.verify.tree.SiblingRejection` itself, so an exact-marginal test
    built on it checks the production math.

    Returns:
        ``(accept, residual_mass)``: ``accept[i]`` = probability that child ``i`` is the
        accepted one; ``residual_mass`` ``[V]`` = probability that every child is rejected
        and token v is drawn instead.
    """
    rounds = SiblingRejection(target_probs, child_tokens, child_draft_probs, without_replacement)
    reach = 1.0
    accept = []
    for i in range(len(child_tokens)):
        a = rounds.accept_probability(i)
        accept.append(reach * a)
        reach *= 1.0 - a
        rounds.reject(i)
    return accept, reach * rounds.residual
