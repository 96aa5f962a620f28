"""Tokamax's kernels against ours, on our shapes, where the two compute the same function.

Tokamax (PyPI ``tokamax``) is a library of Pallas kernels. Each table below runs an op of ours and
tokamax's op on the same inputs, first holds every output to a reference (``ok``: largest difference
within bf16 rounding, 2e-2 of the largest entry), then times each (a chain of ``--chain`` dependent
calls in one jit, microseconds per call). A tokamax implementation that does not exist here (not
importable, e.g. its Triton-language kernels without ``jax_triton``) or refuses the shapes
prints one line saying so; the others still run.

1. Attention, Qwen3-8B heads (32 q / 8 kv, head_dim 128), bf16, batches and contexts of
   ``--batches`` / ``--contexts`` (row ``b`` holds ``context - 64 * b`` cached positions: per-row
   lengths), patterns (``--modes``) over one KV cache with the block's K/V already written after each
   row's context: ``decode`` (1 query), ``verify`` (16 queries, causal), ``draft`` (16 queries, no mask
   inside the block; not in the default run, which keeps to 90 s). Cases start until ``--budget-s``. Ours: ``kernels_pallas.block_attention`` on the Triton and Mosaic GPU lowerings;
   tokamax: its flash attention with a per-query-row key end (``Mask(k_end=...)``: key ``j`` is
   visible to slot ``i`` of row ``b`` iff ``j < ctx[b] + i + 1``, or ``ctx[b] + 16`` for a draft
   block). Bandwidth: the rows' context K/V read once, in % of ``timing.HBM_BYTES_PER_S``.
2. Grouped expert products, Qwen3-30B-A3B (128 experts, top-8, hidden 2048, expert width 768) and
   gpt-oss-20b (32 experts, top-4, hidden 2880, width 2880) at ``--tokens`` tokens of random routing:
   the gate-up and the down product of the pairs sorted by expert. Ours: ``jax.lax.ragged_dot``
   (``xla``; ``ops.experts``' "ragged_dot") and one matrix-vector product per pair (``gemv``;
   ``ops.experts``' "gemv", on gpt-oss also straight from the MXFP4 bytes: ``gemv_mxfp4``); tokamax:
   ``tokamax.ragged_dot`` per implementation on the bf16 weights, and on gpt-oss ``mosaic_int8``: the
   MXFP4 experts re-encoded exactly as int8 codes (twice the E2M1 value) with a bfloat16 scale per 32
   inputs, as a ``qwix.QArray`` (tokamax's Hopper kernel takes int4/int8 codes, not E2M1).
   Bandwidth: the touched experts' weight bytes read once (bf16; MXFP4 rows count 4-bit bytes).
3. Add + RMSNorm at the 8B width (4096), ``--norm-rows`` rows: ours (``ops.norms.add_rms_norm``, XLA's
   fusions); tokamax's ``layer_norm`` with ``subtract_mean=False`` after an XLA add (tokamax has no
   fused add).

Tokamax implementations (``--tokamax``): "auto" is ``mosaic,triton`` on a GPU and ``xla`` elsewhere
(the CPU smoke test, which runs our kernels in interpret mode).

    python3 bench/bench_tokamax.py --json $OUT/tokamax.json     # < 90 s on one H200
    JAX_PLATFORMS=cpu python3 bench/bench_tokamax.py --tiny      # smoke test

Tokamax is not a dependency of the project: on the H200 its wheels travel with the command
(docs/performance.md, "Tokamax").
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import timing
from bench_mosaic import chained, log, timed
from dflash_jax.ops.experts import FP4_VALUES, MXFP4_BLOCK, _pair_product, mxfp4_dequantize, route
from dflash_jax.ops.norms import add_rms_norm
from kernels_pallas.experts.reference import MXFP4_SCALE_BIAS
from kernels_pallas.block_attention import block_attention

TOLERANCE = 2e-2  # bf16 rounding of a result, relative to its largest entry
EPS = 1e-6
ATTENTION_SHAPES = (32, 8, 128)  # Qwen3-8B: q heads, kv heads, head_dim
BLOCK = 16  # verify and draft block
EXPERT_FAMILIES = {  # experts, top-k, hidden, expert width
    "qwen3_30b_a3b": (128, 8, 2048, 768),
    "gpt_oss_20b": (32, 4, 2880, 2880),
}
TINY_EXPERT_FAMILIES = {"qwen3_moe_tiny": (16, 4, 128, 64), "gpt_oss_tiny": (8, 2, 128, 64)}


def load_tokamax():
    """``(tokamax, None)``, or ``(None, why)`` when it does not import here.

    Tokamax imports its Triton-language kernels (normalization, a ragged dot) only if ``jax_triton``
    imports, but catches only ``ImportError``: a ``jax_triton`` built for another JAX or Triton can
    fail otherwise and take tokamax with it. Then tokamax is imported again without ``jax_triton``
    (those kernels are reported unavailable)."""
    try:
        import tokamax
        return tokamax, None
    except Exception as e:  # noqa: BLE001  (a missing dependency of tokamax is as much "not here")
        why = f"{type(e).__name__}: {e}"
        from_jax_triton = any("jax_triton" in frame.filename for frame in traceback.extract_tb(e.__traceback__))
    if not from_jax_triton:
        return None, why
    for name in [m for m in sys.modules if m.split(".")[0] in ("tokamax", "jax_triton")]:
        del sys.modules[name]
    sys.modules["jax_triton"] = None  # import jax_triton now raises ImportError
    try:
        import tokamax
    except Exception:  # noqa: BLE001
        return None, why
    log(f"tokamax imported without jax_triton ({why}): its Triton-language kernels are unavailable")
    return tokamax, None


def checked(name: str, out, want, row: dict) -> bool:
    """Records ``out``'s difference from ``want`` in ``row[name + "_err_rel"]``; False (and a line) when
    it is off by more than bf16 rounding: a kernel that computes something else is not timed."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    err = timing.relative_error(out, want)
    row[name + "_err_rel"] = err
    if not err <= TOLERANCE:
        row[name + "_us"] = None
        row[name + "_err"] = f"output differs from the reference by {err:.1e} (> {TOLERANCE})"
        log(f"  {name}: {row[name + '_err']}")
        return False
    return True


