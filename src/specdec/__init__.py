"""specdec: speculative decoding for LLMs — faster generation, identical output."""

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.llm import LLM, GenerationChunk, GenerationOutput
from specdec.metrics import SpecStats

__all__ = [
    "LLM",
    "GenerationChunk",
    "GenerationOutput",
    "SamplingParams",
    "SpecStats",
    "SpeculativeConfig",
]
__version__ = "0.1.0"
