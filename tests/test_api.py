"""The Python API refuses what it cannot use with an error naming the argument, before any JAX tracing:
``target_forward``, ``draft_logits`` and ``save_drafter``."""

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.tiny import write_tiny_pair


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target_dir, drafter_dir = write_tiny_pair(tmp_path_factory.mktemp("api"), drafter_overrides=dict(block_size=4))
    return dj.load_target(target_dir), dj.load_drafter(drafter_dir)


@pytest.mark.parametrize("ids, error, match", [
    ("def f():", TypeError, "input_ids must be token ids .*got a string"),
    ([1, 2, 3], ValueError, r"input_ids must be non-empty token ids \[batch, seq\], got shape \(3,\)"),
    ([[1, 2, 3], [4]], ValueError, "rows of equal length"),
    ([[]], ValueError, r"non-empty .*shape \(1, 0\)"),
    ([[1.5, 2.0]], TypeError, "input_ids must be integer token ids"),
    ([[True, False]], TypeError, "input_ids must be integer token ids, got bool"),
    # numpy reads a boolean among ints as the id 0 or 1: refused wherever it sits
    ([[1, 2], [3, True]], ValueError, r"input_ids\[1\] must be integers \(token ids\), not booleans: got \[3, True\]"),
    ([[np.bool_(False), 2]], ValueError, r"input_ids\[0\] must be integers \(token ids\), not booleans"),
    ([[1, -2]], ValueError, r"input_ids has token ids outside \[0, "),
    ([[1, 10**6]], ValueError, r"input_ids has token ids outside \[0, "),
])
def test_target_forward_refuses_bad_ids(models, ids, error, match):
    with pytest.raises(error, match=match):
        dj.target_forward(models[0], ids)


def test_target_forward_refuses_bad_layers_and_models(models):
    target, drafter = models
    layers = target.config.num_layers
    for bad in ([layers], [-1], ["a"]):
        with pytest.raises(ValueError, match=rf"layer_ids must be layer indices in \[0, {layers}\)"):
            dj.target_forward(target, [[1, 2]], layer_ids=bad)
    with pytest.raises(TypeError, match="target must be a target model .*got Drafter"):
        dj.target_forward(drafter, [[1, 2]])
    logits, taps = dj.target_forward(target, np.array([[1, 2, 3]]), layer_ids=[np.int64(0)])  # numpy is fine
    assert logits.shape[:2] == (1, 3) and taps.shape[:2] == (1, 3)


def test_draft_logits_refuses_bad_arguments(models):
    target, drafter = models
    vocab = target.config.vocab_size
    cases = [
        (dict(context_ids=[]), ValueError, r"context_ids must be non-empty token ids \[seq\]"),
        (dict(context_ids=[[1, 2, 3]]), ValueError, r"context_ids must be non-empty token ids \[seq\], got shape"),
        (dict(context_ids="abc"), TypeError, "got a string"),
        (dict(context_ids=[1, True, 3]), ValueError, r"context_ids must be integers \(token ids\), not booleans"),
        (dict(context_ids=[1, vocab]), ValueError, "context_ids has token ids outside"),
        (dict(anchor_id=[5]), ValueError, "anchor_id must be one token id"),
        (dict(anchor_id=vocab), ValueError, "anchor_id must be one token id"),
        (dict(block_size=1), ValueError, "block_size must be an integer >= 2"),
        (dict(block_size=0), ValueError, "block_size must be an integer >= 2"),
        (dict(block_size=-3), ValueError, "block_size must be an integer >= 2"),
    ]
    for change, error, match in cases:
        kwargs = {"context_ids": [1, 2, 3], "anchor_id": 5, **change}
        with pytest.raises(error, match=match):
            dj.draft_logits(drafter, target, **kwargs)
    with pytest.raises(TypeError, match="draft_logits: target must be a target model"):
        dj.draft_logits(target, drafter, [1, 2, 3], 5)  # swapped
    assert dj.draft_logits(drafter, target, [1, 2, 3], np.int32(5)).shape == (3, vocab)


def test_draft_logits_refuses_a_drafter_of_another_target(models, tmp_path):
    target, _ = models
    _, other_dir = write_tiny_pair(tmp_path, target_overrides=dict(num_layers=target.config.num_layers + 1))
    with pytest.raises(ValueError, match=r"num_target_layers 5 != the target.s 4 \(a drafter of another target\)"):
        dj.draft_logits(dj.load_drafter(other_dir), target, [1, 2, 3], 5)


def test_save_drafter_refuses_a_target(models, tmp_path):
    target, drafter = models
    with pytest.raises(TypeError, match="save_drafter: drafter must be a Drafter .*got Target .*save_target"):
        dj.save_drafter(target, tmp_path / "d")
    with pytest.raises(TypeError, match="save_target: target must be a Target .*got Drafter"):
        dj.save_target(drafter, tmp_path / "t")
    assert not (tmp_path / "d").exists() and not (tmp_path / "t").exists()
