"""Pure, jittable pieces of batched greedy speculative decoding (one fused function per phase).

Per-row semantics follow ``dflash.model.dflash_generate`` exactly: a row of prompt length ``n`` and
``max_new_tokens`` m has ``max_len = n + m``; its anchor sits at ``start`` (tokens ``0..start-1``
are in both caches); each step drafts a block of ``valid = min(B, max_len - start)`` slots, verifies
it, accepts ``acc`` drafts plus the bonus, and commits ``produced = min(acc + 1, max_len - start - 1)``
tokens, cut after the first stop token. A row is done once a stop token is committed or
``start + 1 >= max_len``; done rows stop changing.

A running batch is a fixed number of row slots: ``empty_state`` makes them (every row done),
``scatter_rows`` writes freshly prefilled rows into free slots (or moves rows into a state of another
size) and ``release_rows`` ends rows early. Each row carries its own stop ids.

Sampled rows (``dflash_jax.runtime.sampling``): a state made with ``max_logprobs`` carries every row's
sampling parameters (``DecodeState.sampling``), and the phases take the batch's static
``SamplingFlags``; with the greedy flags (the default) every phase runs the greedy path unchanged.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dflash_jax import sharding
from dflash_jax.runtime import sampling as smp
from dflash_jax.runtime.sampling import SamplingFlags, SamplingState
from dflash_jax.ops.config import XLA, OpsConfig
from dflash_jax.ops.cache import KVCache, read_rows, read_window, write_all_layers, write_back, write_rows
from dflash_jax.ops.topk import top_k
from dflash_jax.models.dflash2 import DFlash2Drafter
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target
from dflash_jax.runtime import recurrent_state


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything a batch carries between steps; all per-row arrays lead with ``batch``.

    An empty row (a free slot) is done, has stop ids -1 and zeros everywhere else.
    """

    tokens: jax.Array           # [batch, token_capacity] int32: prompt + committed tokens
    starts: jax.Array           # [batch] int32: the anchor position (= tokens in the caches)
    max_lens: jax.Array         # [batch] int32: prompt length + max_new_tokens
    done: jax.Array             # [batch] bool
    num_steps: jax.Array        # [batch] int32: decode steps taken by each row
    accepted: jax.Array         # [batch, max_steps] int32: tokens committed per step (acc + 1, cut)
    stop_ids: jax.Array         # [batch, n_stop] int32: the row's stop token ids, -1 pads
    target_cache: KVCache
    draft_cache: KVCache | None
    sampling: SamplingState | None = None  # None: every row greedy, no logprobs
    # A paged state (``dflash_jax.runtime.paged``): the caches are page pools and this maps each row's
    # positions to pages, [batch, max_pages] int32. None: the caches are per row.
    page_table: jax.Array | None = None


GREEDY_FLAGS = SamplingFlags()


def greedy_argmax(logits: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, axis=-1)`` as int32: the first index of the maximum (a NaN counts as the
    maximum, as in ``jnp.argmax``), over ``logits [batch, ..., vocab]``.

    Under ``sharding.kernel_mesh`` with the vocabulary split across devices, each device takes the
    argmax of its slice and the devices exchange one (value, index) pair per row: XLA partitions
    ``jnp.argmax`` over a sharded axis by gathering every row's whole logits first (600 KB per row
    for Qwen3-8B's vocabulary in float32; docs/performance.md).
    """
    axes = ("batch",) + ("length",) * (logits.ndim - 2) + ("vocab",)
    across = sharding.kernel_mesh_axes(axes, logits.shape, -1)
    argmax = functools.partial(_argmax_across, vocab_axes=across)
    shape = lambda x: (jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32),)  # noqa: E731
    return sharding.shard_kernel(argmax, [axes], [axes[:-1]], out_shapes=shape)(logits)[0]


def _argmax_across(logits: jax.Array, *, vocab_axes: tuple[str, ...]) -> tuple[jax.Array]:
    """Per device: the argmax of this vocabulary slice, then (``vocab_axes``: the mesh axes the
    vocabulary is split over) the first slice holding the overall maximum."""
    local = _local_argmax(logits)
    if not vocab_axes:
        return (local,)
    value = jnp.take_along_axis(logits, local[..., None], axis=-1)[..., 0]
    index = local + jax.lax.axis_index(vocab_axes) * logits.shape[-1]
    values, indices = (jax.lax.all_gather(x, vocab_axes) for x in (value, index))  # [slices, batch, ...]
    best = jnp.argmax(values, axis=0)  # the first slice with the maximum (or the first NaN)
    return (jnp.take_along_axis(indices, best[None], axis=0)[0],)


def _local_argmax(logits: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, axis=-1)`` as int32: on GPUs XLA's one (value, index) reduction, elsewhere
    ``_argmax_two_stage``. Written for XLA:CPU, the two stages are four kernels on a GPU and cost a
    batch-1 decode step 0.013 ms there (docs/performance.md)."""
    if jax.default_backend() == "gpu":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return _argmax_two_stage(logits)


