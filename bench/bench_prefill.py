"""Prefill cost: a prompt's attention by the library flash kernel against the reference.

A prompt is one causal block per row with no context; with ``attention_impl="pallas"`` it takes
``attention.prompt_attention`` (cuDNN's flash attention on GPUs, JAX's Pallas one on TPUs), else
the reference, whose dense float32 scores grow with the square of the prompt. Three parts, on a
Qwen3-8B-shaped target with random bf16 weights:

1. correctness on this device: ``prompt_attention`` against the reference at 8B head shapes, rows
   of full, partial and one valid slot (the relative error); with several devices, the library
   call per device under a kernel mesh (tensor, data) against one device, bit for bit;
2. the attention alone, per layer, at each ``--lengths`` (ms, TFLOP/s of its causal half);
3. the engine's prefill (what a request's time to first token is made of) at each length and
   ``--batch``, both ways on the same weights: ms, tokens/s, and whether the first token and the
   last layer's K/V agree.

    python bench/bench_prefill.py --lengths 512,4096,16384 --out $OUT/prefill.json
    python bench/bench_prefill.py --tiny                                              # CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench_engine import median_time, qwen3_8b, relative_error  # noqa: E402
from dflash_jax import attention  # noqa: E402
from dflash_jax.engine import Engine, EngineConfig  # noqa: E402
from dflash_jax.target import Target  # noqa: E402
from dflash_jax.tiny import tiny_target_config  # noqa: E402

WAYS = ("library", "reference")


def prompt_attention_way(way: str) -> contextlib.AbstractContextManager:
    """While tracing inside it, a prompt's attention is the library's (where this device has one) or
    the reference (``attention.library_flash_attention`` switched off)."""
    if way == "library":
        return contextlib.nullcontext()
    return mock.patch.object(attention, "library_flash_attention", lambda dtype, head_dim: None)


def compiled_prompt_attention(way: str, *args: jax.Array) -> Callable:
    """``attention.prompt_attention`` compiled ``way`` for ``args``; a fresh function each time, as
    jit caches a function's traces (a second ``jax.jit`` of one function would reuse the first's)."""
    with prompt_attention_way(way):
        return jax.jit(lambda q, k, v, lens: attention.prompt_attention(q, k, v, lens)).lower(*args).compile()


def random_qkv(seed: int, rows: int, length: int, heads: int, kv_heads: int, head_dim: int, dtype):
    """Random ``q [rows, length, heads, head_dim]`` and ``k, v [rows, length, kv_heads, head_dim]``."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(ks[0], (rows, length, heads, head_dim), dtype),
            *(jax.random.normal(key, (rows, length, kv_heads, head_dim), dtype) for key in ks[1:]))


def failure(err: Exception) -> dict:
    """A variant's row when it fails (the reference's scores may not fit the device)."""
    return {"error": f"{type(err).__name__}: {err}"[:300]}


