"""specdec's native runtime for Llama-family models: fused weights, our own KV storage,
ragged batches, per-shape kernel choice and an exact (batch-invariant) mode.

Use it through :class:`specdec.models.native.NativeModel` (``backend="native"``).
"""

from specdec.runtime.cache import NativeKVCache
from specdec.runtime.model import BatchItem, NativeDecoder
from specdec.runtime.weights import SUPPORTED_MODEL_TYPES, UnsupportedModel, extract_weights

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "BatchItem",
    "NativeDecoder",
    "NativeKVCache",
    "UnsupportedModel",
    "extract_weights",
]
