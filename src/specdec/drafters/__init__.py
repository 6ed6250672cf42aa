"""Drafters: propose tokens for the target to verify."""

from specdec.drafters.base import Drafter, DraftProposal, NoDrafter, SequenceDrafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter

__all__ = [
    "DraftModelDrafter",
    "DraftProposal",
    "Drafter",
    "NgramDrafter",
    "NoDrafter",
    "SequenceDrafter",
]