def check_library(heads: int, kv_heads: int, head_dim: int, length: int, dtype) -> dict:
    """``prompt_attention`` (library) against the reference on random data, 3 rows of lengths
    ``length``, ``length // 3`` and 1."""
    q, k, v = random_qkv(0, 3, length, heads, kv_heads, head_dim, dtype)
    lens = jnp.array([length, length // 3, 1], jnp.int32)
    got = compiled_prompt_attention("library", q, k, v, lens)(q, k, v, lens)
    want = compiled_prompt_attention("reference", q, k, v, lens)(q, k, v, lens)
    valid = [(0, length), (1, length // 3), (2, 1)]
    return {"library": attention.library_flash_attention(dtype, head_dim), "length": length,
            "rel_err": relative_error(got, want),
            "rel_err_valid_rows": [relative_error(got[r, :n], want[r, :n]) for r, n in valid],
            "max_abs_err": float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))}


def check_mesh(heads: int, kv_heads: int, head_dim: int, length: int, dtype) -> dict:
    """``prompt_attention`` per device under a kernel mesh of every device (``shard_kernel``: rows
    on ``data``, KV heads on ``tensor``) against one device: each device runs the same per-head
    library call on its share, so the results must be equal bit for bit."""
    from dflash_jax import sharding
    from dflash_jax.sharding import MeshConfig, make_mesh

    n = jax.device_count()
    q, k, v = random_qkv(1, 2, length, heads, kv_heads, head_dim, dtype)
    lens = jnp.array([length, length // 2], jnp.int32)
    want = np.asarray(compiled_prompt_attention("library", q, k, v, lens)(q, k, v, lens), np.float32)
    report = {}
    for name, mesh_config in (("tensor", MeshConfig(data=1, fsdp=1, tensor=n)),
                              ("data", MeshConfig(data=n, fsdp=1, tensor=1))):
        with sharding.kernel_mesh(make_mesh(mesh_config)):
            got = np.asarray(compiled_prompt_attention("library", q, k, v, lens)(q, k, v, lens), np.float32)
        report[f"{name}={n}"] = {"bit_equal": bool(np.array_equal(got, want)),
                                 "max_abs_diff": float(np.max(np.abs(got - want)))}
    return report


def time_attention(heads: int, kv_heads: int, head_dim: int, length: int, batch: int, dtype, repeats: int) -> dict:
    """One layer's prompt attention at ``length`` both ways: ms and TFLOP/s of the causal half
    (``2 * batch * heads * length**2 * head_dim`` FLOPs)."""
    q, k, v = random_qkv(length, batch, length, heads, kv_heads, head_dim, dtype)
    lens = jnp.full((batch,), length, jnp.int32)
    flops = 2 * batch * heads * length**2 * head_dim
    row = {"length": length, "batch": batch}
    for way in WAYS:
        try:
            ms = median_time(compiled_prompt_attention(way, q, k, v, lens), q, k, v, lens, repeats=repeats)[0] * 1e3
            row[way] = {"ms": ms, "tflops": flops / ms / 1e9}
        except Exception as err:  # noqa: BLE001
            row[way] = failure(err)
    return row


def time_prefill(engines: dict[str, Engine], length: int, batch: int, vocab: int, repeats: int) -> dict:
    """``Engine.prefill`` of ``batch`` random prompts of ``length`` tokens with each engine."""
    rng = np.random.default_rng(length + batch)
    prompts = [rng.integers(0, vocab, length).tolist() for _ in range(batch)]
    row = {"length": length, "batch": batch}
    outs = {}
    for way, engine in engines.items():
        try:
            with prompt_attention_way(way):  # the engine traces its prefill on the first call of a shape
                ms = median_time(lambda: engine.prefill(prompts, [1] * batch, [()] * batch)[1],
                                 repeats=repeats)[0] * 1e3
            state, first = engine.prefill(prompts, [1] * batch, [()] * batch)
            outs[way] = (np.asarray(first), state.target_cache.k[-1][:, :length])
            row[way] = {"ms": ms, "tokens_per_s": batch * length / ms * 1e3}
        except Exception as err:  # noqa: BLE001
            row[way] = failure(err)
    if len(outs) == 2:
        (f_lib, k_lib), (f_ref, k_ref) = outs["library"], outs["reference"]
        row["first_tokens_equal"] = int(np.sum(f_lib == f_ref))  # of the batch's rows
        row["last_layer_k_rel_err"] = relative_error(k_lib, k_ref)
    return row


def prefill_rows(tcfg, lengths: list[int], batch: int, repeats: int) -> list[dict]:
    """``time_prefill`` at every length with two engines on one random target (the switch acts when
    an engine traces its prefill, inside ``time_prefill``); prints a line per length."""
    target = Target(tcfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    config = EngineConfig(max_length=max(lengths) + 64, max_batch_size=batch, attention_impl="pallas")
    engines = {way: Engine(target, None, config) for way in WAYS}
    rows = []
    print(f"\nEngine.prefill, batch {batch}: ms (prompt tokens/s)")
    for n in lengths:
        r = time_prefill(engines, n, batch, tcfg.vocab_size, repeats)
        rows.append(r)
        cells = [f"{r[w]['ms']:9.1f} ({r[w]['tokens_per_s']:8.0f})" if "ms" in r[w] else r[w]["error"][:60]
                 for w in WAYS]
        ratio = r["reference"]["ms"] / r["library"]["ms"] if "ms" in r["reference"] and "ms" in r["library"] else None
        agree = (f"first tokens equal in {r['first_tokens_equal']}/{batch} rows, last layer K rel err "
                 f"{r['last_layer_k_rel_err']:.2e}" if "first_tokens_equal" in r else "")
        print(f"  {n:6d} tokens: library {cells[0]}   reference {cells[1]}   "
              f"{f'{ratio:.2f}x' if ratio else ''}  {agree}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,4096,16384")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="check,mesh,attention,prefill",
                    help="which parts to run (mesh: with several devices, the library call per device)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of this script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.tiny:
        tcfg = tiny_target_config(vocab_size=512, num_layers=2)
        lengths = [min(n, 128) for n in lengths]
    else:
        tcfg = qwen3_8b(args.layers)
    dtype = jnp.bfloat16
    heads, kv, dim = tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {dev.device_kind}; library flash attention here: "
          f"{attention.library_flash_attention(dtype, dim)}", flush=True)
    report = {"device": dev.device_kind, "jax": jax.__version__, "layers": tcfg.num_layers, "batch": args.batch}

    parts = set(args.parts.split(","))
    if "check" in parts:
        report["check"] = c = check_library(heads, kv, dim, min(2048, max(lengths)), dtype)
        print(f"check at {c['length']} tokens: rel err {c['rel_err']:.2e} (valid rows "
              f"{', '.join(f'{e:.2e}' for e in c['rel_err_valid_rows'])}), max abs {c['max_abs_err']:.2e}", flush=True)

    if "mesh" in parts and jax.device_count() > 1:
        report["mesh"] = m = check_mesh(heads, kv, dim, min(2048, max(lengths)), dtype)
        print("on a mesh against one device: " + ", ".join(
            f"{name} bit-equal {r['bit_equal']} (max diff {r['max_abs_diff']:.1e})" for name, r in m.items()), flush=True)

    report["attention"] = []
    if "attention" in parts:
        print(f"\none layer's prompt attention, batch {args.batch}: ms (TFLOP/s of the causal half)")
    for n in lengths if "attention" in parts else ():
        r = time_attention(heads, kv, dim, n, args.batch, dtype, args.repeats * 3)
        report["attention"].append(r)
        cells = [f"{r[w]['ms']:8.3f} ({r[w]['tflops']:5.1f})" if "ms" in r[w] else r[w]["error"][:60] for w in WAYS]
        print(f"  {n:6d} tokens: library {cells[0]}   reference {cells[1]}", flush=True)

    if "prefill" in parts:
        report["prefill"] = prefill_rows(tcfg, lengths, args.batch, args.repeats)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
