"""The batched greedy speculative-decoding engine: jitted device phases on a state of row slots.

The phases: ``prefill`` (new prompts, in a batch of their own), ``admit`` (scatters prefilled rows
into free slots of the running state), ``resize`` (moves the live rows into a state of another row
count), ``release`` (ends rows early) and ``decode`` (a loop of ``steps_per_sync``
draft-verify-commit steps that stops early once every row is done, except on a GPU mesh:
``EngineConfig.decode_loop``). The running state is donated to every call that keeps its shape.
``ContinuousBatcher`` (``dflash_jax.runtime.batcher``) is the host loop around them; ``Engine.generate``
runs it.
Shapes are static: prompt counts and lengths are bucketed, a running state has one or
``max_batch_size`` rows; block size and capacity are fixed per engine; with the XLA attention each
decode call reads a power-of-two window of the caches that covers its rows.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dflash_jax.runtime import decoding, paged
from dflash_jax.runtime import sampling as smp
from dflash_jax.runtime.sampling import SamplingFlags, SamplingParams
from dflash_jax.ops.config import EXPERT_IMPLEMENTATIONS, OpsConfig, parse_tiles, resolve_attention_impl
from dflash_jax.ops.linear import bfloat16_matrix_units, weight_major_gemms
from dflash_jax.runtime.serving_params import in_serving_layout, serving_drafter, serving_target
from dflash_jax.runtime.batcher import (ContinuousBatcher, Generation, GenerationResult, RowSnapshot, StopCheck,
                                        stop_checks_per_prompt)
from dflash_jax.ops.cache import CACHE_ALIGNMENT, CACHE_AXES
from dflash_jax.ops.paged_cache import PAGE_TABLE_AXES, POOL_AXES, PagedKV
from dflash_jax.runtime.compile_cache import check_setting as check_cache_setting, use_compilation_cache
from dflash_jax.io.config import check_field_types
from dflash_jax.models.config import pair_mismatch
from dflash_jax.models.drafter import Drafter
from dflash_jax.sharding import MeshConfig, make_mesh, named_sharding, shard_module, with_kernel_mesh
from dflash_jax.models.hybrid import HybridTarget
from dflash_jax.models.target import Target

log = logging.getLogger("dflash_jax.runtime.engine")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static shapes and scheduling of an engine (a section of serve/train YAML configs)."""

    max_batch_size: int = 8
    max_length: int = 2048           # prompt + generated tokens, per row
    prompt_buckets: tuple[int, ...] | None = None  # None: powers of two from 16
    # None: the drafter's; may only lower it. With adaptive speculation the engine's block (what its caches and
    # attention windows are sized for, and a decode call without a block runs) is the largest of it and
    # ``speculation_blocks`` (``largest_block``).
    block_size: int | None = None
    attention_impl: str = "auto"     # "xla" | "pallas" | "auto": pallas on GPUs/TPUs, else xla
    steps_per_sync: int = 8          # decode steps per device call between host syncs
    # None: every call runs steps_per_sync steps. Else the host loop doubles a call's steps, up to
    # this, while the device finishes each call before the host dispatches the next (a small model's
    # server, its host busy streaming), and halves them back once the host is well ahead
    # (``ContinuousBatcher._adapt_steps``). Ignored with a fixed decode loop (a program per step count).
    max_steps_per_sync: int | None = None
    # "until_done": a decode call stops early once every row is done (XLA evaluates the loop's
    # condition after each step); "fixed": it always runs its steps (a known trip count, which XLA
    # runs without reading a condition, so the call returns to the host at once); "auto": fixed on
    # a GPU mesh, where the condition is read on the host (docs/design.md), else until_done.
    decode_loop: str = "auto"
    mesh: MeshConfig | None = None   # None: a single device
    # "auto": "highest" for float32 weights, else "default". GPUs and TPUs run default-precision
    # float32 matmuls through TF32 / bf16 passes, whose rounding differs between a 1-token and a
    # 16-token pass enough to flip near-tied greedy choices; "highest" keeps float32 models exact.
    matmul_precision: str = "auto"
    # Overrides of the cached-attention kernel's tiles, "field=N,..." of
    # ``kernels_pallas.cached_attention.gpu.GpuConfig`` (e.g. "min_chunk=128,block_k=32"); "": its defaults.
    cached_attention_tiles: str = ""
    # The GPU kernels' Pallas lowering (``OpsConfig.gpu_lowering``): "triton", or "mosaic" (the ops
    # with a Mosaic GPU kernel run it; the others keep Triton).
    gpu_lowering: str = "triton"
    # A mixture of experts' routed experts: "auto", "gemv", "ragged_dot" or "capacity" (``OpsConfig.experts``).
    experts_impl: str = "auto"
    # A directory for the persistent compilation cache (``dflash_jax.runtime.compile_cache``): the engine's
    # programs are saved there and loaded by the next process instead of compiled again. Process-wide.
    # On the H200 it cut an 8B engine's warm-up ~3x, and decode steps ran 2-3% slower in the processes
    # that reused it (docs/performance.md). None: compile in every process.
    compilation_cache_dir: str | None = None
    # The most top logprobs a request may ask per token (OpenAI's limit is 20): the width of the
    # state's logprob buffers.
    max_logprobs: int = 20
    # top-k / top-p are read from this many largest logits of a row when that is exact, else from a
    # search of the whole row (``sampling.filter_thresholds``).
    sampling_candidates: int = 64
    # Paged caches (``dflash_jax.runtime.paged``): 0 keeps a contiguous cache of ``max_length`` positions
    # per row slot; else the positions per page (a power of two <= 128), every row's K/V (target and
    # drafter context) in pages of one pool, admitted by free pages, getting more as they decode (the newest
    # rows preempted and resumed when the pool runs dry), with prefix caching.
    page_size: int = 0
    # The pool's pages (one more, the null page, is added): None sizes it by ``kv_memory_fraction``, or
    # when that is None too, to what the contiguous caches of ``max_batch_size`` rows would take.
    num_pages: int | None = None
    # The fraction of the device's free memory (after the weights) the pools may take.
    kv_memory_fraction: float | None = None
    # Reuse the cached K/V of a new prompt's longest cached prefix (full pages; paged engines only).
    prefix_cache: bool = True
    # Paged engines: a prompt with more uncached tokens than this is prefilled this many at a time, one
    # chunk per host sync between the running rows' decode calls (0: whole prompts). A multiple of page_size.
    prefill_chunk: int = 0
    # Paged engines: a request paused this many times for pages resumes with pages for its whole length
    # and is not paused again (0: every request gets its whole length at admission, none is paused).
    max_preemptions: int = 2
    # "fixed": every decode call drafts blocks of ``block_size``; "adaptive": each call picks the block
    # size among ``speculation_blocks``, or a target-only step, with the most expected tokens per
    # second for its live rows (``runtime.speculation``: measured step costs, each row's acceptance).
    speculation: str = "fixed"
    # The adaptive block sizes (target-only, 1, is always an option), at most the drafter's block; None: the
    # block size, its half and its quarter, those >= 2. Each is one more decode program per row count and window.
    speculation_blocks: tuple[int, ...] | None = None
    # The drafter attends to each row's last this many context positions only (0: all of them), which
    # bounds the draft pass at long contexts (``decoding.context_window_view``); multiples of 128 keep
    # the attention kernels' whole key tiles.
    drafter_context_window: int = 0
    # GPUs: run the one-shot programs (prefill, first-token draw, admission, resize, release, empty state)
    # as CUDA graphs. A graph is recorded again whenever a call's buffers sit elsewhere than the last
    # call's, so it pays where launching the program's kernels one by one outlasts running them (a small
    # model) and loses where the kernels hide their launches (a large one). None: on for a target of fewer
    # than ``ONE_SHOT_GRAPH_MAX_PARAMS`` parameters (docs/performance.md, "The embedded pair").
    one_shot_graphs: bool | None = None
    # CPUs: the weights whose float32 values are all bfloat16 values (a bfloat16 checkpoint served in float32)
    # kept in bfloat16, each float32 row multiplied by them as three exact bfloat16 products: float32 results
    # (up to the summation order, as another GEMM's), half the bytes, and the CPU's bfloat16 GEMMs
    # (``runtime.serving_params``). None: on where the CPU has bfloat16 matrix units (AMX-BF16), where the
    # embedded pair's block-16 DFlash step ran 1.4x faster, its target-only step 1.07x and a 96-token prefill
    # 1.3x (docs/performance.md, "The embedded pair").
    cpu_bfloat16_weights: bool | None = None

    def validate(self) -> None:
        check_field_types(self)  # a config built in Python skips the YAML loader's checks
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.attention_impl not in ("xla", "pallas", "auto"):
            raise ValueError(f"attention_impl must be 'xla', 'pallas' or 'auto', got {self.attention_impl!r}")
        if self.matmul_precision not in ("auto", "default", "high", "highest"):
            raise ValueError("matmul_precision must be 'auto', 'default', 'high' or 'highest', "
                             f"got {self.matmul_precision!r}")
        parse_tiles(self.cached_attention_tiles)
        if self.gpu_lowering not in ("triton", "mosaic"):
            raise ValueError(f"gpu_lowering must be 'triton' or 'mosaic', got {self.gpu_lowering!r}")
        if self.experts_impl not in EXPERT_IMPLEMENTATIONS:
            raise ValueError(f"experts_impl must be one of {EXPERT_IMPLEMENTATIONS}, got {self.experts_impl!r}")
        if self.steps_per_sync < 1:
            raise ValueError(f"steps_per_sync must be >= 1, got {self.steps_per_sync}")
        if self.max_steps_per_sync is not None and self.max_steps_per_sync < self.steps_per_sync:
            raise ValueError(f"max_steps_per_sync ({self.max_steps_per_sync}) must be >= steps_per_sync "
                             f"({self.steps_per_sync}), or null")
        if self.decode_loop not in ("until_done", "fixed", "auto"):
            raise ValueError(f"decode_loop must be 'until_done', 'fixed' or 'auto', got {self.decode_loop!r}")
        check_cache_setting(self.compilation_cache_dir)
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.sampling_candidates < 1:
            raise ValueError(f"sampling_candidates must be >= 1, got {self.sampling_candidates}")
        if self.drafter_context_window < 0:
            raise ValueError(f"drafter_context_window must be >= 0 (0: the whole context), got "
                             f"{self.drafter_context_window}")
        if self.speculation not in ("fixed", "adaptive"):
            raise ValueError(f"speculation must be 'fixed' or 'adaptive', got {self.speculation!r}")
        if self.speculation_blocks is not None and (not self.speculation_blocks or min(self.speculation_blocks) < 2):
            raise ValueError(f"speculation_blocks must be block sizes >= 2, got {self.speculation_blocks}")
        if self.prompt_buckets is not None and (not self.prompt_buckets or min(self.prompt_buckets) < 1):
            raise ValueError(f"prompt_buckets must be positive lengths, got {self.prompt_buckets}")
        if self.page_size < 0 or self.page_size > 128 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be 0 (contiguous caches) or a power of two <= 128, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction < 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1), got {self.kv_memory_fraction}")
        if self.num_pages is not None and self.kv_memory_fraction is not None:
            raise ValueError("set num_pages or kv_memory_fraction, not both")
        if self.max_preemptions < 0:
            raise ValueError(f"max_preemptions must be >= 0, got {self.max_preemptions}")
        if self.prefill_chunk < 0 or self.prefill_chunk and (not self.page_size or self.prefill_chunk % self.page_size):
            raise ValueError(f"prefill_chunk must be 0 or a multiple of a paged engine's page_size ({self.page_size}), "
                             f"got {self.prefill_chunk}")

    def largest_block(self, drafter_block: int) -> int:
        """The largest block an engine of this config drafts with a drafter of ``drafter_block`` slots:
        ``block_size`` (None: the drafter's) and, with adaptive speculation, ``speculation_blocks``."""
        block = self.block_size or drafter_block
        if self.speculation == "adaptive" and self.speculation_blocks:
            return max(block, *self.speculation_blocks)
        return block

    def drafter_block_error(self, drafter_block: int) -> str | None:
        """Why this config's blocks do not fit a drafter of ``drafter_block`` slots (None if they do): a
        drafter drafts at most its own block, so ``block_size`` and, with adaptive speculation, every one of
        ``speculation_blocks`` must be at most that."""
        if self.block_size is not None and self.block_size > drafter_block:
            return f"block_size {self.block_size} exceeds the drafter's block size {drafter_block}"
        largest = self.largest_block(drafter_block)
        if largest > drafter_block:
            return (f"speculation_blocks {self.speculation_blocks}: block {largest} exceeds the drafter's block "
                    f"size {drafter_block}")
        return None

    @property
    def max_prompt_length(self) -> int:
        """The longest prompt an engine admits: room for one generated token, within the largest
        prompt bucket."""
        longest = self.max_length - 1
        return longest if self.prompt_buckets is None else min(longest, max(self.prompt_buckets))

    def prompt_bucket_error(self, n: int) -> str | None:
        """Why a prompt of ``n`` tokens, shorter than ``max_length``, fits none of ``prompt_buckets`` (None
        if one fits). Checked when a prompt is submitted, after ``max_length``: its prefill would fail,
        and with it every prompt prefilled in its batch."""
        if self.max_prompt_length < n < self.max_length:  # only the buckets end prompts before max_length - 1
            return f"more than the largest prompt bucket, {self.max_prompt_length}"
        return None