def run_case(row: dict, variants: dict, args_of: dict, want, *, chain: int, repeats: int, nbytes):
    """Each variant as a chain of ``chain`` calls in one jit (compiled once): its output held to
    ``want``, then timed if it matched. A variant that raises is recorded, never raised."""
    for name, fn in variants.items():
        run = chained(fn, chain)
        try:
            out = jax.block_until_ready(run(*args_of[name])[1])  # the chain's inputs are the call's
        except Exception as e:  # noqa: BLE001  (an op that refuses these shapes must not stop the others)
            row[name + "_us"] = None
            row[name + "_err"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            log(f"  {name}: {row[name + '_err']}")
            continue
        if checked(name, out, want, row):
            timed(name, run, args_of[name], row, chain=chain, repeats=repeats, nbytes=nbytes)


def cells(row: dict, names, bandwidth: bool) -> str:
    def cell(n):
        us = row.get(n + "_us")
        if us is None:
            return f"{n} --"
        return f"{n} {us:7.1f}" + (f" {100 * row[n + '_bw']:3.0f}%" if bandwidth and n + "_bw" in row else "")
    return " | ".join(cell(n) for n in names)


# -- attention --------------------------------------------------------------------------------------


def tokamax_attention_ops(tokamax, names: list[str]) -> dict:
    """Tokamax's attention ops by our name for them, each with its mask class; an implementation absent
    here maps to its reason. The per-query-row key end is not in ``tokamax.dot_product_attention``'s arguments (it takes one
    length per row): the ops are called directly with ``Mask(k_end=...)``."""
    try:
        from tokamax._src.ops.attention import api, base
    except ImportError as e:  # private modules: another tokamax version may have moved them
        return {name: f"tokamax's attention ops are not where 0.0.17 has them ({e})" for name in names}
    found = {}
    for name in names:
        key = {"mosaic": "mosaic_gpu"}.get(name, name)
        op = api.IMPLEMENTATIONS.get(key)
        found[name] = (op, base.Mask) if op is not None else f"no '{key}' attention in this tokamax install"
    return found


def attention_cases(args, tokamax) -> list[dict]:
    hq, hkv, d = args.attention_shapes
    ours = {"ours_triton": "triton", "ours_mosaic": "mosaic"}
    tk_ops = tokamax_attention_ops(tokamax, args.tokamax)

    def our_attention(lowering, causal):
        def fn(q, k_cache, v_cache, ctx_lens, k_blk, v_blk, blk_lens):
            return block_attention(q[:, None], k_cache, v_cache, ctx_lens[:, None], k_blk[:, None], v_blk[:, None],
                                   blk_lens[:, None], causal=causal, lowering=lowering)[:, 0]
        return fn

    def tokamax_attention(op, causal):
        op, Mask = op  # noqa: N806  (tokamax's class)

        def fn(q, k_all, v_all, ctx_lens):
            slot = jnp.arange(q.shape[1], dtype=jnp.int32)
            k_end = ctx_lens[:, None] + (slot + 1 if causal else q.shape[1])  # [B, T]: exclusive
            return op(q, k_all, v_all, mask=Mask(k_end=k_end[:, None, :]), logits_scale=d ** -0.5)
        return fn

    rows, t_start = [], time.time()
    for ctx in args.contexts:
        for batch in args.batches:
            for mode in args.modes:
                if time.time() - t_start > args.budget_s:
                    log(f"(time budget reached: skipping {mode} T={ctx} B={batch})")
                    continue
                block, causal = (1, True) if mode == "decode" else (BLOCK, mode == "verify")
                ks = jax.random.split(jax.random.key(ctx + 7 * batch + block), 5)
                dt = jnp.bfloat16
                ctx_lens = jnp.asarray([max(ctx - 64 * b, block) for b in range(batch)], jnp.int32)
                q = timing.normal(ks[0], (batch, block, hq, d), dt)
                k_blk, v_blk = (timing.normal(k, (batch, block, hkv, d), dt) for k in ks[1:3])
                k_cache, v_cache = (timing.normal(k, (batch, ctx, hkv, d), dt) for k in ks[3:5])
                # Tokamax's view: one cache holding each row's block right after its context, padded to
                # whole 128-key tiles (a length off the kernel's tiles would be padded on every call).
                capacity = -(-(ctx + block) // 128) * 128
                pos = ctx_lens[:, None] + jnp.arange(block)[None]
                rows_i = jnp.arange(batch)[:, None]

                def full(cache, blk):
                    padded = jnp.pad(cache, ((0, 0), (0, capacity - ctx), (0, 0), (0, 0)))
                    return padded.at[rows_i, pos].set(blk)

                k_all, v_all = full(k_cache, k_blk), full(v_cache, v_blk)
                blk_lens = jnp.full((batch,), block, jnp.int32)
                ours_args = (q, k_cache, v_cache, ctx_lens, k_blk, v_blk, blk_lens)
                variants, args_of = {}, {}
                for name, lowering in ours.items():
                    variants[name], args_of[name] = our_attention(lowering, causal), ours_args
                for name, op in tk_ops.items():
                    name = "tokamax_" + name
                    if isinstance(op, str):
                        variants[name] = _unavailable(op)
                    else:
                        variants[name] = tokamax_attention(op, causal)
                    args_of[name] = (q, k_all, v_all, ctx_lens)
                reference = _attention_reference(*ours_args, causal=causal)
                kv_bytes = 2 * int(jnp.sum(ctx_lens)) * hkv * d * 2
                row = dict(kind="attention", mode=mode, ctx=ctx, batch=batch, block=block, kv_bytes=kv_bytes)
                run_case(row, variants, args_of, reference, chain=args.chain, repeats=args.repeats, nbytes=kv_bytes)
                rows.append(row)
                log(f"{mode:6s} T={ctx:>6} B={batch:>2} | {cells(row, variants, bandwidth=True)}")
    return rows


def _attention_reference(q, k_cache, v_cache, ctx_lens, k_blk, v_blk, blk_lens, *, causal):
    """The block attention's pure-jnp reference on these inputs (``[batch, block, heads, head_dim]``)."""
    from kernels_pallas.block_attention.reference import block_attention_reference

    return jax.jit(lambda *a: block_attention_reference(
        a[0][:, None], a[1], a[2], a[3][:, None], a[4][:, None], a[5][:, None], a[6][:, None], causal=causal)[:, 0])(
        q, k_cache, v_cache, ctx_lens, k_blk, v_blk, blk_lens)


class Unavailable(Exception):
    """A variant that does not exist here (reported on its row, never timed)."""


def _unavailable(reason: str):
    def fn(*_):
        raise Unavailable(reason)
    return fn


# -- grouped expert products ------------------------------------------------------------------------


def random_mxfp4(key, experts: int, n: int, k: int):
    """Random MXFP4 experts in the checkpoint's layout: ``(blocks [E, N, K / 32, 16] uint8, scales
    [E, N, K / 32] uint8)``, scales near ``2 ** -5`` (weights of a trained layer's size)."""
    kb, ks = jax.random.split(key)
    blocks = jax.random.randint(kb, (experts, n, k // MXFP4_BLOCK, MXFP4_BLOCK // 2), 0, 256, jnp.int32)
    scales = jax.random.randint(ks, (experts, n, k // MXFP4_BLOCK), MXFP4_SCALE_BIAS - 7, MXFP4_SCALE_BIAS - 3,
                                jnp.int32)
    return blocks.astype(jnp.uint8), scales.astype(jnp.uint8)


def mxfp4_as_int8_qarray(blocks: jax.Array, scales: jax.Array):
    """MXFP4 experts as the same numbers in an int8 ``qwix.QArray`` ``[E, K, N]``: each code is twice its
    E2M1 value (an integer in [-12, 12]) and each block of 32 inputs has the bfloat16 scale
    ``2 ** (s - 128)`` (exact: a power of two in bfloat16's range)."""
    import qwix

    codes = jnp.asarray(np.rint(2 * FP4_VALUES).astype(np.int8))
    nibbles = jnp.stack([blocks & 0x0F, blocks >> 4], axis=-1).astype(jnp.int32)  # low nibble first
    qvalue = codes[nibbles].reshape(blocks.shape[:-2] + (-1,))  # [E, N, K]
    scale = jnp.ldexp(jnp.float32(1), scales.astype(jnp.int32) - MXFP4_SCALE_BIAS - 1).astype(jnp.bfloat16)
    return qwix.QArray(qvalue=jnp.swapaxes(qvalue, -1, -2), scale=jnp.swapaxes(scale, -1, -2), qtype=jnp.int8)


def expert_cases(args, tokamax) -> list[dict]:
    rows_out = []
    for family, (num_experts, top_k, hidden, width) in args.expert_families.items():
        mxfp4 = family.startswith("gpt_oss")
        for tokens in args.tokens:
            key = jax.random.key(tokens + num_experts)
            logits = jax.random.normal(jax.random.fold_in(key, 1), (tokens, num_experts))
            _, ids = route(logits, top_k, softmax_first=True, normalize=True)
            ids = ids.reshape(-1)
            order = jnp.argsort(ids, stable=True)
            sorted_ids = ids[order].astype(jnp.int32)
            counts = jnp.bincount(ids, length=num_experts).astype(jnp.int32)
            touched = int(jnp.sum(counts > 0))
            for index, (product, (k, n)) in enumerate((("gate_up", (hidden, 2 * width)), ("down", (width, hidden)))):
                kw, kx = jax.random.split(jax.random.fold_in(key, 2 + index))
                rows = timing.normal(kx, (ids.size, k), jnp.bfloat16)
                if mxfp4:
                    quantized = random_mxfp4(kw, num_experts, n, k)
                    weight = jnp.swapaxes(mxfp4_dequantize(*quantized, jnp.bfloat16), -1, -2)  # [E, K, N]
                    expert_bytes = n * k // 2 + n * k // MXFP4_BLOCK
                else:
                    weight = timing.normal(kw, (num_experts, k, n), jnp.bfloat16, scale=0.02)
                    expert_bytes = n * k * 2
                variants = {
                    "xla": lambda x, w, c: jax.lax.ragged_dot(x, w, c, preferred_element_type=jnp.float32
                                                              ).astype(x.dtype),
                    "gemv": lambda x, w, e: _pair_product(x, w, e).astype(x.dtype),
                }
                args_of = {"xla": (rows, weight, counts), "gemv": (rows, weight, sorted_ids)}
                if mxfp4:
                    variants["gemv_mxfp4"] = variants["gemv"]
                    args_of["gemv_mxfp4"] = (rows, quantized, sorted_ids)
                for impl in args.tokamax:
                    variants["tokamax_" + impl] = _tokamax_ragged_dot(tokamax, impl)
                    args_of["tokamax_" + impl] = (rows, weight, counts)
                    if mxfp4 and impl in ("mosaic", "xla"):
                        try:
                            qarray = mxfp4_as_int8_qarray(*quantized)
                        except Exception as e:  # noqa: BLE001  (qwix is tokamax's dependency, not ours)
                            qarray, why = None, f"{type(e).__name__}: {e}"
                        variants[f"tokamax_{impl}_int8"] = (_tokamax_ragged_dot(tokamax, impl) if qarray is not None
                                                            else _unavailable(why))
                        args_of[f"tokamax_{impl}_int8"] = (rows, qarray, counts)
                reference = jax.jit(lambda x, w, e: jnp.take_along_axis(
                    jnp.einsum("pk,ekn->pen", x, w, preferred_element_type=jnp.float32), e[:, None, None], axis=1
                )[:, 0])(rows, weight, sorted_ids)
                nbytes = touched * expert_bytes
                row = dict(kind="experts", family=family, product=product, tokens=tokens, pairs=int(ids.size),
                           touched=touched, k=k, n=n, weight_bytes=nbytes)
                run_case(row, variants, args_of, reference, chain=args.chain, repeats=args.repeats, nbytes=nbytes)
                rows_out.append(row)
                log(f"{family:14s} {product:7s} tokens={tokens:>3} experts={touched:>3} | "
                    f"{cells(row, variants, bandwidth=True)}")
    return rows_out


def _tokamax_ragged_dot(tokamax, impl: str):
    def fn(x, w, counts):
        return tokamax.ragged_dot(x, w, counts, implementation=impl)
    return fn


# -- add + RMSNorm ----------------------------------------------------------------------------------


def norm_cases(args, tokamax) -> list[dict]:
    hidden = args.hidden
    variants = {  # each -> (y, s)
        "ours_xla": lambda h, d, w: add_rms_norm(h, d, w, EPS)[::-1],
    }
    for impl in args.tokamax:
        def tk_norm(h, d, w, impl=impl):
            s = h + d
            return tokamax.layer_norm(s, w, None, epsilon=EPS, subtract_mean=False, implementation=impl), s
        variants["tokamax_" + impl] = tk_norm
    rows_out = []
    for rows in args.norm_rows:
        ks = jax.random.split(jax.random.key(rows), 3)
        h, delta = (timing.normal(k, (rows, hidden), jnp.bfloat16) for k in ks[:2])
        weight = (1 + 0.1 * timing.normal(ks[2], (hidden,), jnp.float32)).astype(jnp.bfloat16)
        reference = add_rms_norm(h, delta, weight, EPS)[1]
        row = dict(kind="norm", rows=rows, hidden=hidden)
        run_case(row, variants, {name: (h, delta, weight) for name in variants}, reference, chain=args.chain,
                 repeats=args.repeats, nbytes=None)
        rows_out.append(row)
        log(f"add+RMSNorm rows={rows:>3} hidden={hidden} | {cells(row, variants, bandwidth=False)}")
    return rows_out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="32768,4096", help="longest first: the budget skips the last")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--modes", default="decode,verify", help="attention patterns of decode,verify,draft")
    ap.add_argument("--tokens", default="1,16", help="tokens of the expert products")
    ap.add_argument("--norm-rows", default="1,16,64")
    ap.add_argument("--hidden", type=int, default=4096, help="add + RMSNorm width")
    ap.add_argument("--tokamax", default="auto", help="tokamax implementations: mosaic, triton, xla ('auto': "
                                                      "mosaic,triton on a GPU, xla elsewhere)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chain", type=int, default=8, help="dependent calls per timed jit")
    ap.add_argument("--budget-s", type=float, default=35.0, help="stop starting attention cases after this")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: attention,experts,norm")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, interpret modes")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    args.contexts, args.batches, args.tokens, args.norm_rows = map(
        ints, (args.contexts, args.batches, args.tokens, args.norm_rows))
    args.modes = [m for m in args.modes.split(",") if m]
    if unknown := set(args.modes) - {"decode", "verify", "draft"}:
        ap.error(f"--modes: unknown {sorted(unknown)} (decode, verify, draft)")
    if args.tokamax == "auto":
        args.tokamax = "mosaic,triton" if jax.default_backend() == "gpu" else "xla"
    args.tokamax = [t for t in args.tokamax.split(",") if t]
    args.attention_shapes, args.expert_families = ATTENTION_SHAPES, EXPERT_FAMILIES
    if args.tiny:
        args.contexts, args.batches, args.tokens, args.norm_rows = [128], [2], [1, 4], [2]
        args.hidden, args.repeats, args.chain = 256, 1, 1
        args.attention_shapes, args.expert_families = (4, 2, 64), TINY_EXPERT_FAMILIES
    skip = set(filter(None, args.skip.split(",")))
    log(timing.device_line())
    result = dict(device=timing.device_line(), hbm_bytes_per_s=timing.HBM_BYTES_PER_S, chain=args.chain,
                  tokamax_implementations=args.tokamax)
    tokamax, why = load_tokamax()
    if tokamax is None:
        log(f"tokamax is not importable here ({why}): nothing to compare; install its wheels "
            "(docs/performance.md, 'Tokamax')")
        result["tokamax"] = None
        result["tokamax_error"] = why
        timing.write_json(args.json, result)
        return
    result["tokamax"] = tokamax.__version__
    log(f"tokamax {tokamax.__version__}, implementations {','.join(args.tokamax)}; outputs held to the reference "
        f"within {TOLERANCE} before timing; us per call (chains of {args.chain})")
    t0 = time.time()
    if "attention" not in skip:
        hq, hkv, d = args.attention_shapes
        log(f"== attention over a KV cache, {hq}q/{hkv}kv heads of {d}, bf16: us, % of "
            f"{timing.HBM_BYTES_PER_S / 1e12:.1f} TB/s ==")
        result["attention"] = attention_cases(args, tokamax)
    if "experts" not in skip:
        log("== grouped expert products, bf16 activations: us, % of the touched experts' bytes at the roofline ==")
        result["experts"] = expert_cases(args, tokamax)
    if "norm" not in skip:
        log("== add + RMSNorm, bf16: us per call ==")
        result["norm"] = norm_cases(args, tokamax)
    result["wall_s"] = time.time() - t0
    log(f"total {result['wall_s']:.0f} s")
    timing.write_json(args.json, result)


if __name__ == "__main__":
    main()
