"""The routed experts' products in Pallas's Mosaic GPU lowering: each touched expert's weights streamed
once, with TMA, for the few rows a decode or verify step routes to it (README.md beside this file).

``expert_products(rows, weight, experts, counts)`` computes ``reference.expert_products_reference``:
group ``g``'s ``S`` row slots ``rows[g] [S, K]`` times expert ``experts[g]``'s ``weight [E, K, N]``,
float32 ``[G, S, N]``; a group of ``counts[g] == 0`` reads nothing and gives zeros.
``mxfp4_expert_products`` is the same for MXFP4 experts (codes and scales decoded in the kernel).
``dflash_jax.ops.experts`` groups a step's (token, expert) pairs by expert, runs the gate-up
projection through it, the activation in XLA, and the down projection through it again.

Bandwidth is the cost of such a step (one token touches ``top_k`` experts of megabytes each and
multiplies each by one row), so the kernel is built to stream exactly the touched experts' bytes:

- **Grid ``(splits, N / 64, G)``**, one warpgroup per program: a 64-column tile of one group's
  expert over ``1 / splits`` of the inputs. The expert id is read in the kernel and addresses the
  weight tiles, so only touched experts are read and nothing is gathered first. The split count
  (``plan``) fills one wave of as many programs an SM as shared memory holds, so that every SM has
  several programs' loads in flight; the float32 partials of the splits are summed by the XLA fusion
  that reads them (the activation, or the routing weights' combination).
- **TMA pipeline:** ``plgpu.emit_pipeline`` copies each ``[block_k, 64]`` weight tile and the
  group's ``[S, block_k]`` rows into a ring of ``stages`` shared-memory slots, so ``stages`` tiles
  per program are in flight while the warpgroup multiplies the oldest.
- **Swapped operands on the tensor cores:** ``acc [64, S] += W_tile^T [64, block_k] @ rows^T
  [block_k, S]`` (``wgmma`` with both operands transposed in shared memory): the weight columns fill
  the instruction's M of 64 and the few rows its N (8 to 64), so a decode token does 8x the products
  it needs -- far less work than the time its bytes take to arrive -- where rows as M would pad one
  token to 64. Float32 accumulation.
- **MXFP4:** each step's ``[64, 32]``-byte code tile is decoded by the warpgroup into two bf16
  operands (low and high nibbles, each times its row's power-of-two scale) in shared memory, against
  the rows' even and odd inputs.
- **Output** ``[splits, G, N, S]`` float32, written with TMA; the sum over splits and the transpose
  fuse into the XLA that follows.

16-bit floats only (``wgmma`` takes float32 as TF32). Mosaic GPU compiles for Hopper and later
(sm_90a); on the CPU the kernel runs in Mosaic GPU's interpret mode (jax >= 0.11) and lowers for CUDA
(``tests/kernels/test_experts_mosaic_gpu.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas._mosaic import interpret_params
from kernels_pallas.block_attention.gpu import GpuConfig, num_sms
from kernels_pallas.experts.reference import MXFP4_BLOCK

TILE_N = 64  # weight columns of a program: the M of one warpgroup's wgmma
SLOT_ALIGN = 8  # a group's row slots: the N of a wgmma, a multiple of 8
MAX_SLOTS = 64  # more rows per expert than this: grouped matmuls (ragged_dot) are the better tool
SWIZZLE = 128  # bytes: 64 16-bit elements per swizzle row
SWIZZLE_ELEMS = SWIZZLE // 2
SMEM_PER_SM = 228 * 1024  # Hopper; each resident program also reserves 1 KB
MAX_PROGRAMS_PER_SM = 8
FP4_STEP = 64  # MXFP4 inputs per pipeline step: a [64, 32]-byte code tile, two scale groups
FP4_HALF = FP4_STEP // 2  # the step's even inputs, then its odd ones: 64-byte swizzle rows
WGMMA = plgpu.Layout.WGMMA


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Tiles of the Mosaic GPU expert products. ``block_k``: inputs per TMA tile of float experts (64,
    128 or 256; 64 where the inputs are no multiple of it: gpt-oss's 2,880). ``stages``: tiles in
    flight per program; ``fp4_stages`` for MXFP4 experts, whose steps carry 2 KB of codes against a
    float step's 16 KB. ``num_sms``: the GPU's SMs (None: read off the device, else 132, an H200's).
    ``splits``: a fixed split of the inputs (None: ``plan``)."""

    block_k: int = 128
    stages: int = 4
    fp4_stages: int = 8
    num_sms: int | None = None
    splits: int | None = None

    def __post_init__(self):
        if self.block_k not in (64, 128, 256):  # a TMA box holds at most 256 rows
            raise ValueError(f"MosaicConfig.block_k must be 64, 128 or 256, got {self.block_k}")
        if self.stages < 2 or self.fp4_stages < 2:
            raise ValueError(f"MosaicConfig stages must be >= 2, got {self.stages} / {self.fp4_stages}")
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"MosaicConfig.splits must be >= 1, got {self.splits}")