@dataclasses.dataclass(frozen=True)
class PagedAdmission:
    """What a paged engine's admission writes beside the prefilled rows: their page tables ``[rows,
    max_pages]`` and the first position each row computed (its cached prefix's length) ``[rows]``."""

    page_rows: jax.Array
    cache_from: jax.Array


def _serving_layout(config: EngineConfig, mesh: Mesh | None) -> dict:
    """``serving_params``' choices for an engine of ``config`` on ``mesh``: weights stored input-last where a
    verify block's and a prompt's GEMMs prefer them (XLA:CPU), and there those of bfloat16 values in bfloat16
    (``EngineConfig.cpu_bfloat16_weights``), query heads padded for the attention kernel where it runs
    (``ops.attention.fused_query_groups``). A mesh keeps the layout its sharding rules were written for."""
    if mesh is not None and mesh.size > 1:
        return dict(input_last=False, attention_impl="xla")
    input_last = weight_major_gemms()
    wanted = config.cpu_bfloat16_weights
    bfloat16_weights = input_last and (bfloat16_matrix_units() if wanted is None else wanted)
    return dict(input_last=input_last, bfloat16_weights=bfloat16_weights,
                attention_impl=resolve_attention_impl(config.attention_impl))


def _check_checkpoint_layout(module, name: str, where: str, other: str = "") -> None:
    """A module in the serving layout (an engine's copy) passed where one in its checkpoint layout is taken
    is an error naming it; ``other``: what else ``where`` takes."""
    if module is not None and in_serving_layout(module):
        raise ValueError(f"the {name} passed to {where} is in the serving layout (an engine's engine.{name}); "
                         f"pass the module in its checkpoint layout{other}")


def _check_types(target, drafter, config) -> None:
    """The arguments of ``Engine`` of another kind (a drafter as the target, a dict as the config) are errors
    naming them, not an ``AttributeError`` deep in the build."""
    if not isinstance(config, EngineConfig):
        raise TypeError(f"Engine: config must be an EngineConfig, got {type(config).__name__}")
    if not isinstance(target, (Target, HybridTarget)):
        hint = " (a drafter: pass it second, after the target)" if isinstance(target, Drafter) else ""
        raise TypeError(f"Engine: target must be a target model (dflash_jax.load_target), got "
                        f"{type(target).__name__}{hint}")
    if drafter is not None and not isinstance(drafter, Drafter):
        hint = " (a target: pass it first)" if isinstance(drafter, (Target, HybridTarget)) else ""
        raise TypeError(f"Engine: drafter must be a drafter (dflash_jax.load_drafter) or None, got "
                        f"{type(drafter).__name__}{hint}")


def _check_pair(target: Target, drafter: Drafter | None, config: EngineConfig) -> None:
    """A ``max_length`` past the target's positions, a drafter that does not fit ``target`` (vocabulary, hidden
    size, tapped layer count) or whose block ``config`` cannot run is an error."""
    positions = target.config.max_position_embeddings
    if config.max_length > positions:  # the caches would be sized (and the positions rotated) past the model's
        raise ValueError(f"EngineConfig.max_length {config.max_length} exceeds the target's max_position_embeddings "
                         f"{positions} (its config.json)")
    if drafter is None:
        return
    if (mismatch := pair_mismatch(drafter.config, target.config)) is not None:
        raise ValueError("drafter {} {} != target {} {}".format(*mismatch))
    if (error := config.drafter_block_error(drafter.config.block_size)) is not None:
        raise ValueError(error)


