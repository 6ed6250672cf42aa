"""The outcome of verifying one step's draft."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VerifyResult:
    """Accepted draft tokens followed by exactly one recovered or bonus token.

    Attributes:
        num_accepted: draft tokens kept (0 <= num_accepted <= num_drafted).
        output_token_ids: ``num_accepted + 1`` token ids: the accepted draft tokens, then
            the recovered token (after a rejection) or the bonus token (all accepted).
    """

    num_accepted: int
    output_token_ids: list[int]
