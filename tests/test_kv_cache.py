"""Rollback oracle: after truncate / compact, the next forward equals a recompute."""

import pytest
import torch

from specdec.kv_cache import KVCache

PROMPT = [1, 5, 9, 4, 7, 7, 3, 12, 8, 6]


def _fresh_logits(model, ids):
    cache = model.new_cache(len(ids))
    return model.forward(ids, cache)


@pytest.mark.parametrize("keep", [0, 1, 6, 10])
def test_truncate_then_forward_equals_recompute(target, keep):
    cache = target.new_cache(4)  # small capacity: the buffer must grow
    target.forward(PROMPT, cache)
    target.forward([2, 3, 4], cache)  # rejected drafts
    cache.truncate(keep)
    assert cache.num_tokens == keep
    new = [11, 13, 17]
    got = target.forward(new, cache)
    expected = _fresh_logits(target, PROMPT[:keep] + new)[keep:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert cache.num_tokens == keep + len(new)


def test_compact_keeps_chosen_prefix_positions(target):
    cache = target.new_cache(16)
    target.forward(PROMPT, cache)
    target.forward([2, 3], cache)
    cache.compact(list(range(len(PROMPT))))
    assert cache.num_tokens == len(PROMPT)
    got = target.forward([5], cache)
    torch.testing.assert_close(got, _fresh_logits(target, PROMPT + [5])[-1:], atol=1e-5, rtol=1e-5)


def test_compact_gathers_scattered_positions(target):
    # Positions are baked into keys (RoPE), so gather rows whose positions stay consecutive:
    # tokens forwarded one at a time at explicit positions 0..4, with a junk row in between.
    cache = target.new_cache(16)
    target.forward(PROMPT[:3], cache)
    target.forward([30], cache)  # junk at position 3, dropped below
    cache.truncate(3)
    target.forward(PROMPT[3:5], cache)
    reference = target.new_cache(16)
    target.forward(PROMPT[:5], reference)
    cache.compact([0, 1, 2, 3, 4])
    for ours, ref in zip(cache.layers, reference.layers, strict=True):
        torch.testing.assert_close(ours.keys, ref.keys, atol=1e-5, rtol=1e-5)
    # Reorder check: gathering [2, 0] puts row 2 first.
    row2 = cache.layers[0].keys[..., 2, :].clone()
    cache.compact([2, 0])
    torch.testing.assert_close(cache.layers[0].keys[..., 0, :], row2)


def test_bad_truncate_and_compact_raise(target):
    cache = target.new_cache(8)
    target.forward(PROMPT[:4], cache)
    with pytest.raises(ValueError):
        cache.truncate(5)
    with pytest.raises(ValueError):
        cache.truncate(-1)
    with pytest.raises(ValueError):
        cache.compact([0, 4])


def test_empty_cache_reports_zero():
    assert KVCache(num_layers=2).num_tokens == 0