DEFAULT_CONFIG = MosaicConfig()


def slots_for(tokens: int) -> int:
    """Row slots of a group for a step of ``tokens`` tokens: a token routes to an expert at most once,
    so an expert holds at most ``tokens`` rows; rounded up to the wgmma's multiple of 8."""
    return -(-tokens // SLOT_ALIGN) * SLOT_ALIGN


def _fits(inputs: int, outputs: int, tokens: int, dtype, step: int) -> bool:
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and inputs % step == 0 and inputs > 0 and outputs % TILE_N == 0 and outputs > 0
            and 0 < tokens <= MAX_SLOTS)


def supports(inputs: int, outputs: int, tokens: int, dtype) -> bool:
    """Whether the kernel takes ``weight [E, inputs, outputs]`` of ``dtype`` for ``tokens`` tokens:
    16-bit floats, whole 64-input tiles, whole 64-column output tiles, at most 64 tokens."""
    return _fits(inputs, outputs, tokens, dtype, SWIZZLE_ELEMS)


def mxfp4_supports(inputs: int, outputs: int, tokens: int, dtype) -> bool:
    """Whether the kernel takes MXFP4 experts of ``inputs`` x ``outputs`` for ``tokens`` tokens in
    ``dtype``: 16-bit floats, whole 64-input steps, whole 64-column tiles, at most 64 tokens."""
    return _fits(inputs, outputs, tokens, dtype, FP4_STEP)


def _check_groups(rows: jax.Array, experts: jax.Array, counts: jax.Array, outputs: int, *, mxfp4: bool):
    groups, slots, inputs = rows.shape
    if experts.shape != (groups,) or counts.shape != (groups,):
        raise ValueError(f"experts {experts.shape} and counts {counts.shape} must be [{groups}]")
    fits = (mxfp4_supports if mxfp4 else supports)(inputs, outputs, slots, rows.dtype)
    if slots % SLOT_ALIGN or not fits:
        raise ValueError(f"the Mosaic GPU expert products do not take {slots} row slots of {inputs} inputs, {outputs} "
                         f"{'MXFP4 ' if mxfp4 else ''}outputs in {rows.dtype} (see mosaic_gpu.supports)")


def _summed(partials: jax.Array) -> jax.Array:
    """Float32 partials ``[splits, G, N, S]`` -> products ``[G, S, N]`` (one XLA fusion)."""
    return jnp.swapaxes(jnp.sum(partials, axis=0), 1, 2)


def block_k_for(inputs: int, cfg: MosaicConfig = DEFAULT_CONFIG) -> int:
    """The input tile: ``cfg.block_k``, or 64 where ``inputs`` is no multiple of it."""
    return cfg.block_k if inputs % cfg.block_k == 0 else SWIZZLE_ELEMS