def _argmax_two_stage(logits: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, axis=-1)`` as int32, reduced in two stages when the vocabulary splits
    into power-of-two slices (128 .. 16 wide): the maximum of each slice, the first slice holding
    the overall maximum, the first maximum inside it. Same result; XLA:CPU runs a (value, index)
    reduce over a long row as scalar code, several times slower than the plain max-reduce that now
    does most of the work."""
    vocab = logits.shape[-1]
    width = next((w for w in (128, 64, 32, 16) if vocab % w == 0 and vocab > w), None)
    if width is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    parts = logits.reshape(logits.shape[:-1] + (vocab // width, width))
    part = jnp.argmax(jnp.max(parts, axis=-1), axis=-1)
    row = jnp.take_along_axis(parts, part[..., None, None], axis=-2)[..., 0, :]
    return (part * width + jnp.argmax(row, axis=-1)).astype(jnp.int32)


def greedy_accept(draft: jax.Array, posterior: jax.Array, valid: jax.Array) -> jax.Array:
    """Number of leading drafts equal to the target's argmax at the previous slot.

    ``draft [batch, B-1]`` (slots 1..B-1), ``posterior [batch, B]`` (target argmax per slot),
    ``valid [batch]`` (slots of the block that exist) -> ``acc [batch]`` int32 in ``[0, valid - 1]``.
    """
    # This and the commit's helpers below run once per step, outside the models: over the block's
    # static slots, as elementwise ops, they fuse into the commit's few kernels instead of adding a
    # scan or a reduction kernel each (docs/performance.md).
    acc = jnp.zeros(valid.shape, jnp.int32)
    leading = jnp.ones(valid.shape, bool)
    for slot in range(1, draft.shape[1] + 1):
        leading = leading & (draft[:, slot - 1] == posterior[:, slot - 1]) & (slot < valid)
        acc = acc + leading
    return acc


def is_stop(ids: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """Whether each of ``ids [batch, n]`` is one of its row's ``stop_ids [batch, n_stop]`` -> ``[batch, n]``."""
    hit = jnp.zeros(ids.shape, bool)
    for k in range(stop_ids.shape[1]):
        hit = hit | (ids == stop_ids[:, k:k + 1])
    return hit


def commit(
    state: DecodeState, block_ids: jax.Array, posterior: jax.Array, acc: jax.Array
) -> tuple[DecodeState, jax.Array]:
    """Writes the accepted drafts and the bonus token, advances rows, records the step.

    ``block_ids [batch, B]`` (anchor then drafts), ``posterior [batch, B]``, ``acc [batch]``; a row
    stops at the first of its own ``state.stop_ids``. Returns the new state (caches untouched) and
    ``produced``.
    """
    batch, block = block_ids.shape
    active = ~state.done
    bonus = posterior[:, 0]
    for slot in range(1, block):
        bonus = jnp.where(acc == slot, posterior[:, slot], bonus)
    # The tokens after the anchor (already at ``start``): slot j + 1 of the block, the bonus at
    # slot acc + 1. Only slots up to acc + 1 of an active row change.
    drafts = jnp.concatenate([block_ids[:, 1:], jnp.zeros((batch, 1), block_ids.dtype)], axis=1)
    slot = jnp.arange(block)[None, :]
    new = jnp.where(slot == acc[:, None], bonus[:, None], drafts)
    after = state.starts + 1
    old = read_rows(state.tokens, after, block)
    tokens = write_rows(state.tokens, jnp.where(active[:, None] & (slot <= acc[:, None]), new, old), after)

    produced = jnp.minimum(acc + 1, state.max_lens - state.starts - 1)
    stops = is_stop(new, state.stop_ids) & (slot < produced[:, None])
    first_stop = jnp.full((batch,), block + 1, jnp.int32)
    for j in reversed(range(block)):
        first_stop = jnp.where(stops[:, j], j + 1, first_stop)
    has_stop = first_stop <= block
    produced = jnp.where(has_stop, first_stop, produced)
    produced = jnp.where(active, produced, 0).astype(jnp.int32)
    starts = state.starts + produced
    done = state.done | has_stop | (starts + 1 >= state.max_lens)

    # A row's next free column, clamped: rows commit >= 1 token a step, so a row never takes more
    # than max_length - 1 steps and the column is free even for a done row, which writes its 0 there.
    step_col = jnp.minimum(state.num_steps, state.accepted.shape[1] - 1)
    accepted = write_rows(state.accepted, produced[:, None], step_col)
    new_state = dataclasses.replace(
        state, tokens=tokens, starts=starts, done=done, accepted=accepted,
        num_steps=state.num_steps + active.astype(jnp.int32),
    )
    return new_state, produced


def new_caches(target: Target, drafter: Drafter | None, batch: int, length: int) -> tuple[KVCache, KVCache | None]:
    """Zeroed target and drafter-context caches of ``length`` positions (no drafter: no context cache)."""
    target_cache = recurrent_state.new_target_cache(target, batch, length)
    if drafter is None:
        return target_cache, None
    dc = drafter.config
    return target_cache, KVCache.zeros(dc.num_layers, batch, length, dc.num_kv_heads, dc.head_dim, drafter.dtype)


def empty_state(target: Target, drafter: Drafter | None, batch: int, *, capacity: int, max_steps: int,
                n_stop: int, max_logprobs: int | None = None) -> DecodeState:
    """``batch`` empty row slots (all done) with ``capacity``-position caches, to admit rows into.

    ``max_logprobs``: None, a state of greedy rows only; else one with (greedy) sampling parameters,
    keeping up to this many top logprobs per token."""
    target_cache, draft_cache = new_caches(target, drafter, batch, capacity)
    zeros = jnp.zeros((batch,), jnp.int32)
    sampling = None
    if max_logprobs is not None:
        arrays = smp.row_arrays([], batch, target.config.vocab_size, [])
        sampling = smp.new_state({k: jnp.asarray(v) for k, v in arrays.items()}, capacity=capacity,
                                 max_logprobs=max_logprobs)
    return DecodeState(
        tokens=jnp.zeros((batch, capacity + 1), jnp.int32), starts=zeros, max_lens=zeros,
        done=jnp.ones((batch,), bool), num_steps=zeros, accepted=jnp.zeros((batch, max_steps), jnp.int32),
        stop_ids=jnp.full((batch, n_stop), -1, jnp.int32), target_cache=target_cache, draft_cache=draft_cache,
        sampling=sampling,
    )


def prefill(target: Target, drafter: Drafter | None, ids: jax.Array, lens: jax.Array, max_lens: jax.Array,
            stop_ids: jax.Array, *, flags: SamplingFlags = GREEDY_FLAGS, candidates: int = 0,
            **pass_options) -> DecodeState:
    """``prefill_pass`` (its keyword arguments ``pass_options``) and, unless ``flags`` are greedy,
    ``draw_first`` in one: the prompts' rows with their first token drawn as ``flags`` say (the engine
    runs the two as programs of their own)."""
    rows, last_logits = prefill_pass(target, drafter, ids, lens, max_lens, stop_ids, **pass_options)
    if flags.greedy:
        return rows
    return draw_first(rows, last_logits, flags=flags, candidates=candidates)[0]


