"""specdec: speculative decoding for LLMs — faster generation, identical output."""

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.llm import LLM, GenerationChunk, GenerationOutput
from specdec.metrics import SpecStats
from specdec.registry import DrafterEntry, register_drafter

__all__ = [
    "LLM",
    "DrafterEntry",
    "GenerationChunk",
    "GenerationOutput",
    "SamplingParams",
    "SpecStats",
    "SpeculativeConfig",
    "register_drafter",
]
__version__ = "0.1.0"
