"""Model loading and backends (transformers causal LMs)."""

from specdec.models.base import Backend, KVCacheLike
from specdec.models.hf import HFModel
from specdec.models.loading import DEFAULT_MODEL, EMBEDDED_MODELS, load, parse_dtype

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_MODELS",
    "Backend",
    "HFModel",
    "KVCacheLike",
    "load",
    "parse_dtype",
]
