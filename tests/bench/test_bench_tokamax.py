"""bench/bench_tokamax.py off the GPU: the line and JSON it gives without tokamax, and its exact
re-encoding of MXFP4 experts as int8 codes (where qwix, tokamax's dependency, is installed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_tokamax  # noqa: E402
from dflash_jax.ops.experts import mxfp4_dequantize  # noqa: E402


def test_without_tokamax_it_says_so_and_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tokamax", None)  # import tokamax raises ImportError
    out = tmp_path / "tokamax.json"
    bench_tokamax.main(["--tiny", "--json", str(out)])
    assert "tokamax is not importable here" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["tokamax"] is None and "tokamax" in report["tokamax_error"]


def test_mxfp4_as_int8_codes_are_the_same_numbers():
    qwix = pytest.importorskip("qwix")
    blocks, scales = bench_tokamax.random_mxfp4(jax.random.key(0), 3, 8, 64)
    q = bench_tokamax.mxfp4_as_int8_qarray(blocks, scales)
    assert isinstance(q, qwix.QArray) and q.qvalue.dtype == jnp.int8 and q.scale_tile_shape == (1, 32, 1)
    scale = jnp.repeat(q.scale.astype(jnp.float32), 32, axis=1)
    got = q.qvalue.astype(jnp.float32) * scale  # [E, K, N]
    want = jnp.swapaxes(mxfp4_dequantize(blocks, scales, jnp.float32), -1, -2)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