def _speculation_blocks(config: EngineConfig, block_size: int, drafter: Drafter | None) -> tuple[int, ...]:
    """The block sizes an engine's decode calls may run, largest first, 1 (target-only) last: the
    engine's block alone with fixed speculation; else ``speculation_blocks`` (default: the block, its
    half and its quarter, down to 2), ``block_size``, the engine's block (their largest,
    ``EngineConfig.largest_block``) and 1."""
    if drafter is None:
        return (1,)
    if config.speculation == "fixed":
        return (block_size,)
    blocks = config.speculation_blocks or tuple(b for b in (block_size, block_size // 2, block_size // 4) if b >= 2)
    kernel = getattr(drafter.config, "conv_kernel_size", 1)  # a DFlash2 drafter's convolutions span its block
    if min(blocks) < kernel:
        raise ValueError(f"speculation_blocks {blocks}: a block is shorter than the drafter's conv_kernel_size {kernel}")
    blocks = set(blocks) | {block_size} | ({config.block_size} if config.block_size else set())
    return tuple(sorted(blocks, reverse=True)) + (1,)


def shared_prompts(prompts: Sequence[Sequence[int]], cached: Sequence[int] | None = None) -> list[int] | None:
    """For each prompt, the index of the prompt whose prefill it shares: the first of the equal prompts
    with the fewest ``cached`` tokens (itself if it is that one). None when the prompts are distinct."""
    leader: dict[tuple[int, ...], int] = {}
    for i, p in enumerate(prompts):
        key = tuple(p)
        if key not in leader or (cached is not None and cached[i] < cached[leader[key]]):
            leader[key] = i
    if len(leader) == len(prompts):
        return None
    return [leader[tuple(p)] for p in prompts]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# What XLA:GPU puts in command buffers (CUDA graphs) by default; the decode loop adds its while loop.
GPU_DEFAULT_COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
_GPU_DECODE_COMMAND_BUFFER = GPU_DEFAULT_COMMAND_BUFFER + ",WHILE,CONDITIONAL"


def _decode_compiler_options() -> dict | None:
    """XLA options for the decode loop on this backend.

    XLA:CPU's default copy insertion copies every target-cache buffer twice per decode step (the
    while-loop carry is read by attention and updated in place within one step), which costs more
    than a small model's attention itself; its region analysis proves the in-place update safe and
    removes the copies.

    On GPUs the decode loop's ``while`` goes into the CUDA graph (a conditional node). Outside it,
    XLA evaluates the loop condition on the host, one device-to-host copy per step, so a decode call
    ran synchronously in the thread that dispatched it and the device idled between calls while the
    host read the last call's tokens and dispatched the next: 0.27 ms per DFlash step and 0.70 ms per
    target-only step at 8 steps per sync, none with the loop in the graph (docs/performance.md). On a
    mesh the loop stays on the host: XLA 0.11.2 runs every all-reduce as a ``CollectiveKernelThunk``,
    which no command-buffer option converts, so each all-reduce cuts the step's graph and the
    ``while`` around them cannot be a graph node (``COLLECTIVES`` in this list changed nothing there,
    so it is left out).

    The graph's kernels are ordered by data flow (``CONCURRENT``) rather than chained in XLA's
    schedule (``LHS``, the default), so independent kernels of a step run side by side: in a DFlash
    step the drafter's context K/V of the committed tokens, layer beside layer and beside the next
    draft's first kernels. -0.04 ms per batch-1 DFlash step (0.8%, every round), no change
    target-only (docs/performance.md).
    """
    if jax.default_backend() == "cpu":
        return {"xla_cpu_copy_insertion_use_region_analysis": True}
    if jax.default_backend() == "gpu":
        return {"xla_gpu_enable_command_buffer": _GPU_DECODE_COMMAND_BUFFER,
                "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    return None


# A target below this many parameters runs its one-shot programs as CUDA graphs by default
# (``EngineConfig.one_shot_graphs``).
ONE_SHOT_GRAPH_MAX_PARAMS = 1_000_000_000


def _one_shot_compiler_options(graphs: bool) -> dict | None:
    """XLA options for the phases that run once per admission (prefill, admit, resize, release,
    empty state); ``graphs``: as CUDA graphs on a GPU (``EngineConfig.one_shot_graphs``).

    On GPUs XLA runs a jitted function's kernels as CUDA graphs (command buffers), recorded and
    instantiated again whenever the function's buffers move. The decode loop keeps its buffers
    (donated state) and reuses its graphs. A prefill gets fresh buffers every call, which land where
    the last call's did when requests come one at a time (the allocator reuses the freed blocks) and
    elsewhere when other requests' buffers come and go between them. For an 8B target re-recording
    took ~25 ms per prefill on the H200, longer than the 512-token prefill itself, whose large matmuls
    hide the launches of kernels sent one by one. For the 13.5M-parameter embedded pair the launches
    are the prefill: on an H100 its 48-token prefill took 4.9 ms one by one (3.5 ms of it the host's
    dispatch) and 1.8 ms as a graph, and the admission 1.35 and 0.47 ms (docs/performance.md).

    On the CPU, as for the decode loop: a paged prefill over a cached prefix reads the pools and then
    updates them in place, and without its region analysis XLA:CPU's copy insertion copies every pool.
    """
    if jax.default_backend() == "cpu":
        return {"xla_cpu_copy_insertion_use_region_analysis": True}
    if jax.default_backend() == "gpu" and not graphs:
        return {"xla_gpu_enable_command_buffer": ""}
    return None


MIN_WINDOW = 64  # the smallest attention window a decode call compiles for


def window_buckets(capacity: int) -> tuple[int, ...]:
    """The attention windows of an engine with ``capacity`` cache positions: powers of two from
    ``MIN_WINDOW`` up to half the capacity, then the capacity itself (at most log2(capacity / 64) + 1
    compiled decode variants per batch size).

    A window is a copy of that prefix of the caches (the step writes its block into it, then back),
    so it pays where it skips at least half the capacity, on a memory-bound accelerator too.
    """
    small = [w for w in (MIN_WINDOW << i for i in range(capacity.bit_length())) if 2 * w <= capacity]
    return tuple(small) + (capacity,)


class Engine:
    """Batched generation (greedy, or sampled per ``SamplingParams``) with an optional DFlash drafter
    (``drafter=None``: target-only)."""

    records_prompt_logprobs = True  # the prefill records ``SamplingParams.prompt_logprobs`` (completions' echo)

    def __init__(self, target: Target, drafter: Drafter | None, config: EngineConfig = EngineConfig(),
                 mesh: Mesh | None = None):
        """``target`` and ``drafter`` in their checkpoint layout: the engine runs copies in the serving
        layout (``serving_params``), sharded on ``mesh`` (default: ``config.mesh``'s), and never changes
        them. Drop yours once the engine is built: the copies hold the weights (``derive`` builds
        further engines on the same copies)."""
        _check_types(target, drafter, config)
        config.validate()
        _check_checkpoint_layout(target, "target", "Engine")
        _check_checkpoint_layout(drafter, "drafter", "Engine")
        _check_pair(target, drafter, config)
        mesh = mesh if mesh is not None else (make_mesh(config.mesh) if config.mesh is not None else None)
        if mesh is not None and isinstance(target, HybridTarget):
            raise ValueError("a hybrid linear-attention target (models.hybrid) runs on one device: no mesh")
        rules = config.mesh.resolved_rules() if config.mesh is not None else None
        layout = _serving_layout(config, mesh)
        target = serving_target(target, **layout)
        drafter = serving_drafter(drafter, **layout) if drafter is not None else None
        if mesh is not None:
            shard_module(target, mesh, rules)
            if drafter is not None:
                shard_module(drafter, mesh, rules)
        self._build(target, drafter, config, mesh, rules)

    def derive(self, config: EngineConfig | None = None, *, drafter: Drafter | None | str = "same") -> "Engine":
        """Another engine on this one's copy of the target (its weights are not copied again): with
        ``config`` (default: this engine's; its mesh settings must be this engine's) and ``drafter``
        (``"same"``: this engine's copy; None: target-only; a module in its checkpoint layout: a copy of
        it in the serving layout). Engines of several configurations over one target (target-only beside
        speculative, several block sizes) then hold its weights once."""
        config = self.config if config is None else config
        config.validate()
        if config.mesh != self.config.mesh:
            raise ValueError("Engine.derive: config.mesh differs from this engine's; build a new Engine for "
                             "another mesh")
        if config.cpu_bfloat16_weights != self.config.cpu_bfloat16_weights:
            raise ValueError("Engine.derive: config.cpu_bfloat16_weights differs from this engine's (the target's "
                             "weights are stored as this engine's says); build a new Engine for another setting")
        if isinstance(drafter, str):
            if drafter != "same":
                raise ValueError(f"Engine.derive: drafter must be 'same', None or a Drafter, got {drafter!r}")
            served = self.drafter
        elif drafter is None:
            served = None
        else:
            _check_checkpoint_layout(drafter, "drafter", "Engine.derive", other=", or 'same'")
            served = drafter
        _check_pair(self.target, served, config)
        if served is not None and served is not self.drafter:
            served = serving_drafter(served, **_serving_layout(config, self.mesh))
            if self.mesh is not None:
                shard_module(served, self.mesh, self._rules)
        engine = object.__new__(Engine)
        engine._build(self.target, served, config, self.mesh, self._rules)
        return engine

    def _build(self, target: Target, drafter: Drafter | None, config: EngineConfig, mesh: Mesh | None,
               rules) -> None:
        """The engine over ``target`` and ``drafter`` in the serving layout, already on ``mesh``."""
        if config.compilation_cache_dir is not None:
            use_compilation_cache(config.compilation_cache_dir)
        self.config = config
        self.block_size = config.largest_block(drafter.config.block_size) if drafter is not None else 1
        self.speculation_blocks = _speculation_blocks(config, self.block_size, drafter)
        self.step_costs: dict[tuple[int, int], float] = {}  # (state rows, block) -> seconds per step
        # Rounded up to whole attention tiles: the GPU kernel otherwise shrinks its key tile to a
        # divisor of the capacity (16 keys for 1025) or pads a copy of every cache buffer per call.
        self.capacity = -(-(config.max_length + self.block_size) // CACHE_ALIGNMENT) * CACHE_ALIGNMENT
        self.mesh, self._rules = mesh, rules
        self.attention_impl = resolve_attention_impl(config.attention_impl)
        self.ops = OpsConfig(attention=self.attention_impl,
                             cached_attention_tiles=parse_tiles(config.cached_attention_tiles),
                             experts=config.experts_impl, gpu_lowering=config.gpu_lowering)
        # The modules the engine runs (the serving layout, sharded on the mesh).
        self.target, self.drafter = target, drafter
        self._matmul_precision = config.matmul_precision
        if self._matmul_precision == "auto":
            self._matmul_precision = "highest" if target.embed_tokens.dtype == jnp.float32 else "default"
        # Model state is split and flattened once: the jitted phases take plain tuples of arrays
        # (flattening NNX variables on every call costs more host time than a small model's step)
        # and rebuild the modules inside.
        self._target_def, target_state = nnx.split(target)
        self._target_state, self._target_tree = jax.tree.flatten(target_state)
        self._drafter_def, self._drafter_state, self._drafter_tree = None, [], None
        if drafter is not None:
            self._drafter_def, drafter_state = nnx.split(drafter)
            self._drafter_state, self._drafter_tree = jax.tree.flatten(drafter_state)
        self.one_shot_graphs = config.one_shot_graphs
        if self.one_shot_graphs is None:
            self.one_shot_graphs = sum(x.size for x in self._target_state) < ONE_SHOT_GRAPH_MAX_PARAMS
        once = _one_shot_compiler_options(self.one_shot_graphs)
        self._prefill = jax.jit(self._traced(self._prefill_fn), compiler_options=once)
        self._prefill_alone = jax.jit(self._traced(self._prefill_alone_fn), compiler_options=once)
        self._draw_first = jax.jit(self._traced(self._draw_first_fn), donate_argnums=(0,), compiler_options=once)
        self._decode = jax.jit(self._traced(self._decode_fn), donate_argnums=(2,),
                               static_argnames=("window", "fixed_steps", "flags", "block"),
                               compiler_options=_decode_compiler_options())
        self._empty = jax.jit(self._empty_fn, static_argnames=("rows",), compiler_options=once)
        self._admit = jax.jit(self._admit_fn, donate_argnums=(0,), compiler_options=once)
        # a new shape: nothing to donate to
        self._resize = jax.jit(self._resize_fn, static_argnames=("rows",), compiler_options=once)
        self._release = jax.jit(self._release_fn, donate_argnums=(0,), compiler_options=once)
        self._mask_id = drafter.config.mask_token_id if drafter is not None else 0
        self.vocab_size = target.config.vocab_size
        self.speculative = drafter is not None
        # Stop ids per row: a fixed size, so that no request's stop ids recompile anything.
        self.max_stop_ids = 16
        # The XLA attention computes over every cache position it is given, so decode calls read a
        # bucketed prefix of the caches that covers the live rows; the Pallas kernels skip positions
        # past each row's length themselves and always get the whole cache (one compiled variant).
        # A fixed loop has no early stop for a row that would outgrow its window: it gets the whole
        # cache, which every row fits.
        self.fixed_loop = config.decode_loop == "fixed" or (
            config.decode_loop == "auto" and self.mesh is not None and self.mesh.size > 1
            and jax.default_backend() == "gpu")
        if self.fixed_loop and config.max_steps_per_sync is not None:
            log.warning("max_steps_per_sync %d is ignored: this engine's decode loop is fixed (a program per step "
                        "count), so every call runs steps_per_sync %d", config.max_steps_per_sync,
                        config.steps_per_sync)
            self.config = config = dataclasses.replace(config, max_steps_per_sync=None)
        self.windows = (window_buckets(self.capacity) if self.attention_impl == "xla" and not self.fixed_loop
                        else (self.capacity,))
        self._n_steps: dict[int, jax.Array] = {}
        # The most steps of one target-only call of a speculative engine (a decode loop's dynamic step count):
        # the slots of the buffer its steps' taps wait in for the drafter's context (``_decode_fn``).
        self.deferred_steps = max(config.steps_per_sync, config.max_steps_per_sync or 0)
        # Distinct prompts the prefills ran and their tokens computed (cached prefixes excluded): rows
        # sharing a prompt (n > 1 choices) count it once.
        self.prefilled_prompts = self.prefilled_tokens = 0
        self._init_pages()

    def _init_pages(self) -> None:
        """A paged engine's pool size and phases (``runtime/paged.py``; ``page_size`` 0: none)."""
        self.page_size = self.config.page_size
        self.paged = self.page_size > 0
        if not self.paged:
            return
        if self.mesh is not None and self.mesh.shape["data"] * self.mesh.shape["fsdp"] > 1:
            raise ValueError(f"paged caches (engine.page_size > 0) split the pools by KV head over `tensor`, each "
                             f"device holding its heads of every row's pages, and never split the rows: set "
                             f"engine.mesh to data: 1, fsdp: 1 (got {dict(self.mesh.shape)})")
        if isinstance(self.target, HybridTarget):
            raise ValueError("paged caches (engine.page_size > 0) take attention-only targets: a hybrid target's "
                             "recurrent state is per row")
        self.max_pages = self.capacity // self.page_size  # the capacity is a multiple of 128
        self._num_pages: int | None = None  # ``num_pages``: sized when first asked
        # The view a paged step copies follows the live rows, as the XLA attention's window does.
        self.windows = window_buckets(self.capacity) if not self.fixed_loop else (self.capacity,)
        once = _one_shot_compiler_options(self.one_shot_graphs)
        # The state is donated: a prefill over a cached prefix writes its suffix into the pools in place.
        self._paged_prefill = jax.jit(self._traced(self._paged_prefill_fn), static_argnames=("suffix", "context_pages"),
                                      donate_argnums=(2,), compiler_options=once)
        self._paged_admit = jax.jit(self._pinned(paged.admit), donate_argnums=(0,), compiler_options=once)
        self._paged_write = jax.jit(self._pinned(paged.write_pages), donate_argnums=(0,), compiler_options=once)
        self._paged_set_rows = jax.jit(self._pinned(paged.set_page_rows), donate_argnums=(0,), compiler_options=once)
        self._paged_empty = jax.jit(self._paged_empty_fn, static_argnames=("rows",), compiler_options=once)
        # The pools are donated (they keep their shape), the rows' arrays not (they change theirs).
        self._paged_resize = jax.jit(self._paged_resize_fn, donate_argnums=(0, 1), static_argnames=("rows",),
                                     compiler_options=once)

    def page_bytes(self) -> int:
        """Bytes of one page on each device: its positions' K/V in every target layer and drafter layer (on a
        mesh, the device's KV heads of them)."""
        def layer_bytes(config, dtype) -> int:
            kv_heads = config.num_kv_heads
            if self.mesh is not None:  # as the pools are placed (``POOL_AXES``): replicated where uneven
                shape = (1, self.page_size, kv_heads, config.head_dim)
                kv_heads = named_sharding(POOL_AXES, shape, self.mesh, self._rules).shard_shape(shape)[2]
            return 2 * config.num_layers * kv_heads * config.head_dim * jnp.dtype(dtype).itemsize

        total = layer_bytes(self.target.config, self.target.embed_tokens.dtype)
        if self.drafter is not None:
            total += layer_bytes(self.drafter.config, self.drafter.dtype)
        return total * self.page_size

    @property
    def num_pages(self) -> int:
        """The pool's pages, page 0 (the null page) included. With ``kv_memory_fraction``, sized from the
        device's free memory when first asked (a batcher's start, ``empty_state``), not when the engine is
        built: the modules it was built from may be dropped by then (``serving.cli.load_engine`` drops
        them), and their memory is then free for pages."""
        if self._num_pages is None:
            self._num_pages = self._pool_pages() + 1
        return self._num_pages

    def _pool_pages(self) -> int:
        """The pages requests may hold: ``num_pages``, or ``kv_memory_fraction`` of the device's free
        memory, or what ``max_batch_size`` contiguous rows of ``capacity`` positions take."""
        config = self.config
        if config.num_pages is not None:
            return config.num_pages
        if config.kv_memory_fraction is None:
            return self.state_rows(config.max_batch_size) * self.max_pages
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            raise ValueError("engine.kv_memory_fraction: this device reports no memory limit; set engine.num_pages")
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        pages = int(config.kv_memory_fraction * free) // self.page_bytes()
        if pages < self.max_pages:
            raise ValueError(f"engine.kv_memory_fraction {config.kv_memory_fraction} gives {pages} pages of "
                             f"{self.page_size} positions, fewer than one row of max_length takes ({self.max_pages})")
        return pages

    def _pinned(self, fn: Callable[..., decoding.DecodeState]) -> Callable[..., decoding.DecodeState]:
        """``fn`` with its state pinned to the mesh's layout (``_constrain``), so a donated state keeps its
        buffers' layout."""
        return functools.wraps(fn)(lambda *args, **kwargs: self._constrain(fn(*args, **kwargs)))

    def _paged_empty_fn(self, *, rows: int) -> decoding.DecodeState:
        return self._constrain(paged.empty_state(
            self.target, self.drafter, rows, pages=self.num_pages, page_size=self.page_size, max_pages=self.max_pages,
            capacity=self.capacity, max_steps=self.config.max_length, n_stop=self.max_stop_ids,
            max_logprobs=self.config.max_logprobs))

    def _paged_resize_fn(self, target_pools, draft_pools, state, slots, *, rows: int):
        empty = dataclasses.replace(self._empty_fn(rows=rows), target_cache=None, draft_cache=None,
                                    page_table=jnp.zeros((rows, self.max_pages), jnp.int32))
        state = dataclasses.replace(state, target_cache=target_pools, draft_cache=draft_pools)
        return self._constrain(paged.resize(empty, state, slots))

    def _paged_prefill_fn(self, target_state, drafter_state, state, page_rows, ids, lens, cached, max_lens,
                          stop_ids, sampling, source=None, row_cached=None, row_pages=None, *, suffix: int,
                          context_pages: int):
        """``_prefill_fn`` over a cached prefix in ``state``'s pages (``paged.prefill``) -> the rows, their
        greedy first tokens, ``state`` with the suffixes written into its pools and the last logits;
        ``source``: rows sharing a prompt (``page_rows``, ``ids``, ``lens`` and ``cached`` are then the
        distinct prompts')."""
        target, drafter = self._models(target_state, drafter_state)
        sampling = dict(sampling)
        want = sampling.pop("prompt_logprobs")
        rows, state, last_logits = paged.prefill(
            target, drafter, state, page_rows, ids, lens, cached, max_lens, stop_ids, suffix=suffix,
            context_pages=context_pages, capacity=self.capacity, max_steps=self.config.max_length,
            mask_token_id=self._mask_id, ops=self.ops, sampling=sampling, max_logprobs=self.config.max_logprobs,
            source=source, row_cached=row_cached, row_pages=row_pages, prompt_logprobs=want)
        first = jnp.take_along_axis(rows.tokens, rows.starts[:, None], axis=1)[:, 0]
        return self._constrain(rows), first, self._constrain(state), last_logits

    def prefill_paged(self, state: decoding.DecodeState, prompts: Sequence[Sequence[int]],
                      max_new_tokens: Sequence[int], stop_token_ids: Sequence[Sequence[int]],
                      pages: Sequence[Sequence[int]], cached: Sequence[int],
                      sampling: Sequence[SamplingParams] | None = None
                      ) -> tuple[decoding.DecodeState, decoding.DecodeState, jax.Array, "PagedAdmission"]:
        """``prefill`` for a paged engine: each prompt's first ``cached`` tokens are already in its
        ``pages`` (``runtime.pages.PageGrant``) of ``state``'s pools, and only the rest is computed.
        Returns ``state`` (donated: a prefill over a cached prefix writes the rest into the prompts' pages
        in place), the rows, the first tokens and what ``admit_paged`` needs beside them."""
        params = smp.resolve(sampling, len(prompts))
        # Rows sharing a prompt (n > 1 choices) run it once, on the pages of the one with the fewest cached
        # tokens; each reads its own positions from that pass (it may share that row's full pages).
        leaders = shared_prompts(prompts, cached)
        distinct = list(range(len(prompts))) if leaders is None else sorted(set(leaders))
        hit = any(cached[i] for i in distinct)
        # Over a cached prefix the program depends on the rest's bucket, not the whole prompt's: its ids
        # come at the largest bucket's width.
        width = self._largest_bucket() if hit else None
        ids, lens, max_lens, stop_ids, arrays = self._prefill_inputs(prompts, max_new_tokens, stop_token_ids, params,
                                                                      width=width)
        page_rows = self._page_rows(pages, ids.shape[0])
        cache_from = np.zeros((ids.shape[0],), np.int32)
        cache_from[:len(cached)] = cached
        self._count_prefill([prompts[i] for i in distinct], [cached[i] for i in distinct])
        context_pages, suffix = 0, ids.shape[1]
        if hit:
            context_pages = self.context_pages(max(cached[i] for i in distinct))
            suffix = self._prompt_bucket(max(len(prompts[i]) - cached[i] for i in distinct))
        admission = PagedAdmission(*self._batch_arguments((page_rows, cache_from)))
        shared = {}
        model_rows, model_cached = admission.page_rows, admission.cache_from
        if leaders is not None:
            ids, lens, source = self._distinct_inputs(prompts, leaders, width=width)
            model_rows = self._batch_arguments(self._page_rows([pages[i] for i in distinct], ids.shape[0]))
            distinct_cached = np.zeros((ids.shape[0],), np.int32)
            distinct_cached[:len(distinct)] = [cached[i] for i in distinct]
            model_cached = self._batch_arguments(distinct_cached)
            shared = {"source": source, "row_cached": admission.cache_from, "row_pages": admission.page_rows}
        rows, first, state, last_logits = self._paged_prefill(
            self._target_state, self._drafter_state, state, model_rows, ids, lens, model_cached, max_lens, stop_ids,
            arrays, suffix=suffix, context_pages=context_pages, **shared)
        rows, first = self.draw_first(rows, first, last_logits, params)
        return state, rows, first, admission

    def context_pages(self, cached_tokens: int) -> int:
        """The static page count through which a prefill over cached prefixes of up to ``cached_tokens``
        tokens reads them. The kernels read each row's pages up to its own length whatever the count, so
        they get every page: a prefill over a cached prefix is then one program per row count and bucket of
        the rest, as the decode calls are one per row count, and ``warmup`` compiles them all. The XLA
        attention computes over every page it is given: a power of two covering the prefix, each compiled
        when first met."""
        if self.attention_impl != "xla":
            return self.max_pages
        return min(_next_pow2(max(1, cached_tokens // self.page_size)), self.max_pages)

    def _largest_bucket(self) -> int:
        return self._prompt_bucket(self.config.max_prompt_length)

    def _page_rows(self, pages: Sequence[Sequence[int]], rows: int) -> np.ndarray:
        """Page tables ``[rows, max_pages]`` of ``pages`` (null pages after them and in padding rows)."""
        page_rows = np.zeros((rows, self.max_pages), np.int32)
        for i, row_pages in enumerate(pages):
            page_rows[i, :len(row_pages)] = row_pages
        return page_rows

    def admit_paged(self, state: decoding.DecodeState, rows: decoding.DecodeState, slots: Sequence[int],
                    admission: "PagedAdmission") -> decoding.DecodeState:
        """``admit`` for a paged engine: the rows of ``prefill_paged`` into free slots, their K/V into
        their pages; donates ``state``."""
        index = np.full((rows.starts.shape[0],), state.starts.shape[0], np.int32)  # out of range: dropped
        index[: len(slots)] = slots
        return self._paged_admit(state, rows, index, admission.page_rows, admission.cache_from)

    def set_pages(self, state: decoding.DecodeState, pages: dict[int, Sequence[int]]) -> decoding.DecodeState:
        """A paged engine: the page tables of running rows (``{slot: pages}``) after they got more pages
        as they advanced; donates ``state``. One shape per row count: the slots are padded to it."""
        rows = state.starts.shape[0]
        slots = np.full((rows,), rows, np.int32)  # out of range: dropped
        page_rows = np.zeros((rows, self.max_pages), np.int32)
        for i, (slot, row_pages) in enumerate(sorted(pages.items())):
            slots[i], page_rows[i, :len(row_pages)] = slot, row_pages
        return self._paged_set_rows(state, *self._batch_arguments((slots, page_rows)))

    def write_pages(self, state: decoding.DecodeState, rows: decoding.DecodeState,
                    admission: "PagedAdmission") -> decoding.DecodeState:
        """The K/V ``prefill_paged`` computed into their pages, without admitting its rows (a chunk of a
        prompt: ``EngineConfig.prefill_chunk``); donates ``state``. Rows prefilled over a cached prefix
        carry no K/V (the prefill wrote them): ``state`` comes back as it is."""
        if rows.target_cache is None:
            return state
        written = np.ones((rows.starts.shape[0],), bool)
        return self._paged_write(state, rows, admission.page_rows, admission.cache_from, written)

    # -- jitted phases -------------------------------------------------------------------------

    def _traced(self, fn: Callable) -> Callable:
        """``fn`` traced under the engine's matmul precision (baked into the compiled ops) and its
        mesh for the kernels (``sharding.kernel_mesh``: each device runs them on its shards)."""

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            with jax.default_matmul_precision(self._matmul_precision):
                return fn(*args, **kwargs)

        return with_kernel_mesh(traced, self.mesh, self._rules)

    def _models(self, target_leaves, drafter_leaves):
        target = nnx.merge(self._target_def, jax.tree.unflatten(self._target_tree, target_leaves))
        drafter = None
        if self._drafter_def is not None:
            drafter = nnx.merge(self._drafter_def, jax.tree.unflatten(self._drafter_tree, drafter_leaves))
        return target, drafter

    def _prefill_fn(self, target_state, drafter_state, ids, lens, max_lens, stop_ids, sampling, source=None):
        """``decoding.prefill_pass`` -> the rows with their greedy first tokens, those tokens and the last
        logits, from which ``draw_first`` redraws them where a row samples. ``source``: rows sharing a
        prompt (``decoding.prefill``; ``ids`` and ``lens`` are the distinct ones)."""
        target, drafter = self._models(target_state, drafter_state)
        sampling = dict(sampling)
        want = sampling.pop("prompt_logprobs")
        # Every step commits >= 1 token, so max_length bounds the steps of any row.
        state, last_logits = decoding.prefill_pass(
            target, drafter, ids, lens, max_lens, stop_ids, capacity=self.capacity, max_steps=self.config.max_length,
            mask_token_id=self._mask_id, ops=self.ops, sampling=sampling, max_logprobs=self.config.max_logprobs,
            source=source, prompt_logprobs=want)
        first = jnp.take_along_axis(state.tokens, state.starts[:, None], axis=1)[:, 0]
        return self._constrain(state), first, last_logits

    def _prefill_alone_fn(self, target_state, drafter_state, ids, lens, max_lens, stop_ids, sampling):
        """``_prefill_fn`` of one prompt admitted into a fresh running state of one row in the same program:
        a lone request's admission is one program, not three (empty state, prefill, admission), each a
        dispatch and, on a GPU, a CUDA graph to launch. The state's arrays other than the caches have the
        prefill rows' shapes, so ``draw_first`` takes either."""
        rows, first, last_logits = self._prefill_fn(target_state, drafter_state, ids, lens, max_lens, stop_ids,
                                                    sampling)
        state = self._admit_fn(self._empty_fn(rows=1), rows, jnp.zeros((1,), jnp.int32))
        return state, first, last_logits

    def _draw_first_fn(self, rows, last_logits):
        """Every processor is compiled in: one program per row count serves every request (neutral
        parameters change nothing, bit for bit: a greedy row's first token is the argmax of its raw logits)."""
        flags = SamplingFlags(sample=True, edits=True, top_k=True, top_p=True, top_p_whole_row=True, min_p=True,
                              logprobs=self.config.max_logprobs)
        rows, first = decoding.draw_first(rows, last_logits, flags=flags, candidates=self.config.sampling_candidates)
        return self._constrain(rows), first

    def draw_first(self, rows: decoding.DecodeState, first: jax.Array, last_logits: jax.Array,
                   sampling: Sequence[SamplingParams] | None = None) -> tuple[decoding.DecodeState, jax.Array]:
        """The first tokens of a prefill's ``rows`` (``_prefill``'s or ``_paged_prefill``'s: its greedy
        ``first`` tokens and ``last_logits``) drawn as each row's ``sampling`` asks -> ``(rows, first)``;
        donates ``rows``. Nothing to do where every row is plain greedy (the prefill's argmax stands);
        ``sampling`` None draws anyway (the warm-up compiles it so). The draw is one program per row count,
        the rows' caches (their prompt bucket's shape) kept out of it."""
        if sampling is not None and SamplingFlags.of(sampling, self.config.max_logprobs).greedy:
            return rows, first
        caches = rows.target_cache, rows.draft_cache
        drawn, first = self._draw_first(dataclasses.replace(rows, target_cache=None, draft_cache=None), last_logits)
        return dataclasses.replace(drawn, target_cache=caches[0], draft_cache=caches[1]), first

    def _empty_fn(self, *, rows: int) -> decoding.DecodeState:
        # Only the models' configs and dtypes are read: no weights enter the computation.
        state = decoding.empty_state(self.target, self.drafter, rows, capacity=self.capacity,
                                     max_steps=self.config.max_length, n_stop=self.max_stop_ids,
                                     max_logprobs=self.config.max_logprobs)
        return self._constrain(state)

    def _admit_fn(self, state, rows, slots):
        return self._constrain(decoding.scatter_rows(state, rows, slots))

    def _resize_fn(self, state, slots, *, rows: int):
        return self._constrain(decoding.scatter_rows(self._empty_fn(rows=rows), state, slots))

    def _release_fn(self, state, release):
        return self._constrain(decoding.release_rows(state, release))

    def _decode_fn(self, target_state, drafter_state, state, n_steps, *, window: int, fixed_steps: int | None,
                   flags: SamplingFlags = decoding.GREEDY_FLAGS, block: int | None = None):
        """``n_steps`` (a device scalar) steps that stop early once every row is done; or, with
        ``fixed_steps``, exactly that many (``n_steps`` None). ``flags``: what the rows' sampling uses.
        ``block``: the steps' block size (None: the engine's; 1: target-only steps whose taps extend the
        drafter's context after the last of them, ``decoding.deferred_target_step``)."""
        target, drafter = self._models(target_state, drafter_state)
        candidates = self.config.sampling_candidates
        deferred = drafter is not None and block == 1
        sampled = dict(ops=self.ops, flags=flags, candidates=candidates)

        def contiguous_step(s, window=window):
            if drafter is None:
                s = decoding.target_only_step(target, s, window=window, **sampled)
            else:
                s = decoding.speculative_step(target, drafter, s, block_size=block or self.block_size, window=window,
                                              context_window=self.config.drafter_context_window, **sampled)
            return self._constrain(s)

        def deferred_step(s, taps, slot, window=window):
            s, taps = decoding.deferred_target_step(target, drafter, s, taps, slot, window=window, **sampled)
            return self._constrain(s), taps

        def step(i, s, taps):
            read_pages = -(-window // self.page_size) if s.page_table is not None else 0
            if not deferred:
                if s.page_table is None:
                    return contiguous_step(s), taps
                # The step reads the window's pages through the tables (its whole capacity: no window inside).
                return paged.step(functools.partial(contiguous_step, window=None), s, read_pages=read_pages), taps
            if s.page_table is None:
                return deferred_step(s, taps, i)
            return paged.step(functools.partial(deferred_step, taps=taps, slot=i, window=None), s,
                              read_pages=read_pages)

        def cond(carry):
            i, s, _ = carry
            # A row whose next block would not fit the window ends the call early (the host then
            # picks a larger window); the host's choice makes this a safety net, not the rule.
            fits = jnp.all(s.done | (s.starts + self.block_size <= window))
            return (i < n_steps) & ~jnp.all(s.done) & fits

        def body(carry):
            i, s, taps = carry
            return (i + 1,) + step(i, s, taps)

        starts = state.starts
        taps = None
        if deferred:  # slot i: step i's anchor taps (a live row advances one position per target-only step)
            slots = fixed_steps if fixed_steps is not None else self.deferred_steps
            taps = jnp.zeros((state.starts.shape[0], slots, len(drafter.config.target_layer_ids)
                              * target.config.hidden_size), target.embed_tokens.dtype)
        if fixed_steps is None:
            _, state, taps = jax.lax.while_loop(cond, body, (jnp.int32(0), state, taps))
        else:  # a static trip count: steps on done rows change nothing the host reads
            state, taps = jax.lax.fori_loop(0, fixed_steps, lambda i, c: step(i, *c), (state, taps))
        if deferred:
            count = state.starts - starts
            if state.page_table is None:
                state = dataclasses.replace(state, draft_cache=decoding.extend_context(
                    drafter, state.draft_cache, taps, starts, count))
            else:
                state = paged.extend_context(drafter, state, taps, starts, count)
            state = self._constrain(state)
        # Copies the host can read while the donated state is already in the next call.
        snapshot = RowSnapshot(tokens=state.tokens + 0, starts=state.starts + 0, done=state.done | False,
                               num_steps=state.num_steps + 0, accepted=state.accepted + 0)
        if flags.logprobs is not None:  # only then: a copy of the logprob buffers per call
            s = state.sampling
            snapshot = dataclasses.replace(snapshot, logprob=s.logprob + 0,
                                           top_ids=s.top_ids[..., :flags.logprobs] + 0,
                                           top_logprobs=s.top_logprobs[..., :flags.logprobs] + 0)
        return state, snapshot

    def _constrain(self, state: decoding.DecodeState) -> decoding.DecodeState:
        """Pins the state's layout on the mesh (batch on ``data``, caches and page pools on KV heads, page
        tables whole)."""
        if self.mesh is None:
            return state

        def pin(x, axes):
            return jax.lax.with_sharding_constraint(x, named_sharding(axes, x.shape, self.mesh, self._rules))

        def pin_layer(x):
            if isinstance(x, PagedKV):  # inside a paged step: a layer's pool and the rows' tables
                return dataclasses.replace(x, pool=pin(x.pool, POOL_AXES),
                                           page_table=pin(x.page_table, PAGE_TABLE_AXES),
                                           writable=pin(x.writable, ("batch",)))
            return pin(x, POOL_AXES if state.page_table is not None else CACHE_AXES)

        def pin_cache(c):
            if c is None:
                return None
            return type(c)(tuple(pin_layer(x) for x in c.k), tuple(pin_layer(x) for x in c.v))

        page_table = None if state.page_table is None else pin(state.page_table, PAGE_TABLE_AXES)
        return dataclasses.replace(
            state, page_table=page_table,
            tokens=pin(state.tokens, ("batch", "length")), starts=pin(state.starts, ("batch",)),
            max_lens=pin(state.max_lens, ("batch",)), done=pin(state.done, ("batch",)),
            num_steps=pin(state.num_steps, ("batch",)), accepted=pin(state.accepted, ("batch", "length")),
            stop_ids=pin(state.stop_ids, ("batch", "length")),
            target_cache=pin_cache(state.target_cache), draft_cache=pin_cache(state.draft_cache),
        )

    def decode(self, state: decoding.DecodeState, n_steps: int | None = None, *,
               window: int | None = None, sampling: SamplingFlags = decoding.GREEDY_FLAGS,
               block: int | None = None) -> tuple[decoding.DecodeState, RowSnapshot]:
        """Up to ``n_steps`` (default ``steps_per_sync``) decode steps on device; donates ``state``.

        ``window``: the steps attend to the first ``window`` cache positions only, rounded up to
        ``self.windows``; the call stops early when a row that is not done would outgrow it. None:
        the whole cache.

        ``sampling``: the flags of the live rows' ``SamplingParams`` (``SamplingFlags.of``); the default:
        every row greedy without logprobs. ``block``: one of ``speculation_blocks`` (1: target-only
        steps); None: ``block_size``.

        Returns the new state and a snapshot of its rows that stays readable after the state is
        donated to the next call.
        """
        n = self.config.steps_per_sync if n_steps is None else int(n_steps)
        if block == 1 and self.speculative and not self.fixed_loop and n > self.deferred_steps:
            # A target-only call keeps each step's taps for the drafter's context in a buffer of
            # ``deferred_steps`` slots: a longer call runs as several.
            state, _ = self.decode(state, n - self.deferred_steps, window=window, sampling=sampling, block=block)
            n = self.deferred_steps
        count, fixed = self._step_count(n)
        return self._decode(self._target_state, self._drafter_state, state, count,
                            window=self._window(window), fixed_steps=fixed, flags=sampling,
                            **self._block_argument(block))

    def _block_argument(self, block: int | None) -> dict:
        """``_decode``'s ``block`` for ``decode``'s (the engine's own block adds no argument: one program)."""
        if block is None or block == self.block_size:
            return {}
        if block not in self.speculation_blocks:
            raise ValueError(f"block {block} is not one of this engine's speculation blocks {self.speculation_blocks}")
        return {"block": block}

    @property
    def adaptive(self) -> bool:
        """Whether decode calls pick their block size (``EngineConfig.speculation``)."""
        return self.speculative and self.config.speculation == "adaptive"

    def set_step_costs(self, costs: dict[tuple[int, int], float]) -> None:
        """Seconds per decode step of each ``(state rows, block)``, for adaptive speculation (measured
        elsewhere, or by ``calibrate_speculation``)."""
        for (rows, block), seconds in costs.items():
            if block not in self.speculation_blocks or rows < 1 or not seconds > 0:
                raise ValueError(f"step cost {seconds!r} for ({rows} rows, block {block}): rows >= 1, one of the "
                                 f"speculation blocks {self.speculation_blocks} and positive seconds expected")
        self.step_costs.update(costs)

    def calibrate_speculation(self, rows: Sequence[int] | None = None, *, steps: int = 8, repeats: int = 3,
                              prompt_length: int = 256) -> dict[tuple[int, int], float]:
        """Times a decode step of every speculation block on running states of ``rows`` rows (default:
        ``state_rows`` of 1 and ``max_batch_size``), every row live after a prompt of ``prompt_length``
        tokens (at most a quarter of ``max_length``); keeps and returns the fastest of ``repeats`` calls
        of ``steps`` steps per block, each from a fresh admission of the same prefill, in seconds per
        step (``step_costs``). Compiles what warm-up has not."""
        rows = sorted({self.state_rows(1), self.state_rows(self.config.max_batch_size)} if rows is None else set(rows))
        plen = max(1, min(prompt_length, self.config.max_length // 4, self.config.max_prompt_length))
        costs = {}
        for n in rows:
            live = min(n, self.config.max_batch_size)  # a full state (padding rows are done, and computed too)
            args = ([[1] * plen] * live, [self.config.max_length] * live, [()] * live)
            if self.paged:  # one state, its pools allocated once; each attempt admits the rows again
                state = self.empty_state(n)
                state, fresh, _, admission = self.prefill_paged(state, *args, self._calibration_pages(
                    live, plen + (steps + 1) * self.block_size + 1), [0] * live)
            else:
                fresh, _ = self.prefill(*args)
            for block in self.speculation_blocks:
                times = []
                for attempt in range(repeats + 1):  # the first compiles and warms
                    if self.paged:
                        state = self.admit_paged(state, fresh, list(range(live)), admission)
                    else:
                        state = self.admit(self.empty_state(n), fresh, list(range(live)))
                    jax.block_until_ready(state.starts)
                    t0 = time.perf_counter()
                    state, snap = self.decode(state, steps, window=plen + steps * self.block_size + 1, block=block)
                    taken = int(np.asarray(snap.num_steps).max())  # fewer than steps once the rows are done
                    if attempt and taken > 0:
                        times.append((time.perf_counter() - t0) / taken)
                if times:
                    costs[(n, block)] = float(min(times))
        self.set_step_costs(costs)
        log.info("speculation step costs (rows, block -> ms): %s",
                 ", ".join(f"({r}, {b}) {1e3 * t:.2f}" for (r, b), t in sorted(costs.items())))
        return costs

    def _calibration_pages(self, rows: int, positions: int) -> list[list[int]]:
        """Pages for ``rows`` rows of ``positions`` positions each, for timing only: distinct pages while
        the pool holds them, then pages shared round the pool (their values do not matter)."""
        per_row = min(-(-positions // self.page_size), self.max_pages)
        usable = self.num_pages - 1  # page 0 is the null page
        return [[1 + (r * per_row + j) % usable for j in range(per_row)] for r in range(rows)]

    def decode_compiled(self, state: decoding.DecodeState, n_steps: int = 1, *,
                        window: int | None = None, sampling: SamplingFlags = decoding.GREEDY_FLAGS,
                        block: int | None = None) -> jax.stages.Compiled:
        """``decode(state, n_steps, window=window)`` as compiled: its optimised HLO (``as_text``: its
        copies, its collectives on a mesh) and its device memory (``memory_analysis``). Compiles
        only; ``state`` is not donated."""
        return self.decode_lowered(state, n_steps, window=window, sampling=sampling, block=block).compile()

    def decode_lowered(self, state: decoding.DecodeState, n_steps: int = 1, *,
                       window: int | None = None, sampling: SamplingFlags = decoding.GREEDY_FLAGS,
                       block: int | None = None) -> jax.stages.Lowered:
        """``decode(state, n_steps, window=window)`` traced and lowered, not compiled. ``state`` may be
        abstract (``jax.eval_shape``). Its ``compile()`` may run on another thread (XLA compiles
        outside the GIL), and a later ``decode`` of a state of the same shapes runs that program."""
        count, fixed = self._step_count(n_steps)
        return self._decode.lower(self._target_state, self._drafter_state, state, count,
                                  window=self._window(window), fixed_steps=fixed, flags=sampling,
                                  **self._block_argument(block))

    def prefill_compiled(self, rows: int, prompt_length: int, *, distinct: int | None = None,
                         alone: bool = False) -> jax.stages.Compiled:
        """The prefill of ``rows`` prompts of ``prompt_length`` tokens (its prompt bucket), as compiled;
        compiles only. Its ``out_info`` is the prefilled rows' shapes and placement. ``distinct``: rows
        sharing prompts (``prefill`` of ``n`` > 1 choices), whose prompts run on that many rows. ``alone``:
        the prefill of one prompt into a running state of its own (``prefill(alone=True)``)."""
        args = self._prefill_inputs([[0] * prompt_length] * rows, [2] * rows, [()] * rows)
        if alone:
            if rows != 1:
                raise ValueError(f"a prefill alone has one row, not {rows}")
            return self._prefill_alone.lower(self._target_state, self._drafter_state, *args).compile()
        if distinct is not None:  # as ``_distinct_inputs`` places them
            put = self._batch_arguments
            args = (put(np.zeros((distinct, args[0].shape[1]), np.int32)), put(np.ones((distinct,), np.int32)),
                    *args[2:], put(np.zeros((args[1].shape[0],), np.int32)))
        return self._prefill.lower(self._target_state, self._drafter_state, *args).compile()

    def prefill_paged_compiled(self, state: decoding.DecodeState, rows: int, prompt_length: int, *,
                               distinct: int | None = None, context_pages: int = 0
                               ) -> tuple[jax.stages.Compiled, "PagedAdmission"]:
        """``prefill_paged`` of ``rows`` prompts of ``prompt_length`` tokens with nothing cached, beside
        ``state`` (its pools), as compiled (compiles only), and an admission of its rows to the null page.
        ``distinct``: rows sharing prompts, as in ``prefill_compiled``. ``context_pages > 0``: the program
        of prompts whose cached prefixes take up to that many pages (``context_pages``) and whose rest is
        up to ``prompt_length`` tokens."""
        width = self._largest_bucket() if context_pages else None
        ids, lens, max_lens, stop_ids, arrays = self._prefill_inputs([[0] * prompt_length] * rows, [2] * rows,
                                                                      [()] * rows, width=width)
        suffix = self._prompt_bucket(prompt_length)
        put = self._batch_arguments
        batch, bucket = ids.shape
        admission = PagedAdmission(put(np.zeros((batch, self.max_pages), np.int32)), put(np.zeros((batch,), np.int32)))
        model_rows, cached, shared = admission.page_rows, admission.cache_from, {}
        if distinct is not None:  # as ``prefill_paged`` places them
            ids, lens = put(np.zeros((distinct, bucket), np.int32)), put(np.ones((distinct,), np.int32))
            model_rows = put(np.zeros((distinct, self.max_pages), np.int32))
            cached = put(np.zeros((distinct,), np.int32))
            shared = {"source": put(np.zeros((batch,), np.int32)), "row_cached": admission.cache_from,
                      "row_pages": admission.page_rows}
        compiled = self._paged_prefill.lower(self._target_state, self._drafter_state, state, model_rows, ids, lens,
                                             cached, max_lens, stop_ids, arrays, suffix=suffix,
                                             context_pages=context_pages, **shared).compile()
        return compiled, admission

    def decode_hlo(self, state: decoding.DecodeState, n_steps: int = 1, *, window: int | None = None,
                   block: int | None = None) -> str:
        """The optimised HLO text of ``decode_compiled``: what a call runs."""
        return self.decode_compiled(state, n_steps, window=window, block=block).as_text()

    def _step_count(self, n: int) -> tuple[jax.Array | None, int | None]:
        """``_decode``'s ``n_steps`` and ``fixed_steps`` for ``n`` steps."""
        if self.fixed_loop:  # one compiled variant per count
            return None, n
        if n not in self._n_steps:  # a cached device scalar: building one costs a dispatch per call
            self._n_steps[n] = self._put(np.int32(n), ())
        return self._n_steps[n], None

    def _window(self, needed: int | None) -> int:
        """The smallest window bucket covering ``needed`` cache positions (None: the whole cache)."""
        if needed is None:
            return self.capacity
        return next((w for w in self.windows if w >= needed), self.capacity)

    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                stop_token_ids: Sequence[Sequence[int]], sampling: Sequence[SamplingParams] | None = None,
                *, alone: bool = False) -> tuple[decoding.DecodeState, jax.Array]:
        """Runs ``prompts`` (token-id lists that ``ContinuousBatcher.submit`` checked) in a batch of
        their own: ``prefill_rows`` rows (padding rows done), the prompt bucket of the longest.

        ``stop_token_ids``: each prompt's stop ids (at most ``max_stop_ids``). Returns the rows, for
        ``admit`` (their caches hold just the prompt bucket), and ``first [rows]``, each row's first
        generated token, a copy that stays readable after the rows are admitted. ``sampling``: each
        prompt's ``SamplingParams`` (seeded: ``SamplingParams.with_seed``; None: all greedy).

        ``alone``: one prompt, returned as a running state of one row (``state_rows(1)``) that holds it,
        in place of the rows: what ``admit`` of its rows into ``empty_state(1)`` gives, in one program.
        """
        if alone and (len(prompts) != 1 or self.paged):
            raise ValueError(f"a prefill alone takes one prompt on an engine without pages; got "
                             f"{len(prompts)} prompts{' on a paged engine' if self.paged else ''}")
        params = smp.resolve(sampling, len(prompts))
        leaders = shared_prompts(prompts)  # None for one prompt
        inputs = self._prefill_inputs(prompts, max_new_tokens, stop_token_ids, params)
        if leaders is None:
            self._count_prefill(prompts)
            program = self._prefill_alone if alone else self._prefill
            rows, first, last_logits = program(self._target_state, self._drafter_state, *inputs)
        else:
            ids, lens, source = self._distinct_inputs(prompts, leaders)
            self._count_prefill([prompts[i] for i in sorted(set(leaders))])
            rows, first, last_logits = self._prefill(self._target_state, self._drafter_state, ids, lens, *inputs[2:],
                                                     source)
        return self.draw_first(rows, first, last_logits, params)

    def _count_prefill(self, computed: Sequence[Sequence[int]], cached: Sequence[int] | None = None) -> None:
        """Adds a prefill's distinct prompts and their computed tokens to the counters."""
        self.prefilled_prompts += len(computed)
        self.prefilled_tokens += sum(len(p) for p in computed) - sum(cached or ())

    def _distinct_inputs(self, prompts: Sequence[Sequence[int]], leaders: Sequence[int], *,
                         width: int | None = None) -> tuple[jax.Array, ...]:
        """A shared prefill's model inputs: the distinct prompts' ids ``[prefill_rows(distinct), bucket]``
        (``width``: that many columns instead of the prompts' bucket) and lengths, and each output row's
        ``source`` among them (``shared_prompts``' ``leaders``)."""
        distinct = sorted(set(leaders))
        rows = self.prefill_rows(len(distinct))
        bucket = width or self._prompt_bucket(max(len(p) for p in prompts))
        ids = np.zeros((rows, bucket), np.int32)
        lens = np.ones((rows,), np.int32)
        for i, p in enumerate(distinct):
            ids[i, :len(prompts[p])] = prompts[p]
            lens[i] = len(prompts[p])
        source = np.zeros((self.prefill_rows(len(prompts)),), np.int32)  # padding rows: a copy of the first
        source[:len(leaders)] = [distinct.index(leader) for leader in leaders]
        return self._batch_arguments((ids, lens, source))

    def _prefill_inputs(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                        stop_token_ids: Sequence[Sequence[int]],
                        sampling: Sequence[SamplingParams] = (), *, width: int | None = None) -> tuple[jax.Array, ...]:
        """``_prefill``'s arguments after the weights: ids ``[rows, bucket]`` (``width``: that many columns
        instead of the prompts' bucket), lengths, max lengths, stop ids ``[rows, max_stop_ids]`` and the
        rows' sampling arrays, placed as the jit takes them."""
        n = len(prompts)
        if n > self.config.max_batch_size:
            raise ValueError(f"{n} prompts exceed max_batch_size={self.config.max_batch_size}")
        batch = self.prefill_rows(n)
        lens = [len(p) for p in prompts]
        plen = width or self._prompt_bucket(max(lens))
        ids = np.zeros((batch, plen), np.int32)
        stop_ids = np.full((batch, self.max_stop_ids), -1, np.int32)
        for i, (p, stops) in enumerate(zip(prompts, stop_token_ids)):
            ids[i, : len(p)] = p
            stop_ids[i, : len(stops)] = stops
        row_lens = np.ones((batch,), np.int32)
        row_lens[:n] = lens
        max_lens = np.ones((batch,), np.int32)  # padding rows: done at once
        max_lens[:n] = [min(l + m, self.config.max_length) for l, m in zip(lens, max_new_tokens)]
        arrays = smp.row_arrays(sampling, batch, self.vocab_size, lens)
        # The rows whose prompt logprobs the prefill records (``decoding.prompt_entries``), beside their parameters.
        arrays["prompt_logprobs"] = np.zeros((batch,), bool)
        arrays["prompt_logprobs"][:len(sampling)] = [p.prompt_logprobs is not None for p in sampling]
        return self._batch_arguments((ids, row_lens, max_lens, stop_ids, arrays))

    def prefill_rows(self, prompts: int) -> int:
        """The rows of a prefill of ``prompts`` prompts: a power of two, at most the batch's."""
        return min(_next_pow2(prompts), _next_pow2(self.config.max_batch_size))

    def prompt_buckets(self) -> list[tuple[int, int]]:
        """``(bucket, shortest prompt in it)`` for every prompt bucket that a prompt the engine
        admits (1 to ``config.max_prompt_length`` tokens) can fall in."""
        buckets, n = [], 1
        while n <= self.config.max_prompt_length:
            bucket = self._prompt_bucket(n)
            buckets.append((bucket, n))
            n = bucket + 1
        return buckets

    def state_rows(self, live: int) -> int:
        """The rows of a running state that holds ``live`` requests: one for a lone request, else
        ``max_batch_size`` rounded up to a power of two. Two shapes, both compiled by ``warmup``."""
        return 1 if live <= 1 else _next_pow2(self.config.max_batch_size)

    def empty_state(self, rows: int) -> decoding.DecodeState:
        """A running state of ``rows`` free slots (every row done); a paged engine's with its pools."""
        return self._paged_empty(rows=rows) if self.paged else self._empty(rows=rows)

    def admit(self, state: decoding.DecodeState, rows: decoding.DecodeState,
              slots: Sequence[int]) -> decoding.DecodeState:
        """Writes the first ``len(slots)`` rows of a ``prefill`` into the free (done) rows ``slots``
        of ``state``; donates ``state``. The prefill's padding rows are dropped."""
        index = np.full((rows.starts.shape[0],), state.starts.shape[0], np.int32)  # out of range: dropped
        index[: len(slots)] = slots
        return self._admit(state, rows, index)

    def resize(self, state: decoding.DecodeState, keep: Sequence[int], *, rows: int) -> decoding.DecodeState:
        """A state of ``rows`` rows: rows ``keep`` of ``state``, in that order, then free slots."""
        index = np.full((state.starts.shape[0],), rows, np.int32)  # out of range: dropped
        index[list(keep)] = np.arange(len(keep))
        if self.paged:  # the pools move as they are
            rows_only = dataclasses.replace(state, target_cache=None, draft_cache=None)
            return self._paged_resize(state.target_cache, state.draft_cache, rows_only, index, rows=rows)
        return self._resize(state, index, rows=rows)

    def release(self, state: decoding.DecodeState, slots: Sequence[int]) -> decoding.DecodeState:
        """Marks rows ``slots`` done (requests given up on); donates ``state``."""
        release = np.zeros((state.starts.shape[0],), bool)
        release[list(slots)] = True
        return self._release(state, release)

    def warmup(self, batch_sizes: Sequence[int] | None = None, *, threads: int | None = None,
               sampling: Sequence[SamplingFlags] = ()) -> float:
        """Compiles everything that requests of up to ``batch_sizes`` prompts at a time run (default:
        1 and ``max_batch_size``), so no request waits for XLA once serving starts; returns the
        seconds spent.

        A shape compiled while serving stalls every running request for its compile (seconds for
        an 8B model), and a server meets many: a prefill per row count (``prefill_rows`` of any
        group of waiting prompts) and prompt bucket, and an admission per prefill and running
        state. So (``dflash_jax.runtime.warmup``): decode at every attention window for each running
        state's row count (first, so that its GEMM autotuning runs alone); then every prefill shape,
        compiled on ``threads`` threads at once (default: up to 8; XLA compiles outside the GIL), with
        the prefills of one prompt's ``n`` > 1 choices at each row count above one; then
        the admissions of stand-ins of their outputs into the states they can join, the states resized
        into each other, and a row of each released (a cancelled request's). No model runs. ``sampling``:
        the flags of the sampled batches to compile decode for too (``SamplingFlags.of`` of their rows'
        parameters; each is one more decode program per row count and window).
        """
        from dflash_jax.runtime.warmup import compiles_prefill, run_warmup, warmup_plan

        t0 = time.perf_counter()
        plan = warmup_plan(self, batch_sizes, sampling=sampling)
        decodes = [s for s in plan if s.phase == "decode"]
        prefills = [s for s in plan if compiles_prefill(self, s)]
        # Minutes for a large model (or on a CPU) with nothing else to show for them: say what is compiling.
        log.info("warm-up: compiling decode for running states of %s rows at %d attention windows",
                 sorted({s.rows for s in decodes}), len(self.windows))
        workers = max(1, min(threads or min(8, os.cpu_count() or 1), len(prefills)))

        def progress(index: int, shape) -> None:
            if compiles_prefill(self, shape) and index == len(decodes):
                rows = [s for s in prefills if s.phase == "prefill"]
                log.info("warm-up: decode compiled after %.1f s; compiling %d prefill shapes (a lone request's in %d "
                         "prompt buckets; %d prompt counts x %d prompt buckets, and %d of one prompt's n choices, for "
                         "the batch) on %d threads", time.perf_counter() - t0, len(prefills),
                         len(prefills) - len(rows), len({s.rows for s in rows}), len({s.size for s in rows}),
                         sum(1 for s in rows if s.distinct), workers)
            elif index == len(decodes) + len(prefills):
                log.info("warm-up: prefills compiled after %.1f s; compiling the admissions, resizes and releases",
                         time.perf_counter() - t0)

        # decode first, alone: its autotuning undisturbed; then the prefills, on several threads
        plan = decodes + prefills + [s for s in plan if s.phase != "decode" and not compiles_prefill(self, s)]
        run_warmup(self, plan, threads=workers, on_shape=progress)
        return time.perf_counter() - t0

    # -- host side -----------------------------------------------------------------------------

    def _prompt_bucket(self, n: int) -> int:
        buckets = self.config.prompt_buckets
        if buckets is None:
            bucket = max(16, _next_pow2(n))
        else:
            fitting = [b for b in sorted(buckets) if b >= n]
            if not fitting:
                raise ValueError(f"prompt of {n} tokens exceeds the largest prompt bucket {max(buckets)}")
            bucket = fitting[0]
        return min(bucket, self.capacity)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        stop_token_ids: Sequence[int] | None = None,
        on_tokens: Callable[[int, list[int]], None] | None = None,
        on_done: Callable[[int, GenerationResult], None] | None = None,
        stop_checks: Sequence[StopCheck | None] | None = None,
        sampling: SamplingParams | Sequence[SamplingParams | None] | None = None,
    ) -> list[GenerationResult]:
        """Generation for every prompt (token-id lists) through ``max_batch_size`` row slots:
        a prompt takes the first row that frees, so more prompts than slots flow through continuously.
        ``sampling``: None (greedy), one ``SamplingParams`` for every prompt, or one per prompt (None:
        greedy); a sampled prompt without a seed gets a random one.

        ``on_tokens(index, new_ids)`` is called at every host sync with the tokens committed for
        prompt ``index`` since the previous call (streaming); ``on_done(index, result)`` when prompt
        ``index`` finishes. ``stop_checks``: one per prompt (or None), each ending its generation on
        the host (``dflash_jax.runtime.batcher.StopCheck``; stop strings: ``dflash_jax.serving.text_stream.TextStream.add``).
        """
        if np.ndim(max_new_tokens) == 0:  # one value for every prompt (numpy's integers too; submit checks it)
            max_new = [max_new_tokens] * len(prompts)
        else:
            max_new = list(max_new_tokens)
            if len(max_new) != len(prompts):
                raise ValueError(f"max_new_tokens has {len(max_new)} entries for {len(prompts)} prompts")

        def finished(index: int, generation: Generation) -> None:
            if generation.result is not None:
                on_done(index, generation.result)

        checks = stop_checks_per_prompt(stop_checks, len(prompts))
        params = smp.resolve(sampling, len(prompts))
        batcher = ContinuousBatcher(self)
        generations = [
            batcher.submit(p, m, stop_token_ids, name=f"prompt {i}", stop_check=check, sampling=sp,
                           on_tokens=None if on_tokens is None else functools.partial(on_tokens, i),
                           on_finish=None if on_done is None else functools.partial(finished, i))
            for i, (p, m, check, sp) in enumerate(zip(prompts, max_new, checks, params))
        ]
        batcher.run()
        for generation in generations:
            if generation.error is not None:
                raise generation.error
        return [generation.result for generation in generations]

    def _put(self, x: np.ndarray, axes: tuple[str, ...]) -> jax.Array:
        """``x`` on the device, or on the mesh laid out by its logical ``axes``: placed as the jitted
        phases take it, since an argument the jit must move first takes jax's slower argument path on
        every call (a decode call on the 2x H200 took it for one argument, ~0.2 ms; the step count was
        the only one not on the mesh). A plain transfer: ``jnp.asarray`` runs a small XLA program per
        array."""
        if self.mesh is None:
            return jax.device_put(x)
        return jax.device_put(x, named_sharding(axes, x.shape, self.mesh, self._rules))

    def _batch_arguments(self, tree):
        """Every array of ``tree`` (a numpy array or a pytree of them, each batch-major) as the jitted
        phases take it: on a mesh placed with axes ``("batch", "length", ...)`` in one transfer call (an
        argument the jit must move first takes its slower argument path); on one device left on the host,
        for the jit's own argument transfer, which costs the host a few microseconds an array where a
        ``device_put`` costs tens (a prefill passes ~18: its dispatch took 0.7 ms of host time instead of
        1.5 with the embedded pair on 2 CPU cores)."""
        if self.mesh is None:
            return tree
        shardings = jax.tree.map(
            lambda x: named_sharding(("batch",) + ("length",) * (x.ndim - 1), x.shape, self.mesh, self._rules), tree)
        return jax.device_put(tree, shardings)


def generate(target: Target, drafter: Drafter | None, prompts, max_new_tokens, stop_token_ids=None,
             block_size: int | None = None, sampling=None, **config) -> list[GenerationResult]:
    """One-call batched generation (``drafter=None``: target-only; ``sampling`` as in
    ``Engine.generate``, default greedy). See ``Engine.generate``.
    Builds, and so compiles, a new ``Engine`` on every call: for more than one call, build an
    ``Engine`` once and call its ``generate`` (six prompts of the embedded pair on the CPU: 60 s as
    twelve one-prompt calls of this function, 9 s as one batch through two engines)."""
    prompts = list(prompts)  # a generator or an array too
    if not prompts:
        return []
    try:
        lengths = [len(p) for p in prompts]
    except TypeError:
        raise TypeError("prompts must be a list of token-id lists, one per prompt (e.g. [[1, 2, 3]])") from None
    news = [max_new_tokens] if np.ndim(max_new_tokens) == 0 else list(max_new_tokens)
    # Room for at least one new token (and EngineConfig's minimum of 2): from a value below 1 or not an
    # integer, or an empty prompt, the engine was refused (max_length < 2 or shorter than the prompt)
    # before Engine.generate could name the bad value and its prompt.
    most_new = max((n for n in news if isinstance(n, (int, np.integer))), default=1)
    # At most the target's positions: a row then stops there, as at any max_length.
    config.setdefault("max_length", min(target.config.max_position_embeddings,
                                        max(2, max(lengths) + max(1, int(most_new)))))
    config.setdefault("max_batch_size", max(1, len(prompts)))
    engine = Engine(target, drafter, EngineConfig(block_size=block_size, **config))
    return engine.generate(prompts, max_new_tokens, stop_token_ids, sampling=sampling)
