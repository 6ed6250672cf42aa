"""Speculation controllers (how many tokens to draft each step), the online cost model,
and the trace simulator. See :mod:`specdec.control.base` for the protocol."""

from specdec.control.base import (
    SequenceControl,
    SequenceInfo,
    SpeculationController,
    StepOutcome,
    StepView,
)
from specdec.control.cost import ContextCost, CostModel, CostPrior

__all__ = [
    "ContextCost",
    "CostModel",
    "CostPrior",
    "SequenceControl",
    "SequenceInfo",
    "SpeculationController",
    "StepOutcome",
    "StepView",
]
