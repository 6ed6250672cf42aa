"""The tokenizer kept apart from the model: encoding with and without a chat template, and
the ids that end generation."""

from __future__ import annotations

import pytest

from conftest import make_tokenizer
from specdec.tokenizer import Tokenizer, model_eos_token_ids

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


def test_plain_tokenizer_encodes_text_and_refuses_messages():
    tok = Tokenizer(make_tokenizer())
    assert not tok.has_chat_template
    ids = tok.encode("w1 w2")
    assert tok.decode(ids) == "w1 w2"
    assert tok.eos_token_ids == {2}  # </s>
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode([{"role": "user", "content": "w1"}])


def test_chat_template_and_end_of_turn_marker_end_generation():
    hf = make_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.chat_template = TEMPLATE
    tok = Tokenizer(hf, extra_eos_token_ids=[7])
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_ids == {2, 7, im_end}
    chat = tok.encode("w1")
    assert chat == tok.encode([{"role": "user", "content": "w1"}])
    assert chat != tok.encode("w1", chat=False)
    assert Tokenizer.of(tok) is tok and len(tok) == len(hf)


def test_continue_final_message_leaves_the_assistants_message_open():
    """vLLM's / transformers' chat fields: no new assistant turn, and the last message
    without its end-of-turn marker, so generation continues it."""
    hf = make_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.chat_template = TEMPLATE
    tok = Tokenizer(hf)
    im_start, im_end = hf.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    messages = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2 w3"}]
    opened = tok.encode(messages)
    closed = tok.encode(messages, add_generation_prompt=False)
    continued = tok.encode(messages, add_generation_prompt=False, continue_final_message=True)
    assert opened[-2:] == [im_start, hf.convert_tokens_to_ids("assistant")]
    assert closed[-1] == im_end and opened[: len(closed)] == closed
    assert continued == closed[:-1] and tok.decode(continued[-2:]) == "w2 w3"
    with pytest.raises(ValueError, match="add_generation_prompt=false"):
        tok.encode(messages, continue_final_message=True)
    with pytest.raises(ValueError, match="must be the assistant's"):
        tok.encode(messages[:1], add_generation_prompt=False, continue_final_message=True)


def test_chat_template_kwargs_reach_the_template_and_reserved_names_are_refused():
    """vLLM's ``chat_template_kwargs``: extra template variables (here a system line the
    template prints when ``greeting`` is set); names specdec sets itself are refused."""
    hf = make_tokenizer()
    hf.chat_template = "{% if greeting %}w9 {% endif %}" + TEMPLATE
    tok = Tokenizer(hf)
    plain = tok.encode("w1")
    greeted = tok.encode("w1", chat_template_kwargs={"greeting": True})
    assert greeted == [hf.convert_tokens_to_ids("w9"), *plain]
    assert tok.encode("w1", chat_template_kwargs={}) == plain
    for bad, message in (
        ({"tokenize": True}, "cannot set tokenize"),
        ({"add_generation_prompt": False}, "cannot set add_generation_prompt"),
        ([("greeting", 1)], "must map variable names"),
        ({1: True}, "must map variable names"),
    ):
        with pytest.raises(ValueError, match=message):
            tok.encode("w1", chat_template_kwargs=bad)


def test_model_eos_ids_from_config_and_generation_config():
    class Config:
        eos_token_id = [3, 4]

    class Generation:
        eos_token_id = 5

    class Model:
        config = Config()
        generation_config = Generation()

    assert model_eos_token_ids(Model()) == {3, 4, 5}


def _byte_tokenizers():
    """Two tiny tokenizers whose tokens are single bytes: GPT-2's byte-level BPE symbols
    (SmolLM, Llama 3, Qwen) and SentencePiece's byte-fallback pieces ``<0xHH>`` (Llama
    2, Mistral), plus the word ``ab``."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    level = {s: i for i, s in enumerate(sorted(alphabet))}
    level["ab"] = len(level)
    raw = RawTokenizer(models.BPE(level, [("a", "b")]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    byte_level = PreTrainedTokenizerFast(tokenizer_object=raw)
    pieces = {f"<0x{b:02X}>": b for b in range(256)}
    pieces["ab"] = 256
    raw = RawTokenizer(models.BPE(pieces, [], byte_fallback=True))
    raw.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    fallback = PreTrainedTokenizerFast(tokenizer_object=raw)
    return byte_level, fallback


def test_token_bytes_are_the_bytes_a_token_stands_for_even_inside_a_character():
    """OpenAI's logprobs ``bytes``: an emoji's four byte tokens give its four bytes (each
    decodes to U+FFFD alone), which join into it."""
    party = "🎉".encode()
    byte_level, fallback = _byte_tokenizers()
    symbols = {b: s for b, s in enumerate(_gpt2_symbols())}
    for hf, piece in ((byte_level, lambda b: symbols[b]), (fallback, lambda b: f"<0x{b:02X}>")):
        tok = Tokenizer(hf)
        ids = [hf.convert_tokens_to_ids(piece(b)) for b in party]
        assert [tok.token_text(i) for i in ids] == ["\ufffd"] * 4
        assert [tok.token_bytes(i) for i in ids] == [bytes([b]) for b in party]
        assert b"".join(tok.token_bytes(i) for i in ids).decode() == "🎉"
        assert tok.token_bytes(hf.convert_tokens_to_ids("ab")) == b"ab"  # whole characters
    words = Tokenizer(make_tokenizer())
    assert words.token_bytes(3) == b"w0" and words.token_bytes(2) == b"</s>"  # special: its text


def _gpt2_symbols() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


def test_logprob_text_offsets_count_characters_whatever_tokens_split_them():
    """Completions' ``text_offset``: where each token starts in the text, in characters;
    the bytes of a split emoji make one character."""
    from specdec.sampling import TokenLogprob
    from specdec.server.app import LogprobFormat

    byte_level, _ = _byte_tokenizers()
    symbols = _gpt2_symbols()
    ids = [byte_level.convert_tokens_to_ids(symbols[b]) for b in "🎉".encode()]
    ids.append(byte_level.convert_tokens_to_ids("ab"))
    entries = [TokenLogprob(i, -0.5, [(i, -0.5)]) for i in ids]
    completions = LogprobFormat(Tokenizer(byte_level), chat=False, wanted=[True])
    assert completions.format(0, entries[:2])["text_offset"] == [0, 0]
    assert completions.format(0, entries[2:])["text_offset"] == [0, 0, 1]  # across chunks
    chat = LogprobFormat(Tokenizer(byte_level), chat=True, wanted=[True]).format(0, entries)
    content = chat["content"]
    assert b"".join(bytes(c["bytes"]) for c in content).decode() == "🎉ab"
    assert content[0]["top_logprobs"][0]["bytes"] == [0xF0]
