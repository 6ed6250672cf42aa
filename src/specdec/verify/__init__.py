"""Verifiers: greedy match and lossless rejection sampling (+ slow references)."""

from specdec.verify.greedy import verify_greedy
from specdec.verify.rejection import acceptance_probability, rejection_sample, residual_distribution
from specdec.verify.result import VerifyResult

__all__ = [
    "VerifyResult",
    "acceptance_probability",
    "rejection_sample",
    "residual_distribution",
    "verify_greedy",
]
