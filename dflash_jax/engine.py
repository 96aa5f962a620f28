"""The batched greedy speculative-decoding engine: host scheduling around jitted device phases.

Two jitted functions per engine: ``prefill`` and ``decode`` (a ``lax.while_loop`` of up to
``steps_per_sync`` draft-verify-commit steps). The state is donated to every call. The host keeps
one call in flight ahead of the one it reads, so the device never waits for Python between syncs.
Shapes are static: batch and prompt length are bucketed; block size and capacity are fixed per engine.
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

    def validate(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.attention_impl not in ("xla", "pallas", "auto"):
            raise ValueError(f"attention_impl must be 'xla', 'pallas' or 'auto', got {self.attention_impl!r}")
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
        if self.mesh is not None:
            shard_module(target, self.mesh, self._rules)
            if drafter is not None:
                shard_module(drafter, self.mesh, self._rules)
        # Model state is split once; jitted phases take the state leaves and merge inside.
        self._target_def, self._target_state = nnx.split(target)
        self._drafter_def, self._drafter_state = (nnx.split(drafter) if drafter is not None else (None, None))
        self._prefill = jax.jit(self._prefill_fn)
        self._decode = jax.jit(self._decode_fn, donate_argnums=(2,))
        self._mask_id = drafter.config.mask_token_id if drafter is not None else 0

    # -- jitted phases -------------------------------------------------------------------------

    def _models(self, target_state, drafter_state):
        target = nnx.merge(self._target_def, target_state)
        drafter = nnx.merge(self._drafter_def, drafter_state) if self._drafter_def is not None else None
        return target, drafter

    def _prefill_fn(self, target_state, drafter_state, ids, lens, max_lens, stop_ids):
        target, drafter = self._models(target_state, drafter_state)
        # Every step commits >= 1 token, so max_length bounds the steps of any row.
        state = decoding.prefill(target, drafter, ids, lens, max_lens, stop_ids, capacity=self.capacity,
                                 max_steps=self.config.max_length, mask_token_id=self._mask_id)
        return self._constrain(state)

    def _decode_fn(self, target_state, drafter_state, state, stop_ids, n_steps):
        target, drafter = self._models(target_state, drafter_state)
        impl = self.attention_impl

        def step(s):
            if drafter is None:
                return decoding.target_only_step(target, s, stop_ids, attention_impl=impl)
            return decoding.speculative_step(target, drafter, s, stop_ids, block_size=self.block_size,
                                             attention_impl=impl)

        def cond(carry):
            i, s = carry
            return (i < n_steps) & ~jnp.all(s.done)

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

    def decode(self, state: decoding.DecodeState, stop_ids: jax.Array, n_steps: int | None = None):
        """Up to ``n_steps`` (default ``steps_per_sync``) decode steps on device; donates ``state``.

        Returns the new state and a ``(tokens, starts, done)`` snapshot that stays readable after the
        state is donated to the next call.
        """
        steps = jnp.int32(self.config.steps_per_sync if n_steps is None else n_steps)
        return self._decode(self._target_state, self._drafter_state, state, stop_ids, steps)

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

        Decode shapes do not depend on the prompt, so one call per batch bucket covers every decode;
        prefill compiles once more per new prompt bucket.
        """
        t0 = time.perf_counter()
        sizes = sorted({1, self.config.max_batch_size} if batch_sizes is None else set(batch_sizes))
        for size in sizes:
            self.generate([[0]] * size, 2)
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
        initial = np.asarray(state.done)
        first_tokens = np.asarray(state.tokens[:n]) if on_tokens is not None else None
        if on_tokens is not None:
            for i in range(n):
                on_tokens(i, [int(first_tokens[i, lens[i]])])
                emitted[i] += 1
        for i in range(n):
            if initial[i]:
                finish_time[i] = t_first

        state, snap = self.decode(state, stop_arr)
        while True:
            state, next_snap = self.decode(state, stop_arr)
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
