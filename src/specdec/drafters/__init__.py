"""Drafters: propose tokens for the target to verify (registered by name in
:mod:`specdec.registry`)."""

from specdec.drafters.base import (
    Drafter,
    DrafterBase,
    DraftProposal,
    NoDrafter,
    SequenceDrafter,
    VerificationFeedback,
)
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.layer_skip import LayerSkipDrafter
from specdec.drafters.lookahead import LookaheadDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.options import (
    LayerSkipOptions,
    LookaheadOptions,
    NgramOptions,
    RecyclingOptions,
    RetrievalOptions,
    SuffixOptions,
)
from specdec.drafters.recycling import RecyclingDrafter
from specdec.drafters.retrieval import RetrievalDrafter
from specdec.drafters.suffix import SuffixDrafter

__all__ = [
    "DraftModelDrafter",
    "DraftProposal",
    "Drafter",
    "DrafterBase",
    "LayerSkipDrafter",
    "LayerSkipOptions",
    "LookaheadDrafter",
    "LookaheadOptions",
    "NgramDrafter",
    "NgramOptions",
    "NoDrafter",
    "RecyclingDrafter",
    "RecyclingOptions",
    "RetrievalDrafter",
    "RetrievalOptions",
    "SequenceDrafter",
    "SuffixDrafter",
    "SuffixOptions",
    "VerificationFeedback",
]
