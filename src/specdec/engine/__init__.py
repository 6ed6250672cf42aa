"""Decoding engine: the single-sequence speculative loop and stop handling."""

from specdec.engine.generate import StepOutput, generate_steps, verify
from specdec.engine.stops import StopChecker, StopMatch

__all__ = ["StepOutput", "StopChecker", "StopMatch", "generate_steps", "verify"]
