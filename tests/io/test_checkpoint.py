"""Writing HF safetensors: a sharded export (``shard_safetensors``) reads back as what was saved."""

import json

import jax
import numpy as np
from flax import nnx

from dflash_jax.io.checkpoint import load_target, save_target, shard_safetensors
from dflash_jax.tiny import random_target, tiny_target_config


def test_bfloat16_sharded_target_loads_as_float32(tmp_path):
    """``shard_safetensors`` splits a saved target into shards of at most the size asked for, with an index
    naming every shard; the shards load back (bfloat16 on disk, float32 asked for) as the weights saved."""
    target = random_target(tiny_target_config())
    save_target(target, tmp_path, dtype="bfloat16")
    single = (tmp_path / "model.safetensors").stat().st_size
    files = shard_safetensors(tmp_path, max_shard_bytes=single // 3)
    assert len(files) >= 3 and not (tmp_path / "model.safetensors").exists()
    assert all(f.stat().st_size <= single // 3 + 4096 for f in files)  # + the header
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    loaded = load_target(tmp_path, dtype="float32")
    for a, b in zip(jax.tree.leaves(nnx.state(target, nnx.Param)), jax.tree.leaves(nnx.state(loaded, nnx.Param))):
        assert b.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(a.astype("bfloat16")).astype(np.float32), np.asarray(b))