def prefill_pass(
    target: Target,
    drafter: Drafter | None,
    ids: jax.Array,
    lens: jax.Array,
    max_lens: jax.Array,
    stop_ids: jax.Array,
    *,
    capacity: int,
    max_steps: int,
    mask_token_id: int,
    ops: OpsConfig = XLA,
    sampling: dict[str, jax.Array] | None = None,
    max_logprobs: int = 0,
    source: jax.Array | None = None,
    prompt_logprobs: jax.Array | None = None,
) -> tuple[DecodeState, jax.Array]:
    """Runs the padded prompts ``ids [batch, P]`` (lengths ``lens``, stop ids ``stop_ids [batch, n_stop]``)
    -> ``(rows, last_logits [batch, vocab])``: the rows with the greedy first token (the argmax of the
    target's logits after each row's last prompt token, ``last_logits``), which ``draw_first`` redraws
    for rows that sample. The draw is a program of its own in the engine: its processors are the same
    for every prompt bucket, so compiled into each bucket's prefill they would be compiled once per
    bucket (and on a CPU, XLA's JIT maps each program's kernels into the process: a server's prefills
    would take half of the memory mappings Linux allows a process). With the kernels on (``ops``) the prompt's attention is a library's
    flash attention (``attention.prompt_attention``).

    Fills the target cache with the prompt, the drafter's context cache with the prompt's taps, and
    commits the target's argmax after each row's last prompt token. Rows hold ``capacity + 1``
    tokens, as in a running state of ``capacity`` cache positions, but the caches hold just the P
    prompt positions: ``scatter_rows`` writes them over the first positions of free slots.

    ``sampling``: the rows' parameters (``sampling.row_arrays``), for a state with a ``SamplingState``
    (``max_logprobs`` top logprobs per token).

    ``source [rows]``: rows sharing a prompt (``n`` > 1 choices of one request). ``ids`` and ``lens`` are
    then the distinct prompts, run once each, and row r of the result is prompt ``source[r]``'s pass (its
    caches and last logits copied) with row r's own ``max_lens``, ``stop_ids``, sampling and first draw.

    ``prompt_logprobs [rows]`` (bool, per result row): the rows whose prompt tokens' logprobs are
    recorded too, from this pass (``record_prompt_logprobs``).
    """
    batch, plen = ids.shape
    tap_layers = drafter.config.target_layer_ids if drafter is not None else ()
    target_cache, draft_cache = new_caches(target, drafter, batch, plen)
    zeros = jnp.zeros((batch,), jnp.int32)
    hidden, taps, target_cache = target.step(ids, zeros, target_cache, blk_lens=lens, tap_layers=tap_layers,
                                             ops=ops, prefill=True)
    last = jnp.take_along_axis(hidden, (lens - 1)[:, None, None], axis=1)[:, 0]
    if drafter is not None:
        k, v = drafter.context_kv(taps, jnp.broadcast_to(jnp.arange(plen, dtype=jnp.int32), (batch, plen)))
        draft_cache = write_all_layers(draft_cache, k, v, zeros)
    entries = None
    if prompt_logprobs is not None:
        entries = prompt_entries(target, hidden, ids, jnp.any(prompt_logprobs), max_logprobs)
    if source is not None:  # the distinct prompts' pass, copied to the rows that share each
        last, ids, lens, target_cache, draft_cache, entries = jax.tree.map(
            lambda x: x[source], (last, ids, lens, target_cache, draft_cache, entries))
    last_logits = target.head(last)
    rows = prompt_rows(last_logits, ids, lens, max_lens, stop_ids, capacity=capacity, max_steps=max_steps,
                       mask_token_id=mask_token_id, sampling=sampling, max_logprobs=max_logprobs)
    if entries is not None:
        rows = record_prompt_logprobs(rows, entries, zeros if source is None else zeros[source], prompt_logprobs)
    return dataclasses.replace(rows, target_cache=target_cache, draft_cache=draft_cache), last_logits


# Positions (summed over rows) per pass of the head for prompt logprobs: a [64, vocab] float32 block, in the
# memory of every prefill program (a conditional's branches share its peak).
PROMPT_LOGPROB_POSITIONS = 64


