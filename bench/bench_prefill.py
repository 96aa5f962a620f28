"""Prefill cost: a prompt's attention by the library flash kernel against the reference.

A prompt is one causal block per row with no context; with the kernels on it takes
``ops.attention.prompt_attention`` (cuDNN's flash attention on GPUs, JAX's Pallas one on TPUs), else
the reference, whose dense float32 scores grow with the square of the prompt. On a Qwen3-8B-shaped
target with random bf16 weights:

1. ``check``: the library against the reference at 8B head shapes (a sanity check; the correctness
   tests are ``pytest -m gpu tests/gpu``);
2. ``attention``: the attention alone, one layer, at each ``--lengths`` (ms, TFLOP/s of its causal half);
3. ``prefill``: ``Engine.prefill`` (what a request's time to first token is made of) at each length and
   ``--batch``, with the kernels on (``attention_impl="pallas"``: the library) and off ("xla": the
   reference) on the same weights: ms, tokens/s, and whether the first tokens and last layer's K agree.

    python3 bench/bench_prefill.py --lengths 512,4096,16384 --out bench/results/prefill.json
    JAX_PLATFORMS=cpu python3 bench/bench_prefill.py --tiny                     # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import timing
from dflash_jax.models.target import Target
from dflash_jax.ops import attention
from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.tiny import tiny_target_config
from kernels_pallas.block_attention.reference import block_attention_reference

WAYS = ("library", "reference")


def reference_prompt_attention(q, k, v, lens):
    """``prompt_attention``'s function by the reference: one causal block per row, no context."""
    empty = jnp.zeros((k.shape[0], 0) + k.shape[2:], k.dtype)
    zeros = jnp.zeros((q.shape[0], 1), jnp.int32)
    return block_attention_reference(q[:, None], empty, empty, zeros, k[:, None], v[:, None], lens[:, None],
                                      causal=True)[:, 0]


def compiled(way: str, *args: jax.Array):
    fn = attention.prompt_attention if way == "library" else reference_prompt_attention
    return jax.jit(fn).lower(*args).compile()


def random_qkv(seed: int, rows: int, length: int, heads: int, kv_heads: int, head_dim: int, dtype):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (timing.normal(ks[0], (rows, length, heads, head_dim), dtype),
            *(timing.normal(key, (rows, length, kv_heads, head_dim), dtype) for key in ks[1:]))


def failure(err: Exception) -> dict:
    """A variant's row when it fails (the reference's scores may not fit the device)."""
    return {"error": f"{type(err).__name__}: {err}"[:300]}


def check_library(heads: int, kv_heads: int, head_dim: int, length: int, dtype) -> dict:
    q, k, v = random_qkv(0, 3, length, heads, kv_heads, head_dim, dtype)
    lens = jnp.array([length, length // 3, 1], jnp.int32)
    got, want = (compiled(way, q, k, v, lens)(q, k, v, lens) for way in WAYS)
    return {"library": attention.library_flash_attention(dtype, head_dim), "length": length,
            "rel_err": timing.relative_error(got, want)}


def time_attention(heads: int, kv_heads: int, head_dim: int, length: int, batch: int, dtype, repeats: int) -> dict:
    """One layer's prompt attention both ways: ms and TFLOP/s of the causal half
    (``2 * batch * heads * length**2 * head_dim`` FLOPs)."""
    q, k, v = random_qkv(length, batch, length, heads, kv_heads, head_dim, dtype)
    lens = jnp.full((batch,), length, jnp.int32)
    flops = 2 * batch * heads * length**2 * head_dim
    row = {"length": length, "batch": batch}
    for way in WAYS:
        try:
            ms = timing.median_time(compiled(way, q, k, v, lens), q, k, v, lens, repeats=repeats)[0] * 1e3
            row[way] = {"ms": ms, "tflops": flops / ms / 1e9}
        except Exception as err:  # noqa: BLE001  (the reference's scores may not fit)
            row[way] = failure(err)
    return row


def time_prefill(engines: dict[str, Engine], length: int, batch: int, vocab: int, repeats: int) -> dict:
    """``Engine.prefill`` of ``batch`` random prompts of ``length`` tokens with each engine."""
    rng = np.random.default_rng(length + batch)
    prompts = [rng.integers(0, vocab, length).tolist() for _ in range(batch)]
    row, outs = {"length": length, "batch": batch}, {}
    for way, engine in engines.items():
        try:
            ms = timing.median_time(lambda: engine.prefill(prompts, [1] * batch, [()] * batch)[1],
                                    repeats=repeats)[0] * 1e3
            state, first = engine.prefill(prompts, [1] * batch, [()] * batch)
            outs[way] = (np.asarray(first), state.target_cache.k[-1][:, :length])
            row[way] = {"ms": ms, "tokens_per_s": batch * length / ms * 1e3}
        except Exception as err:  # noqa: BLE001  (the reference's scores may not fit)
            row[way] = failure(err)
    if len(outs) == 2:
        (f_lib, k_lib), (f_ref, k_ref) = outs["library"], outs["reference"]
        row["first_tokens_equal"] = int(np.sum(f_lib == f_ref))  # of the batch's rows
        row["last_layer_k_rel_err"] = timing.relative_error(k_lib, k_ref)
    return row


def prefill_rows(tcfg, lengths: list[int], batch: int, repeats: int) -> list[dict]:
    target = Target(tcfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    config = EngineConfig(max_length=max(lengths) + 64, max_batch_size=batch)
    first = Engine(target, None, dataclasses.replace(config, attention_impl="pallas"))
    engines = dict(zip(WAYS, (first, first.derive(dataclasses.replace(config, attention_impl="xla")))))
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
    ap.add_argument("--parts", default="check,attention,prefill", help="which parts to run")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of this script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.tiny:
        tcfg = tiny_target_config(vocab_size=512, num_layers=2)
        lengths = sorted({min(n, 128) for n in lengths})
    else:
        tcfg = timing.qwen3_8b(args.layers)
    dtype, parts = jnp.bfloat16, set(args.parts.split(","))
    heads, kv, dim = tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim
    print(f"{timing.device_line()}; library flash attention here: {attention.library_flash_attention(dtype, dim)}",
          flush=True)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "layers": tcfg.num_layers,
              "batch": args.batch, "attention": []}
    if "check" in parts:
        report["check"] = c = check_library(heads, kv, dim, min(2048, max(lengths)), dtype)
        print(f"check at {c['length']} tokens: library vs reference, rel err {c['rel_err']:.2e}", flush=True)
    if "attention" in parts:
        print(f"\none layer's prompt attention, batch {args.batch}: ms (TFLOP/s of the causal half)")
        for n in lengths:
            r = time_attention(heads, kv, dim, n, args.batch, dtype, args.repeats * 3)
            report["attention"].append(r)
            cells = [f"{r[w]['ms']:8.3f} ({r[w]['tflops']:5.1f})" if "ms" in r[w] else r[w]["error"][:60] for w in WAYS]
            print(f"  {n:6d} tokens: library {cells[0]}   reference {cells[1]}", flush=True)
    if "prefill" in parts:
        report["prefill"] = prefill_rows(tcfg, lengths, args.batch, args.repeats)
    timing.write_json(args.out, report)


if __name__ == "__main__":
    main()
