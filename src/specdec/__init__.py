"""specdec: speculative decoding for LLMs — faster generation, identical output.

The public names load on first use (PEP 562), so ``import specdec`` and the ``specdec``
command start without importing PyTorch; ``from specdec import LLM`` works as usual.
"""

from importlib import import_module

#: public name -> the module that defines it
_EXPORTS = {
    "LLM": "specdec.llm",
    "DrafterEntry": "specdec.registry",
    "Choices": "specdec.llm",
    "GenerationChunk": "specdec.llm",
    "GenerationOutput": "specdec.llm",
    "SamplingParams": "specdec.config",
    "SpecStats": "specdec.metrics",
    "SpeculativeConfig": "specdec.config",
    "StructuredOutputsParams": "specdec.structured",
    "register_drafter": "specdec.registry",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