def prompt_entries(target: Target, hidden: jax.Array, block_ids: jax.Array, wanted: jax.Array, top: int,
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The prompt logprobs a prefill's ``hidden [b, n, H]`` over ``block_ids [b, n]`` gives: entry j is the
    log-softmax of the target's raw logits after token j at token j + 1 of the block, and the ``top``
    best -> ``(logprob [b, n], top_ids [b, n, top], top_logprobs [b, n, top])`` (the last entry, and any
    past a row's prompt, read nothing meaningful). Computed only when ``wanted`` (a device bool; zeros
    otherwise), the head over ``PROMPT_LOGPROB_POSITIONS`` positions of all rows at a time: a whole
    prompt's logits are n x vocab floats per row."""
    b, n, width = hidden.shape
    chunk = min(max(1, PROMPT_LOGPROB_POSITIONS // b), n)
    pad = -n % chunk
    nxt = jnp.pad(block_ids[:, 1:], ((0, 0), (0, pad + 1)))

    def compute(_):
        h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, -1, chunk, width).swapaxes(0, 1)
        t = nxt.reshape(b, -1, chunk).swapaxes(0, 1)

        def one(args):
            hh, tt = args
            lp, ids, vals = smp.logprobs_of(target.head(hh.reshape(b * chunk, width)), tt.reshape(-1), top)
            return lp.reshape(b, chunk), ids.reshape(b, chunk, top), vals.reshape(b, chunk, top)

        out = jax.lax.map(one, (h, t))
        return tuple(x.swapaxes(0, 1).reshape((b, n + pad) + x.shape[3:])[:, :n] for x in out)

    def skip(_):
        return (jnp.zeros((b, n), jnp.float32), jnp.zeros((b, n, top), jnp.int32), jnp.zeros((b, n, top), jnp.float32))

    return jax.lax.cond(wanted, compute, skip, None)


def record_prompt_logprobs(rows: DecodeState, entries: tuple[jax.Array, jax.Array, jax.Array], first: jax.Array,
                           want: jax.Array) -> DecodeState:
    """Writes ``prompt_entries`` of blocks starting at prompt positions ``first [b]`` into the prefilled
    ``rows``' logprob buffers, at the position of the token each entry is about (``first + j + 1``, before
    the row's length), for the rows where ``want [b]``."""
    lp, ids, vals = entries
    s = rows.sampling
    b, n = lp.shape
    positions = first[:, None] + 1 + jnp.arange(n)[None, :]
    keep = want[:, None] & (positions < rows.starts[:, None])
    positions = jnp.where(keep, positions, s.logprob.shape[1])  # out of range: dropped
    index = jnp.broadcast_to(jnp.arange(b)[:, None], positions.shape)
    k = min(ids.shape[-1], s.top_ids.shape[-1])
    return dataclasses.replace(rows, sampling=dataclasses.replace(
        s, logprob=s.logprob.at[index, positions].set(lp, mode="drop"),
        top_ids=s.top_ids.at[index, positions, :k].set(ids[..., :k], mode="drop"),
        top_logprobs=s.top_logprobs.at[index, positions, :k].set(vals[..., :k], mode="drop")))


def prompt_rows(
    last_logits: jax.Array,
    ids: jax.Array,
    lens: jax.Array,
    max_lens: jax.Array,
    stop_ids: jax.Array,
    *,
    capacity: int,
    max_steps: int,
    mask_token_id: int,
    sampling: dict[str, jax.Array] | None = None,
    max_logprobs: int = 0,
) -> DecodeState:
    """The rows of a prefill after the target's pass over the prompts ``ids [batch, P]`` (lengths
    ``lens``): the greedy first token (the argmax of ``last_logits [batch, vocab]``, the target's logits
    after each row's last prompt token; ``draw_first`` redraws sampled rows'), the tokens, stop ids and
    sampling state; no caches (``prefill_pass``'s arguments)."""
    batch, plen = ids.shape
    zeros = jnp.zeros((batch,), jnp.int32)
    sampling_state = None
    if sampling is not None:
        sampling_state = smp.new_state(sampling, capacity=capacity, max_logprobs=max_logprobs)
    first = greedy_argmax(last_logits)
    positions = jnp.arange(capacity + 1)[None, :]
    tokens = jnp.full((batch, capacity + 1), mask_token_id, jnp.int32)
    tokens = jnp.where(positions < lens[:, None], jnp.pad(ids, ((0, 0), (0, capacity + 1 - plen))), tokens)
    tokens = jnp.where(positions == lens[:, None], first[:, None], tokens)
    done = is_stop(first[:, None], stop_ids)[:, 0] | (lens + 1 >= max_lens)
    return DecodeState(
        tokens=tokens, starts=lens.astype(jnp.int32), max_lens=max_lens.astype(jnp.int32), done=done,
        num_steps=zeros, accepted=jnp.zeros((batch, max_steps), jnp.int32), stop_ids=stop_ids.astype(jnp.int32),
        target_cache=None, draft_cache=None, sampling=sampling_state,
    )


def draw_first(rows: DecodeState, last_logits: jax.Array, *, flags: SamplingFlags, candidates: int = 0
               ) -> tuple[DecodeState, jax.Array]:
    """The first token of prefilled ``rows`` (``prefill_pass``'s, with a ``SamplingState``) drawn as
    ``flags`` say from ``last_logits [batch, vocab]``: the argmax for greedy rows, the keyed draw for
    sampled ones, its logprobs recorded -> ``(rows, first [batch])``. Its shapes are the rows' alone
    (the prompt is read back from the rows' tokens), so one program serves every prompt bucket."""
    batch = last_logits.shape[0]
    lens, s = rows.starts, rows.sampling
    if flags.edits:  # the prompt's ids are seen (repetition penalty)
        prompt = rows.tokens[:, :-1]
        _, seen = smp.add_tokens(s.counts, s.seen, prompt, jnp.arange(prompt.shape[1])[None, :] < lens[:, None])
        s = dataclasses.replace(s, seen=seen)
    first = _draw(last_logits[:, None], s, rows.stop_ids, jnp.zeros((batch, 1), jnp.int32), lens[:, None],
                  flags=flags, candidates=candidates)[:, 0]
    tokens = jnp.where(jnp.arange(rows.tokens.shape[1])[None, :] == lens[:, None], first[:, None], rows.tokens)
    done = is_stop(first[:, None], rows.stop_ids)[:, 0] | (lens + 1 >= rows.max_lens)
    s = _record(s, last_logits[:, None], first[:, None], lens, jnp.ones((batch, 1), bool), flags)
    return dataclasses.replace(rows, tokens=tokens, done=done, sampling=s), first


def scatter_rows(state: DecodeState, rows: DecodeState, slots: jax.Array) -> DecodeState:
    """Writes row i of ``rows`` into row ``slots[i]`` of ``state``; ``slots [n]`` outside
    ``[0, batch)`` drop their row (the padding rows of a prefill).

    Every array of a row is written over the first positions of its slot: a prefill's short caches
    fill the prompt positions and leave the rest stale, past the row's length, where it is never read.
    """
    def put(dst: jax.Array, src: jax.Array) -> jax.Array:
        index = (slots,) + tuple(slice(0, n) for n in src.shape[1:])
        return dst.at[index].set(src, mode="drop")

    return jax.tree.map(put, state, rows)


def release_rows(state: DecodeState, release: jax.Array) -> DecodeState:
    """Marks the rows where ``release [batch]`` is True done: they stop changing from the next step."""
    return dataclasses.replace(state, done=state.done | release)


def _target_block(
    target: Target, ids: jax.Array, starts: jax.Array, cache: KVCache, window: int | None, **step_kwargs
) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """``target.step`` of ``ids [batch, n]`` at ``starts``, attending to the first ``window`` cache
    positions only (None: the whole cache); returns the whole updated cache either way."""
    if window is None or window >= cache.capacity or not recurrent_state.windowable(cache):
        return target.step(ids, starts, cache, **step_kwargs)
    view = read_window(cache, window)
    hidden, taps, view = target.step(ids, starts, view, **step_kwargs)
    return hidden, taps, write_back(cache, view, starts, ids.shape[1])


def context_window_view(drafter: Drafter, cache: KVCache, starts: jax.Array, window: int
                        ) -> tuple[KVCache, jax.Array]:
    """The drafter's context cut to each row's last ``window`` positions ``[starts - window, starts)``:
    per row, a copy of ``window`` cache positions from ``offset = clip(starts - window, 0, capacity -
    window)`` and the anchor at ``starts - offset`` -> ``(cache [batch, window, ...], starts)``.

    Every position moves by ``-offset``: the copied keys, stored rotated at their absolute positions,
    are rotated back by ``offset`` (in float32), so a draft over the view is the draft over the whole
    cache with the older positions masked (RoPE scores depend on position differences only), on
    every attention path, the kernels included.
    """
    if window <= 0 or window >= cache.capacity:
        return cache, starts
    offset = jnp.clip(starts - window, 0, cache.capacity - window)
    angle = -offset.astype(jnp.float32)[:, None, None, None] * jnp.asarray(
        drafter.layers[0].self_attn.inv_freq, jnp.float32)  # [batch, 1, 1, head_dim / 2]
    cos, sin = jnp.cos(jnp.concatenate([angle, angle], -1)), jnp.sin(jnp.concatenate([angle, angle], -1))

    def rotate(k: jax.Array) -> jax.Array:
        x = k.astype(jnp.float32)
        half = x.shape[-1] // 2
        return (x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin).astype(k.dtype)

    view = KVCache(tuple(rotate(read_rows(k, offset, window)) for k in cache.k),
                   tuple(read_rows(v, offset, window) for v in cache.v))
    return view, starts - offset


def draft_block(
    target: Target, drafter: Drafter, state: DecodeState, *, block_size: int,
    ops: OpsConfig = XLA, window: int | None = None, flags: SamplingFlags = GREEDY_FLAGS, candidates: int = 64,
    context_window: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Drafts ``[anchor, d1 .. d_{B-1}]`` for every row in one drafter pass.

    ``window``: attend to the first ``window`` cache positions only (every row needs
    ``starts + B <= window``); None or a window of the whole capacity: the whole cache.
    ``context_window``: > 0, the drafter sees only each row's last ``context_window`` context
    positions (``context_window_view``).

    Returns ``block_ids [batch, B]``, ``valid [batch]`` (slots that exist: the reference's shorter
    last block) and ``positions [batch, B]``. With sampled rows (``flags.sample``), a sampled row's
    drafts are drawn from the drafter's logits over the row's temperature with the noise the target
    draws the same positions with (``draft_tokens``, from the ``candidates`` largest logits when that
    is exact); with ``flags.rejection``, the draft logits
    ``[batch, B-1, vocab]`` are returned fourth.
    """
    batch = state.starts.shape[0]
    starts = state.starts
    anchor = jnp.take_along_axis(state.tokens, starts[:, None], axis=1)[:, 0]
    valid = jnp.clip(state.max_lens - starts, 1, block_size).astype(jnp.int32)
    mask = jnp.full((batch, block_size - 1), drafter.config.mask_token_id, jnp.int32)
    block_ids = jnp.concatenate([anchor[:, None], mask], axis=1)
    positions = starts[:, None] + jnp.arange(block_size, dtype=jnp.int32)[None, :]
    cache = state.draft_cache
    if window is not None and window < cache.capacity:
        cache = read_window(cache, window)
    cache, draft_starts = context_window_view(drafter, cache, starts, context_window)
    hidden = drafter.draft(target.embed(block_ids)[:, None], draft_starts, cache, valid, ops=ops)
    logits = drafter.logits(target, hidden[:, 0, 1:])
    if isinstance(drafter, DFlash2Drafter):
        # A path through each slot's top-k candidates. Exact verification takes any proposal; rejection
        # sampling needs drafts drawn from q, which the selector's path is not (the batcher refuses it).
        if flags.sample:
            unary, ids, noise = selector_candidates(logits, state.sampling, positions[:, 1:],
                                                    drafter.config.selector_top_k, candidates)
            draft = drafter.select(logits, hidden[:, 0, 1:], anchor, (unary, ids), (noise, state.sampling.temperature))
        else:
            draft = drafter.select(logits, hidden[:, 0, 1:], anchor)
    elif flags.sample:
        draft = draft_tokens(logits, state.sampling, positions[:, 1:], flags=flags, candidates=candidates)
    else:
        draft = greedy_argmax(logits)
    draft = drafter.override_drafts(draft, state.tokens, positions)  # unchanged but for a test drafter's
    if flags.rejection:
        return block_ids.at[:, 1:].set(draft), valid, positions, logits
    return block_ids.at[:, 1:].set(draft), valid, positions


def verify_block(
    target: Target, drafter: Drafter, state: DecodeState, block_ids: jax.Array, valid: jax.Array,
    positions: jax.Array, *, ops: OpsConfig = XLA, window: int | None = None,
    flags: SamplingFlags = GREEDY_FLAGS, candidates: int = 0, draft_logits: jax.Array | None = None,
) -> DecodeState:
    """Verifies a drafted block in one target pass, commits, and extends the drafter's context.

    ``window`` as in ``draft_block``. Sampled rows (``flags``): the target draws every slot
    (``sampled_posterior``), a draft is accepted while it equals the draw (or by rejection sampling
    against ``draft_logits``, for its rows); ``candidates`` as in ``sampling.filter_thresholds``.
    """
    starts = state.starts
    verified, taps, target_cache = _target_block(
        target, block_ids, starts, state.target_cache, window, blk_lens=valid,
        tap_layers=drafter.config.target_layer_ids, ops=ops, **recurrent_state.verify_kwargs(target),
    )
    logits = target.head(verified)
    if flags.greedy:
        posterior = greedy_argmax(logits)
    else:
        posterior = sampled_posterior(logits, state, block_ids, positions + 1, flags=flags, candidates=candidates,
                                      draft_logits=draft_logits)
    acc = greedy_accept(block_ids[:, 1:], posterior, valid)
    new_state, produced = commit(state, block_ids, posterior, acc)
    if not flags.greedy:
        new_state = _record_commit(new_state, state, logits, posterior, produced, flags)
    target_cache = recurrent_state.settle(target, target_cache, produced)
    # The verify pass produced the taps of the committed tokens: project them once for all layers.
    k, v = drafter.context_kv(taps, positions)
    draft_cache = write_all_layers(state.draft_cache, k, v, starts)
    return dataclasses.replace(new_state, target_cache=target_cache, draft_cache=draft_cache)


def speculative_step(
    target: Target,
    drafter: Drafter,
    state: DecodeState,
    *,
    block_size: int,
    ops: OpsConfig = XLA,
    window: int | None = None,
    flags: SamplingFlags = GREEDY_FLAGS,
    candidates: int = 0,
    context_window: int = 0,
) -> DecodeState:
    """Draft a block, verify it, commit, and extend the drafter's context: one step for every row.

    ``window``: attend to the first ``window`` cache positions only (rows that are not done need
    ``starts + block_size <= window``); None: the whole capacity. ``flags``, ``candidates``: the
    batch's sampling (``verify_block``). ``context_window``: the drafter's (``draft_block``).
    """
    drafted = draft_block(target, drafter, state, block_size=block_size, ops=ops, window=window, flags=flags,
                          candidates=candidates, context_window=context_window)
    return verify_block(target, drafter, state, *drafted[:3], ops=ops, window=window, flags=flags,
                        candidates=candidates, draft_logits=drafted[3] if flags.rejection else None)


def target_only_step(
    target: Target, state: DecodeState, *, ops: OpsConfig = XLA, window: int | None = None,
    flags: SamplingFlags = GREEDY_FLAGS, candidates: int = 0,
) -> DecodeState:
    """Plain decoding of one token per row through the same caches (the speedup baseline).

    ``window`` as in ``speculative_step`` (with a block of one); sampled rows as ``flags`` say.
    Target-only rows report no acceptance lengths (``batcher``): the step leaves them unwritten.
    """
    new_state, _ = _one_token(target, state, (), ops=ops, window=window, flags=flags, candidates=candidates)
    return dataclasses.replace(new_state, accepted=state.accepted)


def deferred_target_step(
    target: Target, drafter: Drafter, state: DecodeState, taps: jax.Array, slot: jax.Array, *,
    ops: OpsConfig = XLA, window: int | None = None, flags: SamplingFlags = GREEDY_FLAGS, candidates: int = 0,
) -> tuple[DecodeState, jax.Array]:
    """A speculative engine's step that does not speculate (adaptive speculation, ``runtime.speculation``):
    one token per row as ``target_only_step``, recorded in ``accepted`` beside the speculative steps'
    lengths. The anchor's taps go to ``slot`` (a scalar) of ``taps [batch, S, n_taps * hidden]``, not
    into the drafter's context: ``extend_context`` projects a call's slots at once after its last step.
    Projecting each step's token reads the drafter's ``fc`` and context projections every step (252 MB
    at Qwen3-8B shapes; such a step cost 1.044 target-only steps on the H200). -> ``(state, taps)``; the
    drafter's context cache is left as it was."""
    new_state, tapped = _one_token(target, state, drafter.config.target_layer_ids, ops=ops, window=window,
                                   flags=flags, candidates=candidates)
    return new_state, jax.lax.dynamic_update_slice_in_dim(taps, tapped.astype(taps.dtype), slot, axis=1)


def _one_token(target: Target, state: DecodeState, tap_layers: tuple[int, ...], *, ops: OpsConfig,
               window: int | None, flags: SamplingFlags, candidates: int) -> tuple[DecodeState, jax.Array | None]:
    """The target's pass over each row's anchor and the token it commits -> ``(state, taps [batch, 1, ...]
    or None)``, the target cache updated, the drafter's untouched."""
    starts = state.starts
    anchor = jnp.take_along_axis(state.tokens, starts[:, None], axis=1)
    hidden, taps, target_cache = _target_block(target, anchor, starts, state.target_cache, window, ops=ops,
                                               **({"tap_layers": tap_layers} if tap_layers else {}))
    logits = target.head(hidden)
    if flags.greedy:
        posterior = greedy_argmax(logits)
    else:
        posterior = _draw(logits, state.sampling, state.stop_ids, anchor, starts[:, None] + 1, flags=flags,
                          candidates=candidates)
    new_state, produced = commit(state, anchor, posterior, jnp.zeros_like(starts))
    if not flags.greedy:
        new_state = _record_commit(new_state, state, logits, posterior, produced, flags)
    return dataclasses.replace(new_state, target_cache=target_cache), taps


def deferred_context(drafter: Drafter, taps: jax.Array, starts: jax.Array, count: jax.Array
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The drafter's context K/V of the positions ``deferred_target_step`` kept the taps of: slot j of
    ``taps [batch, S, n_taps * hidden]`` is position ``starts [batch] + j``, a committed one for
    ``j < count [batch]``. -> ``(k, v [layers, batch, S, kv_heads, head_dim], keep [batch, S])``."""
    slots = jnp.arange(taps.shape[1], dtype=jnp.int32)[None, :]
    k, v = drafter.context_kv(taps, starts[:, None] + slots)
    return k, v, slots < count[:, None]


def extend_context(drafter: Drafter, cache: KVCache, taps: jax.Array, starts: jax.Array, count: jax.Array
                   ) -> KVCache:
    """``cache`` (per-row, the drafter's context) with the ``deferred_context`` of ``taps`` written at
    ``starts + j`` for ``j < count``; the other slots write nothing (they may lie past the capacity)."""
    k, v, keep = deferred_context(drafter, taps, starts, count)
    rows = jnp.arange(starts.shape[0])[:, None]
    positions = jnp.where(keep, starts[:, None] + jnp.arange(taps.shape[1], dtype=jnp.int32)[None, :],
                          cache.capacity)  # out of range: dropped

    def put(buffer: jax.Array, values: jax.Array) -> jax.Array:
        return buffer.at[rows, positions].set(values.astype(buffer.dtype), mode="drop")

    return KVCache(tuple(put(b, x) for b, x in zip(cache.k, k)), tuple(put(b, x) for b, x in zip(cache.v, v)))


# -- sampled rows (``dflash_jax.runtime.sampling``) ------------------------------------------------


def _draw(logits: jax.Array, s: SamplingState, stop_ids: jax.Array, block_ids: jax.Array, positions: jax.Array, *,
          flags: SamplingFlags, candidates: int) -> jax.Array:
    """The target's token at every slot of ``logits [b, n, V]``: the argmax for greedy rows, the
    keyed draw for sampled ones. Slot j predicts the token at ``positions [b, n]`` after the block's
    tokens ``block_ids [b, n]`` 0..j; its penalties count tokens 1..j as generated (slot 0 is the
    committed anchor). -> ``[b, n]`` int32."""
    b, n, vocab = logits.shape
    rows = smp.Rows.of(s, stop_ids, per_row=n)
    pos = positions.reshape(-1)

    def edited(raw):
        flat = raw.reshape(b * n, vocab).astype(jnp.float32)
        if not flags.edits:
            return flat
        counts, seen = smp.block_counts(s.counts, s.seen, block_ids)
        return smp.edit_logits(flat, rows, pos, counts.reshape(b * n, vocab), seen.reshape(b * n, vocab))

    def whole_row(raw):
        scores = smp.draw_scores(edited(raw), rows, pos, flags=flags, candidates=candidates)
        return greedy_argmax(scores.reshape(b, n, vocab)).reshape(-1)

    if not flags.sample:
        return whole_row(logits).reshape(b, n)
    # The draws from each row's largest logits (noise for those only), the whole rows' draws only
    # when some row's could reach past them. Unedited logits stay in their dtype: no float32 copy.
    source = edited(logits) if flags.edits else logits.reshape(b * n, vocab)
    tokens, exact = smp.candidate_tokens(source, rows, pos, flags=flags, candidates=candidates)
    tokens = jax.lax.cond(jnp.all(exact), lambda _: tokens, whole_row, logits)
    return tokens.reshape(b, n)


def draft_tokens(logits: jax.Array, s: SamplingState, positions: jax.Array, *, flags: SamplingFlags = GREEDY_FLAGS,
                 candidates: int = 64) -> jax.Array:
    """The drafts of ``logits [b, B-1, V]`` at ``positions [b, B-1]``: greedy rows' argmax; a sampled
    row's draw from ``softmax(logits / temperature)`` within the drafter's top-k when the row has one
    (``sampling.draft_candidates``), with the target's noise for the same position, so that a
    drafter close to the target proposes the token the target will draw. Rows verifying by rejection
    sampling draw from the whole distribution (``sampled_posterior``'s q). Read from the
    ``candidates`` largest logits. Under rejection sampling (``flags.rejection``) a draft must be a draw
    from q: the whole rows are read when some draw could reach past the candidates. Under exact
    verification a draft is only a proposal (the target accepts it only where it equals its own draw), so
    a row's draw from its candidates stands: where the whole row's could differ, acceptance may lose a
    token, never exactness, and the step keeps no conditional (its fallback's conditional cost ~90 us a
    step at batch 16 on an H100, docs/performance.md)."""
    b, n, vocab = logits.shape
    temperature = jnp.repeat(s.temperature, n)
    top_ks = jnp.repeat(jnp.where(s.rejection, 0, s.top_k), n) if flags.top_k else jnp.zeros_like(temperature, jnp.int32)
    seeds, pos = jnp.repeat(s.seeds, n, axis=0), positions.reshape(-1)
    tokens, exact, boundary = smp.draft_candidates(logits.reshape(b * n, vocab), temperature, top_ks, seeds, pos,
                                                   count=smp.candidate_count(flags, candidates))

    if not flags.rejection:
        return tokens.reshape(b, n)

    def whole_row(raw):
        scores = smp.draft_scores(raw.reshape(b * n, vocab), temperature, boundary, seeds, pos)
        return greedy_argmax(scores.reshape(b, n, vocab)).reshape(-1)

    return jax.lax.cond(jnp.all(exact), lambda _: tokens, whole_row, logits).reshape(b, n)


def selector_candidates(logits: jax.Array, s: SamplingState, positions: jax.Array, k: int,
                        count: int = 64) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A DFlash2 selector's ``k`` candidates per draft slot for a batch with sampled rows:
    ``logits [b, n, V]`` of the slots at ``positions [b, n]`` -> ``(unary [b, n, k], ids [b, n, k],
    gumbel [b, n, k])``, the candidates' logits, ids and noise.

    ``gumbel`` is the noise the target draws the same position with, at the candidates' ids: the selector
    walks ``score / T + gumbel`` (``CandidateSelector.select_path``), the counterpart of the target's
    draw ``argmax(logits / T + gumbel)``, so that a drafter close to the target proposes the tokens the
    target will draw (exact verification accepts a draft only when it equals the draw; a greedy path
    rarely does at T >= 0.7). A sampled row's candidates are the top ``k`` of ``logits / T + gumbel``,
    read from its ``count`` largest logits when no other token can reach them (as ``draft_tokens``),
    else from the whole row; a greedy row's (T = 0) are the top ``k`` logits, as ``select_path`` takes
    them, with zero noise."""
    b, n, vocab = logits.shape
    temperature = s.temperature.astype(jnp.float32)[:, None, None]
    sampled = temperature > 0
    scale = jnp.where(sampled, temperature, 1.0)
    seeds, flat_pos = jnp.repeat(s.seeds, n, axis=0), positions.reshape(-1)

    def pick(values, ids, noise):
        rank = jnp.where(sampled, values.astype(jnp.float32) / scale + noise, values.astype(jnp.float32))
        top, picked = top_k(rank, k)  # over candidates in logit order: ties keep the lower id
        take = functools.partial(jnp.take_along_axis, indices=picked, axis=-1)
        return top, (take(values), take(ids), jnp.where(sampled, take(noise), 0.0))

    values, ids = top_k(logits, max(count, k))  # [b, n, C], by logit, ties to the lower id
    noise = smp.gumbel_at(seeds, flat_pos, ids.reshape(b * n, -1), vocab).reshape(ids.shape)
    top, chosen = pick(values, ids, noise)
    # No token outside the C largest logits can reach the k-th score, even with the largest noise.
    exact = ~sampled[..., 0] | (values[..., -1].astype(jnp.float32) / scale[..., 0] + smp.GUMBEL_MAX < top[..., -1])

    def whole_row(raw):
        full = smp.gumbel_noise(seeds, flat_pos, vocab).reshape(b, n, vocab)
        ids_all = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), raw.shape)
        return pick(raw, ids_all, full)[1]

    return jax.lax.cond(jnp.all(exact), lambda _: chosen, whole_row, logits)


def sampled_posterior(logits: jax.Array, state: DecodeState, block_ids: jax.Array, positions: jax.Array, *,
                      flags: SamplingFlags, candidates: int, draft_logits: jax.Array | None = None) -> jax.Array:
    """What the target commits at each slot of a verify block, for ``greedy_accept`` and ``commit``:
    ``logits [b, B, V]`` of ``block_ids [b, B]``, predicting ``positions [b, B]``.

    Exact rows: the target's own keyed draw per slot (a draft is accepted while it equals it). Rows
    verifying by rejection sampling (``draft_logits [b, B-1, V]``): slot j holds the draft j + 1 if
    accepted (probability ``min(1, p/q)``, the uniform keyed by the position), else a draw from the
    residual ``max(0, p - q)``; the last slot the target's draw (the bonus after a fully accepted block).
    """
    s = state.sampling
    exact = _draw(logits, s, state.stop_ids, block_ids, positions, flags=flags, candidates=candidates)
    if not flags.rejection or draft_logits is None:
        return exact
    b, n, vocab = logits.shape
    flat = logits.reshape(b * n, vocab).astype(jnp.float32)
    rows = smp.Rows.of(s, state.stop_ids, per_row=n)
    pos = positions.reshape(-1)
    if flags.edits:
        counts, seen = smp.block_counts(s.counts, s.seen, block_ids)
        flat = smp.edit_logits(flat, rows, pos, counts.reshape(b * n, vocab), seen.reshape(b * n, vocab))
    p = smp.target_probs(flat, rows, flags=flags, candidates=candidates).reshape(b, n, vocab)[:, :-1]
    temperature = jnp.where(s.temperature == 0, 1.0, s.temperature)
    q = jax.nn.softmax(draft_logits.astype(jnp.float32) / temperature[:, None, None], axis=-1)
    drafts = block_ids[:, 1:]
    p_d = jnp.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    seeds = jnp.repeat(s.seeds, n - 1, axis=0)
    draft_pos = positions[:, :-1].reshape(-1)
    u = smp.uniforms(seeds, draft_pos).reshape(b, n - 1)
    accept = u * q_d < p_d
    residual = jnp.log(jnp.maximum(p - q, 0.0)).reshape(b * (n - 1), vocab)
    residual = residual + smp.gumbel_noise(seeds, draft_pos, vocab, smp.RESIDUAL_STREAM)
    resampled = greedy_argmax(residual.reshape(b, n - 1, vocab))
    rejection = jnp.concatenate([jnp.where(accept, drafts, resampled), exact[:, -1:]], axis=1)
    use = (s.rejection & (s.temperature > 0))[:, None]
    return jnp.where(use, rejection, exact)


def _record(s: SamplingState, logits: jax.Array, chosen: jax.Array, first_position: jax.Array, keep: jax.Array,
            flags: SamplingFlags) -> SamplingState:
    """Counts ``chosen [b, n]`` (written at ``first_position [b]`` on) where ``keep [b, n]`` into the
    penalty state, and records their logprobs from the raw ``logits [b, n, V]``, as ``flags`` need."""
    if flags.edits:
        counts, seen = smp.add_tokens(s.counts, s.seen, chosen, keep)
        s = dataclasses.replace(s, counts=counts, seen=seen)
    if flags.logprobs is not None:
        b, n, vocab = logits.shape
        lp, ids, vals = smp.logprobs_of(logits.reshape(b * n, vocab), chosen.reshape(-1), flags.logprobs)
        top = s.top_ids.shape[-1]
        old = read_rows(s.logprob, first_position, n)
        s = dataclasses.replace(s, logprob=write_rows(s.logprob, jnp.where(keep, lp.reshape(b, n), old),
                                                      first_position))
        if flags.logprobs > 0 and top > 0:
            k = min(top, flags.logprobs)
            ids = jnp.pad(ids.reshape(b, n, k), ((0, 0), (0, 0), (0, top - k)))
            vals = jnp.pad(vals.reshape(b, n, k), ((0, 0), (0, 0), (0, top - k)))
            old_ids, old_vals = read_rows(s.top_ids, first_position, n), read_rows(s.top_logprobs, first_position, n)
            s = dataclasses.replace(
                s, top_ids=write_rows(s.top_ids, jnp.where(keep[..., None], ids, old_ids), first_position),
                top_logprobs=write_rows(s.top_logprobs, jnp.where(keep[..., None], vals, old_vals), first_position))
    return s


def _record_commit(new: DecodeState, old: DecodeState, logits: jax.Array, posterior: jax.Array, produced: jax.Array,
                   flags: SamplingFlags) -> DecodeState:
    """``_record`` of a step's committed tokens: slot j of ``posterior`` is the token at ``start + 1 + j``
    (the committed drafts equal it), kept for ``j < produced``."""
    keep = jnp.arange(posterior.shape[1])[None, :] < produced[:, None]
    return dataclasses.replace(new, sampling=_record(new.sampling, logits, posterior, old.starts + 1, keep, flags))
