"""Weights of a Llama-family decoder, taken from a loaded transformers module and fused.

Supported: Llama (and SmolLM2), Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm):
pre-norm decoder layers with RMSNorm, rotary position embeddings, grouped-query attention
and a SwiGLU MLP. The q/k/v projections are fused into one matrix and gate/up into another,
so a layer runs four matrix products. Anything else raises :class:`UnsupportedModel` with
the reason (the transformers backend runs it instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: ``config.model_type`` values the native runtime implements.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModel(ValueError):
    """The native runtime cannot run this model (the message says why)."""


@dataclass
class LayerWeights:
    """One decoder layer. Shapes: D = hidden size, H / G = query / key-value heads,
    d = head size, I = MLP size; every matrix is ``[out, in]`` in the model's dtype."""

    attn_norm: torch.Tensor  # [D]
    qkv: torch.Tensor  # [(H + 2G) d, D]
    qkv_bias: torch.Tensor | None  # [(H + 2G) d] (Qwen2)
    q_norm: torch.Tensor | None  # [d] (Qwen3)
    k_norm: torch.Tensor | None  # [d] (Qwen3)
    o: torch.Tensor  # [D, H d]
    o_bias: torch.Tensor | None  # [D]
    mlp_norm: torch.Tensor  # [D]
    gate_up: torch.Tensor  # [2 I, D]
    down: torch.Tensor  # [D, I]


@dataclass
class ArchConfig:
    """The numbers a forward needs.

    Attributes:
        num_heads, num_kv_heads, head_dim: attention shape (H, G, d).
        hidden_size, intermediate_size, vocab_size: D, I and the logit width.
        rms_eps: RMSNorm epsilon.
        inv_freq: ``[d / 2]`` float32 rotary inverse frequencies (scaling already applied,
            as transformers computes them for the model's ``rope_type``).
        rope_scale: factor on cos/sin (transformers' ``attention_scaling``; 1 usually).
        max_context: longest sequence, in tokens (capped at a sliding window, if any).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float
    inv_freq: torch.Tensor
    rope_scale: float
    max_context: int


@dataclass
class ModelWeights:
    """The whole model: embedding, layers, final norm and LM head (``[V, D]``).

    ``quantized``: products that run from GGUF blocks instead of their dense matrix
    (``{"qkv" | "o" | "gate_up" | "down": one per layer, "lm_head": [one]}``, see
    :mod:`specdec.runtime.quant`); ``None`` = all dense.
    """

    config: ArchConfig
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor
    quantized: dict | None = None


def extract_weights(module, max_context: int) -> ModelWeights:
    """Fused weights of a transformers Llama-family causal LM (shared storage where possible).

    Args:
        module: e.g. a ``LlamaForCausalLM`` in eval mode.
        max_context: the sequence limit the loader derived for it.

    Raises:
        UnsupportedModel: another architecture, or a feature the runtime lacks (the message
            names it): activation other than SiLU, MLP biases, dynamic rotary scaling,
            quantized (int8) layers.
    """
    config = (
        module.config.get_text_config()
        if hasattr(module.config, "get_text_config")
        else module.config
    )
    _check_supported(config)
    decoder = module.model
    rotary = decoder.rotary_emb
    window = _sliding_window(config)
    arch = ArchConfig(
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None)
        or config.hidden_size // config.num_attention_heads,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        vocab_size=module.get_output_embeddings().weight.shape[0],
        rms_eps=float(config.rms_norm_eps),
        inv_freq=rotary.inv_freq.detach().float().cpu(),
        rope_scale=float(getattr(rotary, "attention_scaling", 1.0)),
        max_context=min(max_context, window) if window else max_context,
    )
    layers = [_layer(layer) for layer in decoder.layers]
    return ModelWeights(
        config=arch,
        embed=decoder.embed_tokens.weight.detach(),
        layers=layers,
        norm=decoder.norm.weight.detach(),
        lm_head=module.get_output_embeddings().weight.detach(),
    )


def _check_supported(config) -> None:
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"architecture {kind!r} is not implemented natively "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"activation {config.hidden_act!r} (only silu is implemented)")
    if getattr(config, "mlp_bias", False):
        raise UnsupportedModel("MLP biases are not implemented")
    if getattr(config, "pretraining_tp", 1) != 1:
        raise UnsupportedModel("pretraining_tp > 1 is not implemented")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if "dynamic" in str(rope.get("rope_type", rope.get("type", "default"))):
        raise UnsupportedModel("dynamic rotary scaling is not implemented")


def _sliding_window(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    if getattr(config, "model_type", "") in ("qwen2", "qwen3") and not getattr(
        config, "use_sliding_window", False
    ):
        return None
    return int(window) if window else None


def _weight(linear) -> torch.Tensor:
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise UnsupportedModel(f"{type(linear).__name__} layers (e.g. int8) are not implemented")
    return weight.detach()


def _bias(linear) -> torch.Tensor | None:
    bias = getattr(linear, "bias", None)
    return None if bias is None else bias.detach()


def _layer(layer) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    biases = [_bias(p) for p in projections]
    if any(b is not None for b in biases):
        biases = [
            b if b is not None else torch.zeros_like(_weight(p)[:, 0])
            for b, p in zip(biases, projections, strict=True)
        ]
        qkv_bias = torch.cat(biases)
    else:
        qkv_bias = None
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    return LayerWeights(
        attn_norm=layer.input_layernorm.weight.detach(),
        qkv=torch.cat([_weight(p) for p in projections]),
        qkv_bias=qkv_bias,
        q_norm=None if q_norm is None else q_norm.weight.detach(),
        k_norm=None if k_norm is None else k_norm.weight.detach(),
        o=_weight(attn.o_proj),
        o_bias=_bias(attn.o_proj),
        mlp_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=torch.cat([_weight(mlp.gate_proj), _weight(mlp.up_proj)]),
        down=_weight(mlp.down_proj),
    )
