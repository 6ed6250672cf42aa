"""Decoding engine: the batched speculative engine, its single-sequence loop, and stops."""

from specdec.engine.commit import StepOutput, verify
from specdec.engine.engine import Engine, EngineConfig
from specdec.engine.generate import generate_steps
from specdec.engine.prefix_cache import PrefixCache
from specdec.engine.sequence import Sequence, SequenceStatus
from specdec.engine.stops import StopChecker, StopMatch

__all__ = [
    "Engine",
    "EngineConfig",
    "PrefixCache",
    "Sequence",
    "SequenceStatus",
    "StepOutput",
    "StopChecker",
    "StopMatch",
    "generate_steps",
    "verify",
]
