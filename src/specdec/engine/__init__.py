"""Decoding engine: the single-sequence speculative loop and stop handling."""

from specdec.engine.generate import StepOutput, generate, verify
from specdec.engine.stops import StopChecker, StopMatch

__all__ = ["StepOutput", "StopChecker", "StopMatch", "generate", "verify"]