def smem_bytes(slots: int, inputs: int, cfg: MosaicConfig = DEFAULT_CONFIG, *, mxfp4: bool = False) -> int:
    """Shared memory of one program: its ring of input tiles, the decoded MXFP4 tiles, the output."""
    out = TILE_N * slots * 4
    if mxfp4:
        step = TILE_N * FP4_HALF + (FP4_STEP // MXFP4_BLOCK) * TILE_N + 2 * slots * FP4_HALF * 2
        return cfg.fp4_stages * step + 2 * TILE_N * FP4_HALF * 2 + out
    block_k = block_k_for(inputs, cfg)
    return cfg.stages * (block_k * TILE_N + slots * block_k) * 2 + out


def plan(groups: int, inputs: int, outputs: int, slots: int, cfg: MosaicConfig = DEFAULT_CONFIG, *,
         mxfp4: bool = False) -> int:
    """The split of the inputs: as many splits (at most the input tiles) as fit the programs into one
    wave of as many programs an SM as its shared memory holds (``SMEM_PER_SM``), so that every SM
    streams with several programs' loads in flight and no second wave leaves most SMs idle. Grids of
    a wave or more run unsplit."""
    tiles = inputs // (FP4_STEP if mxfp4 else block_k_for(inputs, cfg))
    if cfg.splits is not None:
        return min(cfg.splits, tiles)
    per_sm = max(1, min(MAX_PROGRAMS_PER_SM, SMEM_PER_SM // (smem_bytes(slots, inputs, cfg, mxfp4=mxfp4) + 1024)))
    programs = groups * (outputs // TILE_N)
    return max(1, min(num_sms(GpuConfig(num_sms=cfg.num_sms)) * per_sm // programs, tiles))


def _program(experts_gmem, counts_gmem, out_gmem, multiply, *, steps: int, steps_per_split: int, slots: int):
    """What every program does around its product: column tile ``n`` of group ``g``'s expert over
    input split ``j``; ``multiply(acc_ref, expert, g, n, first, count)`` accumulates the ``count``
    input steps from ``first`` into the float32 ``[64, S]`` accumulator, which goes to ``out_gmem
    [splits, G, N, S]`` by TMA."""
    j = lax.axis_index("splits")
    n = lax.axis_index("tiles")
    g = lax.axis_index("groups")
    first = j * steps_per_split
    # The last split may hold fewer steps; an unused group reads no weights (its output tile is zeros).
    count = jnp.where(counts_gmem[g] > 0, jnp.minimum(jnp.int32(steps_per_split), steps - first), jnp.int32(0))

    def accumulate(acc_ref):
        multiply(acc_ref, experts_gmem[g], g, n, first, count)
        return acc_ref[...]

    acc = pl.run_scoped(accumulate, plgpu.ACC((TILE_N, slots), jnp.float32))

    def store(out_smem):
        out_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[j, g, pl.ds(n * TILE_N, TILE_N)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((TILE_N, slots), jnp.float32))


def _kernel(experts_gmem, counts_gmem, rows_gmem, weight_gmem, out_gmem, *, block_k: int, stages: int,
            **program):
    """Float experts. GMEM: experts, counts [G] int32; rows [G, S, K]; weight [E, K, N]; out."""
    transforms = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
    slots = program["slots"]

    def multiply(acc_ref, expert, g, n, first, count):
        def step(_, weight_smem, rows_smem):
            plgpu.wgmma(acc_ref, weight_smem.transpose((1, 0)), rows_smem.transpose((1, 0)))
            plgpu.wgmma_wait(0)  # the slot is refilled once the step returns

        weight_spec = plgpu.BlockSpec((block_k, TILE_N), lambda i: (first + i, n), transforms=transforms)
        rows_spec = plgpu.BlockSpec((slots, block_k), lambda i: (0, first + i), transforms=transforms)
        plgpu.emit_pipeline(step, grid=(count,), in_specs=[weight_spec, rows_spec],
                            max_concurrent_steps=stages)(weight_gmem.at[expert], rows_gmem.at[g])

    _program(experts_gmem, counts_gmem, out_gmem, multiply, **program)


def _split(groups: int, inputs: int, outputs: int, slots: int, step: int, cfg: MosaicConfig, *,
           mxfp4: bool = False) -> tuple[dict, int]:
    """``(program, splits)``: ``_program``'s static arguments (the input steps of ``step`` inputs,
    ``plan``'s split of them with none left empty, the slots) and the split count."""
    steps = inputs // step
    per_split = -(-steps // plan(groups, inputs, outputs, slots, cfg, mxfp4=mxfp4))
    return dict(steps=steps, steps_per_split=per_split, slots=slots), -(-steps // per_split)


def _launch(body, program: dict, splits: int, groups: int, outputs: int, name: str, interpret: bool, *args,
            scratch_types=()):
    """``body`` over the grid ``(splits, N / 64, G)`` -> float32 ``[splits, G, N, S]``."""
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits, groups, outputs, program["slots"]), jnp.float32),
        scratch_types=list(scratch_types),
        grid=(splits, outputs // TILE_N, groups),
        grid_names=("splits", "tiles", "groups"),
        interpret=interpret_params(interpret),
        kernel_name=name,
    )(*args)


def expert_partials(rows: jax.Array, weight: jax.Array, experts: jax.Array, counts: jax.Array, *,
                    config: MosaicConfig | None = None, interpret: bool | None = None) -> jax.Array:
    """The kernel: ``rows [G, S, K]``, ``weight [E, K, N]``, ``experts, counts [G]`` -> float32
    partial products ``[splits, G, N, S]`` (their sum over splits, transposed, is
    ``expert_products``). ``S`` a multiple of 8 up to 64; ``experts`` in range."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _expert_partials(rows, weight, experts, counts, config=config or DEFAULT_CONFIG, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _expert_partials(rows: jax.Array, weight: jax.Array, experts: jax.Array, counts: jax.Array, *,
                     config: MosaicConfig, interpret: bool) -> jax.Array:
    """``expert_partials``, jitted: the layers' identical calls in a program share one trace and one
    lowering of the kernel (a call of one function, which XLA inlines: the same kernels run)."""
    cfg = config
    groups, slots, inputs = rows.shape
    num_experts, w_inputs, outputs = weight.shape
    if w_inputs != inputs or rows.dtype != weight.dtype:
        raise ValueError(f"rows {rows.shape} {rows.dtype} do not match weight {weight.shape} {weight.dtype}")
    _check_groups(rows, experts, counts, outputs, mxfp4=False)
    block_k = block_k_for(inputs, cfg)
    program, splits = _split(groups, inputs, outputs, slots, block_k, cfg)
    body = functools.partial(_kernel, block_k=block_k, stages=cfg.stages, **program)
    return _launch(body, program, splits, groups, outputs, "dflash_expert_products_mgpu", interpret,
                   experts.astype(jnp.int32), counts.astype(jnp.int32), rows, weight)


def expert_products(rows: jax.Array, weight: jax.Array, experts: jax.Array, counts: jax.Array, *,
                    config: MosaicConfig | None = None, interpret: bool | None = None) -> jax.Array:
    """``reference.expert_products_reference``'s contract: float32 ``[G, S, N]``."""
    return _summed(expert_partials(rows, weight, experts, counts, config=config, interpret=interpret))


# -- MXFP4 experts -----------------------------------------------------------------------------------


def _load(ref, layout):
    """``ref``'s whole value in registers of ``layout`` (jax 0.10 takes an index argument, 0.12 none)."""
    index = inspect.signature(plgpu.load).parameters.get("idx")
    if index is not None and index.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _scaled_fp4(codes: jax.Array, shift: int, factor: jax.Array) -> jax.Array:
    """The E2M1 codes in bits ``shift``..``shift + 3`` of ``codes`` (int32) -> their values times
    ``factor`` (float32), in a few full-rate operations a value and no table.

    The code's 2 exponent bits and 1 mantissa bit go to the float's bits 23-24 and 22 under an
    exponent biased to 126: ``x = 2 ** (e - 1) * (1 + m / 2)``, the code's magnitude for ``e >= 1``
    and 0.5 or 0.75 for the codes 0 and 0.5, which ``2 x - 1`` maps there; ``min(2 x - 1, x)`` picks
    the right one for every code (``2 x - 1 >= x`` exactly where ``x >= 1``). No subnormal on the way
    (GPUs and XLA's CPU flush those); the sign bit is or-ed in last."""
    magnitude = (lax.shift_left(codes, jnp.int32(22 - shift)) & jnp.int32(0x7 << 22)) + jnp.int32(126 << 23)
    x = lax.bitcast_convert_type(magnitude, jnp.float32)
    value = jnp.minimum(x * 2.0 - 1.0, x) * factor
    sign = lax.shift_left(codes, jnp.int32(28 - shift)) & jnp.int32(-(1 << 31))
    return lax.bitcast_convert_type(lax.bitcast_convert_type(value, jnp.int32) | sign, jnp.float32)


def _scale_factor(scales_row) -> jax.Array:
    """A ``[64]`` row of scale bytes in shared memory -> ``2 ** (s - 127)`` float32 in the WGMMA
    layout's row vector (byte 0 is the subnormal ``2 ** -127``)."""
    s = _load(scales_row, WGMMA.reduce(1)).astype(jnp.int32)
    bits = jnp.where(s == 0, jnp.int32(1 << 22), lax.shift_left(s, jnp.int32(23)))
    return lax.bitcast_convert_type(bits, jnp.float32)


def _mxfp4_kernel(experts_gmem, counts_gmem, rows_gmem, codes_gmem, scales_gmem, out_gmem, low_smem, high_smem,
                  *, stages: int, **program):
    """MXFP4 experts. GMEM: experts, counts [G] int32; rows [G, S, K] with each step's 64 inputs as its
    32 even ones, then its 32 odd ones; codes [E, N, K / 2] uint8; the groups' scales transposed [G,
    K / 32, N]; out. Scratch: the step's decoded low and high nibbles [64, 32]."""
    swizzled = (plgpu.TilingTransform((8, FP4_HALF)), plgpu.SwizzleTransform(FP4_HALF * 2))
    dtype, slots = low_smem.dtype, program["slots"]

    def multiply(acc_ref, expert, g, n, first, count):
        def step(_, codes_smem, scales_smem, even_smem, odd_smem):
            codes = _load(codes_smem, WGMMA).astype(jnp.int32)  # [64, 32]: byte b holds inputs 2b, 2b + 1
            # Bytes 0-15 of a row are its first scale group, 16-31 its second.
            column = plgpu.broadcasted_iota(jnp.int32, codes.shape, 1, layout=WGMMA)
            factor = jnp.where(column < MXFP4_BLOCK // 2,
                               lax.broadcast_in_dim(_scale_factor(scales_smem.at[0]), codes.shape, [0]),
                               lax.broadcast_in_dim(_scale_factor(scales_smem.at[1]), codes.shape, [0]))
            low_smem[...] = _scaled_fp4(codes, 0, factor).astype(dtype)  # exact: 3-bit mantissas
            high_smem[...] = _scaled_fp4(codes, 4, factor).astype(dtype)
            plgpu.commit_smem()
            plgpu.wgmma(acc_ref, low_smem, even_smem.transpose((1, 0)))
            plgpu.wgmma(acc_ref, high_smem, odd_smem.transpose((1, 0)))
            plgpu.wgmma_wait(0)  # the decoded tiles are rewritten by the next step

        codes_spec = plgpu.BlockSpec((TILE_N, FP4_HALF), lambda i: (n, first + i))
        scales_spec = plgpu.BlockSpec((FP4_STEP // MXFP4_BLOCK, TILE_N), lambda i: (first + i, n))
        even_spec = plgpu.BlockSpec((slots, FP4_HALF), lambda i: (0, 2 * (first + i)), transforms=swizzled)
        odd_spec = plgpu.BlockSpec((slots, FP4_HALF), lambda i: (0, 2 * (first + i) + 1), transforms=swizzled)
        plgpu.emit_pipeline(step, grid=(count,), in_specs=[codes_spec, scales_spec, even_spec, odd_spec],
                            max_concurrent_steps=stages)(
            codes_gmem.at[expert], scales_gmem.at[g], rows_gmem.at[g], rows_gmem.at[g])

    _program(experts_gmem, counts_gmem, out_gmem, multiply, **program)


def mxfp4_expert_partials(rows: jax.Array, blocks: jax.Array, scales: jax.Array, experts: jax.Array,
                          counts: jax.Array, *, config: MosaicConfig | None = None,
                          interpret: bool | None = None) -> jax.Array:
    """``expert_partials`` of MXFP4 experts ``blocks [E, N, K / 32, 16]`` uint8, ``scales [E, N, K /
    32]`` uint8 (outputs first, the checkpoints' layout): float32 ``[splits, G, N, S]``.

    Two small XLA ops come before the kernel: the groups' scales, transposed to ``[G, K / 32, N]`` (a
    row of 2,880 inputs has 90 scale bytes, no row stride TMA can take), and the rows with each
    64-input step's even inputs first (the low nibbles' partners), then its odd ones."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _mxfp4_expert_partials(rows, blocks, scales, experts, counts, config=config or DEFAULT_CONFIG,
                                  interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _mxfp4_expert_partials(rows: jax.Array, blocks: jax.Array, scales: jax.Array, experts: jax.Array,
                           counts: jax.Array, *, config: MosaicConfig, interpret: bool) -> jax.Array:
    """``mxfp4_expert_partials``, jitted, as ``_expert_partials``."""
    cfg = config
    groups, slots, inputs = rows.shape
    num_experts, outputs, scale_groups, half_block = blocks.shape
    if (scale_groups * MXFP4_BLOCK != inputs or half_block * 2 != MXFP4_BLOCK
            or scales.shape != (num_experts, outputs, scale_groups)):
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not take rows {rows.shape}")
    _check_groups(rows, experts, counts, outputs, mxfp4=True)
    program, splits = _split(groups, inputs, outputs, slots, FP4_STEP, cfg, mxfp4=True)
    experts = experts.astype(jnp.int32)
    group_scales = jnp.swapaxes(jnp.take(scales, experts, axis=0), 1, 2)  # [G, K / 32, N]
    interleaved = rows.reshape(groups, slots, inputs // FP4_STEP, FP4_HALF, 2)
    interleaved = jnp.swapaxes(interleaved, -1, -2).reshape(rows.shape)
    swizzled = (plgpu.TilingTransform((8, FP4_HALF)), plgpu.SwizzleTransform(FP4_HALF * 2))
    decoded = plgpu.SMEM((TILE_N, FP4_HALF), rows.dtype, transforms=swizzled)
    body = functools.partial(_mxfp4_kernel, stages=cfg.fp4_stages, **program)
    return _launch(body, program, splits, groups, outputs, "dflash_mxfp4_expert_products_mgpu", interpret,
                   experts, counts.astype(jnp.int32), interleaved, blocks.reshape(num_experts, outputs, inputs // 2),
                   group_scales, scratch_types=[decoded, decoded])


def mxfp4_expert_products(rows: jax.Array, blocks: jax.Array, scales: jax.Array, experts: jax.Array,
                          counts: jax.Array, *, config: MosaicConfig | None = None,
                          interpret: bool | None = None) -> jax.Array:
    """``reference.mxfp4_expert_products_reference``'s contract: float32 ``[G, S, N]``."""
    return _summed(mxfp4_expert_partials(rows, blocks, scales, experts, counts, config=config,
                                         interpret=interpret))
