"""The batched greedy speculative-decoding engine: host scheduling around jitted device phases.

Two jitted functions per engine: ``prefill`` and ``decode`` (a ``lax.while_loop`` of up to
``steps_per_sync`` draft-verify-commit steps). The state is donated to every call. The host keeps
one call in flight ahead of the one it reads, so the device never waits for Python between syncs.
Shapes are static: batch and prompt length are bucketed; block size and capacity are fixed per engine;
with the XLA attention each decode call reads a power-of-two window of the caches that covers its rows.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dflash_jax import decoding
from dflash_jax.cache import CACHE_AXES
from dflash_jax.drafter import Drafter
from dflash_jax.layers import fuse_projections
from dflash_jax.sharding import MeshConfig, make_mesh, named_sharding, shard_module
from dflash_jax.target import Target


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static shapes and scheduling of an engine (a section of serve/train YAML configs)."""

    max_batch_size: int = 8
    max_length: int = 2048           # prompt + generated tokens, per row
    prompt_buckets: tuple[int, ...] | None = None  # None: powers of two from 16
    block_size: int | None = None    # None: the drafter's; may only lower it
    attention_impl: str = "auto"     # "xla" | "pallas" | "auto": pallas on one GPU/TPU, else xla
    steps_per_sync: int = 8          # decode steps per device call between host syncs
    mesh: MeshConfig | None = None   # None: a single device
    # "auto": "highest" for float32 weights, else "default". GPUs and TPUs run default-precision
    # float32 matmuls through TF32 / bf16 passes, whose rounding differs between a 1-token and a
    # 16-token pass enough to flip near-tied greedy choices; "highest" keeps float32 models exact.
    matmul_precision: str = "auto"

    def validate(self) -> None:
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
        if self.steps_per_sync < 1:
            raise ValueError(f"steps_per_sync must be >= 1, got {self.steps_per_sync}")
        if self.prompt_buckets is not None and (not self.prompt_buckets or min(self.prompt_buckets) < 1):
            raise ValueError(f"prompt_buckets must be positive lengths, got {self.prompt_buckets}")


