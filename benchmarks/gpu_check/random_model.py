"""Write a model folder with SmolLM2-135M-Instruct's shapes and random weights.

The GPU check times forwards of the embedded model's shapes on a machine where the
embedded GGUF may not be installed (``benchmarks/gpu_check.sh``). A forward's time does
not depend on the weights' values, so random ones stand in; nothing here measures
acceptance. The tokenizer is a word-level one of 256 words (the timing draws random ids
below it); the embedding and LM head keep SmolLM2's 49,152 rows.

Usage: ``python benchmarks/gpu_check/random_model.py DIR``
"""

from __future__ import annotations

import sys

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

#: SmolLM2-135M-Instruct's architecture (its config.json on the Hugging Face hub).
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def main(directory: str) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": 3 + i for i in range(256)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(initializer_range=0.02, **SMOLLM2_135M)).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    print(f"wrote {directory}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params")


if __name__ == "__main__":
    main(sys.argv[1])
