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