@dataclasses.dataclass
class GenerationResult:
    output_ids: list[int]            # generated tokens only (prompt excluded)
    acceptance_lengths: list[int]    # acc + 1 per decode step (cut at stop / max length)
    num_prompt_tokens: int
    finish_reason: str               # "stop" | "length"
    time_to_first_token: float       # seconds (the batch's prefill)
    time_per_output_token: float     # seconds: decode time / generated tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens committed per decode step (1.0 for target-only decoding)."""
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 1.0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _decode_compiler_options() -> dict | None:
    """XLA options for the decode loop on this backend.

    XLA:CPU's default copy insertion copies every target-cache buffer twice per decode step (the
    while-loop carry is read by attention and updated in place within one step), which costs more
    than a small model's attention itself; its region analysis proves the in-place update safe and
    removes the copies. Other backends keep their defaults.
    """
    if jax.default_backend() == "cpu":
        return {"xla_cpu_copy_insertion_use_region_analysis": True}
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
    """Batched greedy generation with an optional DFlash drafter (``drafter=None``: target-only)."""

    def __init__(self, target: Target, drafter: Drafter | None, config: EngineConfig = EngineConfig(),
                 mesh: Mesh | None = None):
        config.validate()
        self.config = config
        self.target, self.drafter = target, drafter
        if drafter is not None:
            if drafter.config.vocab_size != target.config.vocab_size:
                raise ValueError(f"drafter vocab_size {drafter.config.vocab_size} != target vocab_size "
                                 f"{target.config.vocab_size}")
            if drafter.config.num_target_layers != target.config.num_layers:
                raise ValueError(f"drafter num_target_layers {drafter.config.num_target_layers} != target "
                                 f"num_hidden_layers {target.config.num_layers}")
            if config.block_size is not None and config.block_size > drafter.config.block_size:
                raise ValueError(f"block_size {config.block_size} exceeds the drafter's {drafter.config.block_size}")
        self.block_size = (config.block_size or drafter.config.block_size) if drafter is not None else 1
        self.capacity = config.max_length + self.block_size
        self.mesh = mesh if mesh is not None else (make_mesh(config.mesh) if config.mesh is not None else None)
        sharded = self.mesh is not None and self.mesh.size > 1
        if sharded and config.attention_impl == "pallas":
            raise ValueError("attention_impl='pallas' runs on one device only for now (the kernel is not "
                             "wrapped in shard_map yet); use attention_impl='xla' with a mesh")
        self.attention_impl = config.attention_impl
        if self.attention_impl == "auto":
            on_accelerator = jax.default_backend() in ("gpu", "tpu")
            self.attention_impl = "pallas" if on_accelerator and not sharded else "xla"
        self._rules = config.mesh.resolved_rules() if config.mesh is not None else None
        # The serving layout: one QKV and one gate-up matmul per target layer (in place; see
        # ``layers.fuse_projections``). The drafter keeps its separate projections: its context
        # K/V are projected apart from its queries, so a fused weight would be read twice.
        fuse_projections(target)
        self._matmul_precision = config.matmul_precision
        if self._matmul_precision == "auto":
            self._matmul_precision = "highest" if target.embed_tokens.dtype == jnp.float32 else "default"
        if self.mesh is not None:
            shard_module(target, self.mesh, self._rules)
            if drafter is not None:
                shard_module(drafter, self.mesh, self._rules)
        # Model state is split and flattened once: the jitted phases take plain tuples of arrays
        # (flattening NNX variables on every call costs more host time than a small model's step)
        # and rebuild the modules inside.
        self._target_def, target_state = nnx.split(target)
        self._target_state, self._target_tree = jax.tree.flatten(target_state)
        self._drafter_def, self._drafter_state, self._drafter_tree = None, [], None
        if drafter is not None:
            self._drafter_def, drafter_state = nnx.split(drafter)
            self._drafter_state, self._drafter_tree = jax.tree.flatten(drafter_state)
        self._prefill = jax.jit(self._precise(self._prefill_fn))
        self._decode = jax.jit(self._precise(self._decode_fn), donate_argnums=(2,), static_argnames=("window",),
                               compiler_options=_decode_compiler_options())
        self._mask_id = drafter.config.mask_token_id if drafter is not None else 0
        # The XLA attention computes over every cache position it is given, so decode calls read a
        # bucketed prefix of the caches that covers the live rows; the Pallas kernels skip positions
        # past each row's length themselves and always get the whole cache (one compiled variant).
        self.windows = (window_buckets(self.capacity) if self.attention_impl == "xla" else (self.capacity,))
        self._n_steps: dict[int, jax.Array] = {}

    # -- jitted phases -------------------------------------------------------------------------

    def _precise(self, fn: Callable) -> Callable:
        """``fn`` traced under the engine's matmul precision (it is baked into the compiled ops)."""

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            with jax.default_matmul_precision(self._matmul_precision):
                return fn(*args, **kwargs)

        return traced

    def _models(self, target_leaves, drafter_leaves):
        target = nnx.merge(self._target_def, jax.tree.unflatten(self._target_tree, target_leaves))
        drafter = None
        if self._drafter_def is not None:
            drafter = nnx.merge(self._drafter_def, jax.tree.unflatten(self._drafter_tree, drafter_leaves))
        return target, drafter

    def _prefill_fn(self, target_state, drafter_state, ids, lens, max_lens, stop_ids):
        target, drafter = self._models(target_state, drafter_state)
        # Every step commits >= 1 token, so max_length bounds the steps of any row.
        state = decoding.prefill(target, drafter, ids, lens, max_lens, stop_ids, capacity=self.capacity,
                                 max_steps=self.config.max_length, mask_token_id=self._mask_id)
        return self._constrain(state)

    def _decode_fn(self, target_state, drafter_state, state, stop_ids, n_steps, *, window: int):
        target, drafter = self._models(target_state, drafter_state)
        impl = self.attention_impl

        def step(s):
            if drafter is None:
                return decoding.target_only_step(target, s, stop_ids, attention_impl=impl, window=window)
            return decoding.speculative_step(target, drafter, s, stop_ids, block_size=self.block_size,
                                             attention_impl=impl, window=window)

        def cond(carry):
            i, s = carry
            # A row whose next block would not fit the window ends the call early (the host then
            # picks a larger window); the host's choice makes this a safety net, not the rule.
            fits = jnp.all(s.done | (s.starts + self.block_size <= window))
            return (i < n_steps) & ~jnp.all(s.done) & fits

        def body(carry):
            i, s = carry
            return i + 1, self._constrain(step(s))

        _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
        # A copy the host can read while the donated state is already in the next call.
        snapshot = (state.tokens + 0, state.starts + 0, state.done | False)
        return state, snapshot

    def _constrain(self, state: decoding.DecodeState) -> decoding.DecodeState:
        """Pins the state's layout on the mesh (batch on ``data``, caches on KV heads)."""
        if self.mesh is None:
            return state

        def pin(x, axes):
            return jax.lax.with_sharding_constraint(x, named_sharding(axes, x.shape, self.mesh, self._rules))

        def pin_cache(c):
            if c is None:
                return None
            return type(c)(tuple(pin(x, CACHE_AXES) for x in c.k), tuple(pin(x, CACHE_AXES) for x in c.v))

        return dataclasses.replace(
            state,
            tokens=pin(state.tokens, ("batch", "length")), starts=pin(state.starts, ("batch",)),
            max_lens=pin(state.max_lens, ("batch",)), done=pin(state.done, ("batch",)),
            num_steps=pin(state.num_steps, ("batch",)), accepted=pin(state.accepted, ("batch", "length")),
            target_cache=pin_cache(state.target_cache), draft_cache=pin_cache(state.draft_cache),
        )

    def decode(self, state: decoding.DecodeState, stop_ids: jax.Array, n_steps: int | None = None, *,
               window: int | None = None):
        """Up to ``n_steps`` (default ``steps_per_sync``) decode steps on device; donates ``state``.

        ``window``: the steps attend to the first ``window`` cache positions only, rounded up to
        ``self.windows``; the call stops early when a row that is not done would outgrow it. None:
        the whole cache.

        Returns the new state and a ``(tokens, starts, done)`` snapshot that stays readable after the
        state is donated to the next call.
        """
        n = self.config.steps_per_sync if n_steps is None else int(n_steps)
        if n not in self._n_steps:  # a cached device scalar: building one costs a dispatch per call
            self._n_steps[n] = jnp.int32(n)
        return self._decode(self._target_state, self._drafter_state, state, stop_ids, self._n_steps[n],
                            window=self._window(window))

    def _window(self, needed: int | None) -> int:
        """The smallest window bucket covering ``needed`` cache positions (None: the whole cache)."""
        if needed is None:
            return self.capacity
        return next((w for w in self.windows if w >= needed), self.capacity)

    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                stop_ids: np.ndarray) -> tuple[decoding.DecodeState, int]:
        """Buckets and runs the prompts of one batch; returns the state and the real row count."""
        n = len(prompts)
        if n > self.config.max_batch_size:
            raise ValueError(f"{n} prompts exceed max_batch_size={self.config.max_batch_size}")
        batch = min(_next_pow2(n), _next_pow2(self.config.max_batch_size))
        lens = [len(p) for p in prompts]
        plen = self._prompt_bucket(max(lens))
        ids = np.zeros((batch, plen), np.int32)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
        row_lens = np.ones((batch,), np.int32)
        row_lens[:n] = lens
        max_lens = np.ones((batch,), np.int32)  # padding rows: done at once
        max_lens[:n] = [min(l + m, self.config.max_length) for l, m in zip(lens, max_new_tokens)]
        put = self._put_batch
        state = self._prefill(self._target_state, self._drafter_state, put(ids), put(row_lens), put(max_lens),
                              jnp.asarray(stop_ids))
        return state, n

    def warmup(self, batch_sizes: Sequence[int] | None = None) -> float:
        """Compiles prefill (smallest prompt bucket) and decode for ``batch_sizes`` (default: 1 and
        ``max_batch_size``) so the first requests do not wait for XLA; returns the seconds spent.

        Decode shapes do not depend on the prompt: one variant per batch bucket and attention window
        covers every decode; prefill compiles once more per new prompt bucket.
        """
        t0 = time.perf_counter()
        sizes = sorted({1, self.config.max_batch_size} if batch_sizes is None else set(batch_sizes))
        stop_ids = np.full((8,), -1, np.int32)  # the size generate() uses for up to 8 stop ids
        for size in sizes:
            self.generate([[0]] * size, 2)
            state, _ = self.prefill([[0]] * size, [2] * size, stop_ids)
            for window in self.windows:
                state, _ = self.decode(state, jnp.asarray(stop_ids), n_steps=0, window=window)
            jax.block_until_ready(state.starts)
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
    ) -> list[GenerationResult]:
        """Greedy generation for every prompt (token-id lists); batches of ``max_batch_size``.

        ``on_tokens(index, new_ids)`` is called at every host sync with the tokens committed for
        prompt ``index`` since the previous call (streaming).
        """
        prompts = [list(map(int, p)) for p in prompts]
        if isinstance(max_new_tokens, int):
            max_new = [max_new_tokens] * len(prompts)
        else:
            max_new = list(max_new_tokens)
            if len(max_new) != len(prompts):
                raise ValueError(f"max_new_tokens has {len(max_new)} entries for {len(prompts)} prompts")
        vocab = self.target.config.vocab_size
        for i, (p, m) in enumerate(zip(prompts, max_new)):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) >= self.config.max_length:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the engine's max_length is "
                                 f"{self.config.max_length}")
            if m < 1:
                raise ValueError(f"max_new_tokens for prompt {i} must be >= 1, got {m}")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        results: list[GenerationResult] = []
        size = self.config.max_batch_size
        for lo in range(0, len(prompts), size):
            chunk = range(lo, min(lo + size, len(prompts)))
            callback = None
            if on_tokens is not None:
                callback = functools.partial(lambda base, row, ids: on_tokens(base + row, ids), lo)
            results.extend(self._generate_batch([prompts[i] for i in chunk], [max_new[i] for i in chunk],
                                                stop_token_ids, callback))
        return results

    def _generate_batch(self, prompts, max_new, stop_token_ids, on_tokens) -> list[GenerationResult]:
        lens = [len(p) for p in prompts]
        max_lens = [min(l + m, self.config.max_length) for l, m in zip(lens, max_new)]
        stops = sorted(set(int(s) for s in (stop_token_ids or ())))
        stop_ids = np.full((max(8, _next_pow2(len(stops))),), -1, np.int32)  # fixed size: no recompiles
        stop_ids[: len(stops)] = stops

        t0 = time.perf_counter()
        state, n = self.prefill(prompts, max_new, stop_ids)
        jax.block_until_ready(state.starts)
        t_first = time.perf_counter()
        ttft = t_first - t0

        emitted = list(lens)  # tokens of each row already reported to on_tokens
        finish_time = [None] * n
        stop_arr = jnp.asarray(stop_ids)
        per_call = self.config.steps_per_sync
        # Cache positions a call may touch: live rows start <= ``live`` (as of the last state read)
        # and advance <= B per step; a row is live only while start + 2 <= its max length.
        end = max(max_lens) - 2 + self.block_size

        def reach(live: int, steps: int) -> int:
            return min(live + steps * self.block_size, end)

        live = max(lens)
        initial = np.asarray(state.done)
        first_tokens = np.asarray(state.tokens[:n]) if on_tokens is not None else None
        if on_tokens is not None:
            for i in range(n):
                on_tokens(i, [int(first_tokens[i, lens[i]])])
                emitted[i] += 1
        for i in range(n):
            if initial[i]:
                finish_time[i] = t_first

        state, snap = self.decode(state, stop_arr, window=reach(live, per_call))
        while True:
            # Dispatched before reading ``snap``: the call that produced it may still be running.
            state, next_snap = self.decode(state, stop_arr, window=reach(live, 2 * per_call))
            tokens, starts, done = (np.asarray(x) for x in snap)
            now = time.perf_counter()
            if on_tokens is not None:
                for i in range(n):
                    upto = min(int(starts[i]) + 1, int(max_lens[i]))
                    if upto > emitted[i]:
                        on_tokens(i, tokens[i, emitted[i]:upto].tolist())
                        emitted[i] = upto
            for i in range(n):
                if done[i] and finish_time[i] is None:
                    finish_time[i] = now
            if done[:n].all():
                break
            live = max(int(starts[i]) for i in range(n) if not done[i])
            snap = next_snap
        jax.block_until_ready(state.starts)

        tokens = np.asarray(state.tokens)
        starts = np.asarray(state.starts)
        steps = np.asarray(state.num_steps)
        accepted = np.asarray(state.accepted)
        stop_set = set(stops)
        results = []
        for i in range(n):
            end = min(int(starts[i]) + 1, int(max_lens[i]))
            out = tokens[i, lens[i]:end].tolist()
            acc = accepted[i, : steps[i]].tolist() if self.drafter is not None else []
            finish = "stop" if out and out[-1] in stop_set else "length"
            decode_time = (finish_time[i] or time.perf_counter()) - t_first
            results.append(GenerationResult(
                output_ids=out, acceptance_lengths=acc, num_prompt_tokens=lens[i], finish_reason=finish,
                time_to_first_token=ttft, time_per_output_token=decode_time / max(1, len(out)),
            ))
        return results

    def _put_batch(self, x: np.ndarray) -> jax.Array:
        if self.mesh is None:
            return jnp.asarray(x)
        axes = ("batch",) + ("length",) * (x.ndim - 1)
        return jax.device_put(x, named_sharding(axes, x.shape, self.mesh, self._rules))


def generate(target: Target, drafter: Drafter | None, prompts, max_new_tokens, stop_token_ids=None,
             block_size: int | None = None, **config) -> list[GenerationResult]:
    """One-call batched greedy generation (``drafter=None``: target-only). See ``Engine.generate``."""
    lengths = [len(p) for p in prompts]
    most_new = max_new_tokens if isinstance(max_new_tokens, int) else max(max_new_tokens)
    config.setdefault("max_length", max(lengths) + most_new)
    config.setdefault("max_batch_size", max(1, len(prompts)))
    engine = Engine(target, drafter, EngineConfig(block_size=block_size, **config))
    return engine.generate(prompts, max_new_tokens, stop_token_ids)
