"""Sampling: per-request parameters, the logits processors, and the keyed draws of exact verification.

A sampled token at absolute position ``pos`` of a row is ``argmax(processed + gumbel(seed, pos))``
over the vocabulary: the Gumbel-max draw from the processed distribution, with noise that depends on
the row's seed and the position only. The target draws every position of a verify block this way
and a draft is accepted while it equals the target's own draw, so a seeded generation with a drafter
is the same sequence, token for token, as the same request decoded target-only, and the same in any
batch (``verify="exact"``, the default). ``verify="rejection"`` is standard speculative rejection
sampling against the drafter's probabilities: the same output distribution, not the same tokens.

The processors, in order (vLLM's order for the logit edits, then Hugging Face transformers'
warpers), each on one row of float32 logits:

1. ``logit_bias`` is added; while fewer than ``min_tokens`` tokens were generated, the row's stop
   ids are blocked (-inf);
2. penalties: ``repetition_penalty`` as transformers (and vLLM) define it, over the prompt and the
   generated tokens (a seen token's logit is divided by it when positive, multiplied when negative);
   then ``frequency_penalty * count + presence_penalty * (count > 0)`` subtracted, over the
   generated tokens (OpenAI's and vLLM's definition);
3. ``temperature``: divided by it (0: greedy, the argmax of the logits after 1-2);
4. ``top_k``: tokens below the k-th largest value go (ties with it stay, as transformers' top-k);
5. ``top_p``: of the top-k survivors, renormalized, the smallest set of the most likely tokens whose
   mass reaches ``top_p`` stays, and every token tied with the least likely of them (so the set does
   not depend on token order);
6. ``min_p``: tokens whose probability is below ``min_p`` times the most likely token's go.

Filters 4-6 each keep the tokens at or above a threshold of the scaled logits, so a row's kept set
is one threshold (``filter_thresholds``): computed from the ``candidates`` largest logits
(``ops.topk``) when that is provably the same as from the whole sorted row, from a sort-free search
of the whole row otherwise (a rare fallback under ``lax.cond``). The draws themselves are read from the
same candidates, the noise made at their ids only, whenever no other token can win
(``candidate_tokens``; the whole-row draw, ``draw_scores``, otherwise). Logprobs are vLLM's default:
the log-softmax of the target's raw logits, before any processor.

The batch-wide ``SamplingFlags`` (static, computed on the host from the live rows) compile out what
no row uses: a batch of greedy rows runs the greedy code path unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.ops import topk

VERIFY_MODES = ("exact", "rejection")
MAX_SEED = 2**64  # seeds are unsigned 64-bit: two uint32 words of a threefry key
MAX_TOP_K_CANDIDATES = 1024  # rows with a larger top-k take the whole-row search
_INT32_MAX = int(np.iinfo(np.int32).max)  # the rows' integer parameters are int32 on the device

# Streams of keyed randomness per (seed, position): the token draw, rejection sampling's acceptance
# uniform and its residual draw.
TOKEN_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples (the defaults: greedy decoding, no processors, no logprobs)."""

    temperature: float = 0.0         # 0: greedy (argmax)
    top_p: float = 1.0               # in (0, 1]; 1: off
    top_k: int = 0                   # 0: off
    min_p: float = 0.0               # in [0, 1]; 0: off
    seed: int | None = None          # None: a random seed, drawn when the request is submitted
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # > 0; 1: off
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0              # stop ids are blocked until this many tokens were generated
    logprobs: int | None = None      # None: none; k >= 0: the chosen token's logprob and the top k
    verify: str = "exact"            # "exact" | "rejection" (sampled rows with a drafter)
    # None: none; k >= 0: each prompt token's logprob (after the first) and the top k there, from the prefill
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ValueError(f"SamplingParams.{name} must be a number, got {value!r}")
            try:
                finite = math.isfinite(value)
            except OverflowError:  # an int past a float's range
                finite = False
            if not finite:
                raise ValueError(f"SamplingParams.{name} must be finite, got {str(value):.40}")
            return float(value)

        def integer(name: str, value) -> int:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"SamplingParams.{name} must be an integer, got {value!r}")
            return int(value)

        if number("temperature") < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < number("top_p") <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if integer("top_k", self.top_k) < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 <= number("min_p") <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= integer("seed", self.seed) < MAX_SEED:
            raise ValueError(f"SamplingParams.seed must be in [0, 2**64), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            number(name)
        if number("repetition_penalty") <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(f"SamplingParams.logit_bias must be a mapping token id -> bias, "
                                 f"got {type(self.logit_bias).__name__}")
            for token, bias in self.logit_bias.items():
                if integer("logit_bias token id", token) < 0:
                    raise ValueError(f"SamplingParams.logit_bias has a negative token id {token}")
                if (isinstance(bias, bool) or not isinstance(bias, (int, float, np.integer, np.floating))
                        or math.isnan(bias)):
                    raise ValueError(f"SamplingParams.logit_bias[{token}] must be a number, got {bias!r}")
        if integer("min_tokens", self.min_tokens) < 0:
            raise ValueError(f"SamplingParams.min_tokens must be >= 0, got {self.min_tokens}")
        if self.logprobs is not None and integer("logprobs", self.logprobs) < 0:
            raise ValueError(f"SamplingParams.logprobs must be None or >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and integer("prompt_logprobs", self.prompt_logprobs) < 0:
            raise ValueError(f"SamplingParams.prompt_logprobs must be None or >= 0, got {self.prompt_logprobs}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"SamplingParams.verify must be one of {VERIFY_MODES}, got {self.verify!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain(self) -> bool:
        """Greedy on the raw logits without logprobs: what the greedy code path does (the seed is unused)."""
        return self.greedy and not self.edits_logits and self.logprobs is None and self.prompt_logprobs is None

    @property
    def edits_logits(self) -> bool:
        """Whether processors 1-2 (bias, min_tokens, penalties) can change this row's logits."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.penalized

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def check_vocab(self, vocab_size: int, max_logprobs: int) -> None:
        """Refuses token ids and logprob counts an engine of ``vocab_size`` / ``max_logprobs`` cannot honour."""
        if self.logit_bias:
            bad = [t for t in self.logit_bias if t >= vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.logit_bias has token ids outside [0, {vocab_size}): {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            if (value := getattr(self, name)) is not None and value > max_logprobs:
                raise ValueError(f"SamplingParams.{name} {value} exceeds the engine's max_logprobs {max_logprobs}")

    def with_seed(self) -> "SamplingParams":
        """These parameters with a seed: a fresh random one if ``seed`` is None (greedy rows keep None)."""
        if self.seed is not None or self.greedy:
            return self
        return dataclasses.replace(self, seed=secrets.randbits(63))


GREEDY = SamplingParams()


@dataclasses.dataclass(frozen=True)
class SamplingFlags:
    """What a batch's rows use, known on the host: the static switches of a compiled step.

    ``logprobs``: None (no row asks), 0 (chosen tokens' logprobs only) or the engine's top count.
    """

    sample: bool = False       # some row has temperature > 0
    edits: bool = False        # some row has logit_bias, min_tokens or penalties
    top_k: bool = False
    top_p: bool = False
    # some sampled row has top-p without top-k: its top-p renormalizes over the whole row, whose
    # softmax normalizer the step then reads (two passes over every row's logits)
    top_p_whole_row: bool = False
    min_p: bool = False
    rejection: bool = False    # some sampled row verifies by rejection sampling
    logprobs: int | None = None
    # With top-k: candidates enough for the largest top-k (a power of two above it, at most
    # ``MAX_TOP_K_CANDIDATES``), so that a row's top-k survivors fit them.
    top_k_candidates: int = 0

    @classmethod
    def of(cls, params: Sequence[SamplingParams], max_logprobs: int) -> "SamplingFlags":
        sampled = [p for p in params if not p.greedy]
        asks = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            sample=bool(sampled), edits=any(p.edits_logits for p in params),
            top_k=any(p.top_k > 0 for p in sampled), top_p=any(p.top_p < 1 for p in sampled),
            top_p_whole_row=any(p.top_p < 1 and p.top_k == 0 for p in sampled),
            min_p=any(p.min_p > 0 for p in sampled), rejection=any(p.verify == "rejection" for p in sampled),
            logprobs=None if not asks else (max_logprobs if max(asks) > 0 else 0),
            top_k_candidates=min(MAX_TOP_K_CANDIDATES, 1 << max((p.top_k for p in sampled), default=0).bit_length())
            if any(p.top_k > 0 for p in sampled) else 0,
        )

    @property
    def greedy(self) -> bool:
        """Nothing to do beyond the argmax of the raw logits: the plain greedy path."""
        return self == SamplingFlags()

    @property
    def filters(self) -> bool:
        return self.top_k or self.top_p or self.min_p


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingState:
    """Per-row sampling parameters and state, carried in ``DecodeState.sampling``; rows lead.

    A free row holds the greedy defaults. ``counts``/``seen`` are kept only while some row in the
    batch edits its logits (``SamplingFlags.edits``), which every row needing them guarantees.
    """

    temperature: jax.Array      # [batch] float32
    top_p: jax.Array            # [batch] float32
    top_k: jax.Array            # [batch] int32
    min_p: jax.Array            # [batch] float32
    seeds: jax.Array            # [batch, 2] uint32: the threefry key of the row's seed
    presence: jax.Array         # [batch] float32
    frequency: jax.Array        # [batch] float32
    repetition: jax.Array       # [batch] float32
    min_end: jax.Array          # [batch] int32: stop ids blocked for tokens at positions < this
    rejection: jax.Array        # [batch] bool
    bias: jax.Array             # [batch, vocab] float32
    counts: jax.Array           # [batch, vocab] int32: generated tokens (committed) per id
    seen: jax.Array             # [batch, vocab] bool: ids in the prompt or generated
    logprob: jax.Array          # [batch, capacity + 1] float32: committed token's logprob at its position
    top_ids: jax.Array          # [batch, capacity + 1, max_logprobs] int32
    top_logprobs: jax.Array     # [batch, capacity + 1, max_logprobs] float32


def row_arrays(params: Sequence[SamplingParams], rows: int, vocab: int, prompt_lens: Sequence[int],
               ) -> dict[str, np.ndarray]:
    """The host arrays of ``rows`` rows' parameters (``params`` for the first rows, greedy after)."""
    out = {
        "temperature": np.zeros((rows,), np.float32), "top_p": np.ones((rows,), np.float32),
        "top_k": np.zeros((rows,), np.int32), "min_p": np.zeros((rows,), np.float32),
        "seeds": np.zeros((rows, 2), np.uint32), "presence": np.zeros((rows,), np.float32),
        "frequency": np.zeros((rows,), np.float32), "repetition": np.ones((rows,), np.float32),
        "min_end": np.zeros((rows,), np.int32), "rejection": np.zeros((rows,), bool),
        "bias": np.zeros((rows, vocab), np.float32),
    }
    for i, (p, n) in enumerate(zip(params, prompt_lens)):
        # A top_k past the vocabulary keeps every token, as the vocabulary's size does; the bound keeps
        # any request's value in int32 (numpy raises OverflowError, failing the whole admission).
        out["temperature"][i], out["top_p"][i], out["top_k"][i], out["min_p"][i] = (
            p.temperature, p.top_p, min(p.top_k, vocab), p.min_p)
        seed = p.seed or 0
        out["seeds"][i] = (seed >> 32, seed & 0xFFFFFFFF)
        out["presence"][i], out["frequency"][i], out["repetition"][i] = (
            p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        out["min_end"][i] = min(n + p.min_tokens, _INT32_MAX)  # past any row's length: blocks stop ids throughout
        out["rejection"][i] = p.verify == "rejection"
        for token, bias in (p.logit_bias or {}).items():
            out["bias"][i, token] = bias
    return out


def new_state(arrays: dict[str, jax.Array], *, capacity: int, max_logprobs: int) -> SamplingState:
    """A ``SamplingState`` of ``arrays`` (``row_arrays``) with empty counts and logprobs."""
    rows, vocab = arrays["bias"].shape
    return SamplingState(
        **arrays, counts=jnp.zeros((rows, vocab), jnp.int32), seen=jnp.zeros((rows, vocab), bool),
        logprob=jnp.zeros((rows, capacity + 1), jnp.float32),
        top_ids=jnp.zeros((rows, capacity + 1, max_logprobs), jnp.int32),
        top_logprobs=jnp.zeros((rows, capacity + 1, max_logprobs), jnp.float32),
    )


# -- the processors: pure functions of one row's logits (leading axes are rows) ------------------


def bias_and_block(logits: jax.Array, bias: jax.Array, stop_ids: jax.Array, block: jax.Array) -> jax.Array:
    """Processor 1: ``logits [..., V] + bias [..., V]``, and -inf at ``stop_ids [..., n]`` (-1 pads)
    where ``block [...]`` (fewer than ``min_tokens`` generated)."""
    logits = logits + bias
    ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    hit = jnp.zeros(logits.shape, bool)
    for k in range(stop_ids.shape[-1]):
        hit = hit | (ids == stop_ids[..., k:k + 1])
    return jnp.where(hit & block[..., None], -jnp.inf, logits)


def penalize(logits: jax.Array, counts: jax.Array, seen: jax.Array, repetition: jax.Array, presence: jax.Array,
             frequency: jax.Array) -> jax.Array:
    """Processor 2 on ``logits [..., V]``: ``counts [..., V]`` generated tokens per id, ``seen [..., V]``
    ids in the prompt or generated, the penalties ``[...]``. Neutral penalties change nothing, bit for bit."""
    r = repetition[..., None]
    logits = jnp.where(seen, jnp.where(logits < 0, logits * r, logits / r), logits)
    return logits - frequency[..., None] * counts.astype(logits.dtype) - presence[..., None] * (counts > 0)



def _sorted_threshold(desc: jax.Array, log_norm: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Processors 4-5 as one threshold of scaled logits, from ``desc [R, N]`` (a row's largest N
    scaled logits, descending) and ``log_norm [R]`` (the log of the whole row's softmax normalizer).
    -inf where neither filter is on."""
    n = desc.shape[-1]
    use_k = top_k > 0
    kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, n - 1)[:, None], axis=-1)[:, 0]
    theta_k = jnp.where(use_k, kth, -jnp.inf)
    kept = jnp.where(desc >= theta_k[:, None], desc, -jnp.inf)
    # top-p over the top-k survivors, renormalized (transformers: top-p sees top-k's -inf).
    norm = jnp.where(use_k, jax.nn.logsumexp(kept, axis=-1), log_norm)
    probs = jnp.exp(kept - norm[:, None])
    before = jnp.concatenate([jnp.zeros_like(probs[:, :1]), jnp.cumsum(probs, axis=-1)[:, :-1]], axis=-1)
    n_keep = jnp.sum(before < top_p[:, None], axis=-1)  # >= 1: the first token's mass before it is 0
    theta_p = jnp.take_along_axis(desc, jnp.clip(n_keep - 1, 0, n - 1)[:, None], axis=-1)[:, 0]
    theta_p = jnp.where(top_p < 1, theta_p, -jnp.inf)
    return jnp.maximum(theta_k, theta_p)


def candidate_threshold(desc: jax.Array, log_norm: jax.Array, top_k: jax.Array, top_p: jax.Array,
                        ) -> tuple[jax.Array, jax.Array]:
    """Processors 4-5's threshold ``[R]`` from a row's largest scaled logits ``desc [R, C]``
    (descending; ``log_norm`` as in ``_sorted_threshold``), and whether it is exact ``[R]``: every
    kept token is a candidate and, under top-k, every top-k survivor too (top-p renormalizes over
    them), so the mass before each is the same as in the whole sorted row."""
    count = desc.shape[-1]
    theta = _sorted_threshold(desc, log_norm, top_k, top_p)
    kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, count - 1)[:, None], axis=-1)[:, 0]
    survivors_inside = (top_k == 0) | ((top_k <= count) & (desc[:, -1] < kth))
    return theta, (theta == -jnp.inf) | ((desc[:, -1] < theta) & survivors_inside)


def _searched_threshold(scaled: jax.Array, log_norm: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
                        any_top_k: bool = True, any_top_p: bool = True) -> jax.Array:
    """``_sorted_threshold`` of the whole sorted row, without sorting it: ``scaled [R, V]``.

    top-k's threshold is the k-th largest value; top-p's the largest value with at least ``top_p`` of
    the mass at or above it (the token at which the mass before it in sorted order first stays below
    ``top_p``, every token tied with it kept): both ``topk.largest_threshold``. Sort-free, so that the
    decode loop holding this fallback stays in the CUDA graph (``ops.topk``). ``any_top_k`` or
    ``any_top_p`` False (no row has that filter, known on the host) leaves out its search."""
    use_k = top_k > 0
    theta_k = jnp.full(scaled.shape[:1], -jnp.inf, jnp.float32)
    if any_top_k:
        count = topk.largest_threshold(scaled, jnp.ones(scaled.shape, jnp.int32), top_k)
        theta_k = jnp.where(use_k, count, -jnp.inf)
    if not any_top_p:
        return theta_k
    kept = jnp.where(scaled >= theta_k[:, None], scaled, -jnp.inf)
    norm = jnp.where(use_k, jax.nn.logsumexp(kept, axis=-1), log_norm)
    theta_p = topk.largest_threshold(scaled, jnp.exp(kept - norm[:, None]), top_p)
    return jnp.maximum(theta_k, jnp.where(top_p < 1, theta_p, -jnp.inf))


def filter_thresholds(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array, *,
                      flags: SamplingFlags, candidates: int) -> jax.Array:
    """Processors 4-6 on ``scaled [R, V]`` (logits over temperature): each row keeps the tokens
    ``>= threshold [R]`` (-inf: every token).

    top-k and top-p are read from the ``candidates`` largest logits of a row when that is exact (the
    threshold is above the smallest candidate, so every kept token is a candidate and the mass before
    each is the same as in the whole sorted row); the rows where it is not fall back to the whole row's
    (``_searched_threshold``, no sort), computed only when some row needs it.
    """
    theta = jnp.full(scaled.shape[:1], -jnp.inf, scaled.dtype)
    candidates = max(candidates, flags.top_k_candidates)
    if flags.top_k or flags.top_p:
        top_k = top_k if flags.top_k else jnp.zeros_like(top_k)
        top_p = top_p if flags.top_p else jnp.ones_like(top_p)
        log_norm = (jax.nn.logsumexp(scaled, axis=-1) if flags.top_p_whole_row
                    else jnp.zeros(scaled.shape[:1], scaled.dtype))
        vocab = scaled.shape[-1]

        def whole(_):
            return _searched_threshold(scaled, log_norm, top_k, top_p, any_top_k=flags.top_k, any_top_p=flags.top_p)

        if candidates >= vocab:
            theta = whole(None)
        else:
            theta_c, exact = candidate_threshold(topk.top_k(scaled, candidates)[0], log_norm, top_k, top_p)
            theta_w = jax.lax.cond(jnp.all(exact), lambda _: theta_c, whole, None)
            theta = jnp.where(exact, theta_c, theta_w)
    if flags.min_p:
        floor = jnp.max(scaled, axis=-1) + jnp.log(min_p)  # log(0) = -inf: off
        theta = jnp.maximum(theta, floor)
    return theta


def processed_logits(logits: jax.Array, temperature: jax.Array, theta: jax.Array) -> jax.Array:
    """The scaled logits a sampled row draws from: ``logits / temperature``, -inf below ``theta``."""
    scaled = logits / temperature[:, None]
    return jnp.where(scaled >= theta[:, None], scaled, -jnp.inf)


def row_keys(seeds: jax.Array, positions: jax.Array, stream: int = TOKEN_STREAM) -> jax.Array:
    """Keys of ``seeds [R, 2]`` at absolute ``positions [R]``: a function of (seed, position, stream) only."""
    def one(seed, position):
        key = jax.random.wrap_key_data(seed, impl="threefry2x32")
        return jax.random.fold_in(jax.random.fold_in(key, position), stream)

    return jax.vmap(one)(seeds, positions)


def gumbel_noise(seeds: jax.Array, positions: jax.Array, vocab: int, stream: int = TOKEN_STREAM) -> jax.Array:
    """Standard Gumbel noise ``[R, vocab]`` float32 for rows ``seeds [R, 2]`` at ``positions [R]``."""
    keys = row_keys(seeds, positions, stream)
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32, mode="low"))(keys)


# jax's float32 Gumbel ("low" mode) is -log(-log(u)) of a uniform u <= 1 - 2**-23: at most 15.95.
GUMBEL_MAX = 16.0


def gumbel_at(seeds: jax.Array, positions: jax.Array, ids: jax.Array, vocab: int,
              stream: int = TOKEN_STREAM) -> jax.Array:
    """``gumbel_noise(seeds, positions, vocab, stream)`` at the token ids ``ids [R, C]`` only -> ``[R, C]``,
    bit for bit.

    With jax's partitionable threefry (``jax_threefry_partitionable``, the default) element ``i`` of
    a draw of key ``k`` is a function of ``(k, i)`` alone: the xor of the two words threefry makes of
    the counter ``(0, i)``, which are ``key_data(fold_in(k, i))``; the words become a uniform and the
    uniform a Gumbel value as ``jax.random.gumbel`` does. Without it a value depends on the whole
    draw, which is then made and read at ``ids``.
    """
    keys = row_keys(seeds, positions, stream)
    if not jax.config.jax_threefry_partitionable:
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32, mode="low"))(keys)
        return jnp.take_along_axis(noise, ids, axis=-1)

    def row(key, row_ids):
        words = jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(key, i)))(row_ids.astype(jnp.uint32))
        return words[:, 0] ^ words[:, 1]

    bits = jax.vmap(row)(keys, ids)
    # jax.random.uniform(minval=tiny, maxval=1): the 23 high bits as the mantissa of a float in
    # [1, 2), minus 1, scaled into [tiny, 1).
    one = jnp.asarray(np.array(1.0, np.float32).view(np.uint32))
    floats = jax.lax.bitcast_convert_type((bits >> jnp.uint32(9)) | one, jnp.float32) - jnp.float32(1.0)
    tiny = jnp.float32(np.finfo(np.float32).tiny)
    uniform = jax.lax.max(tiny, floats * (jnp.float32(1.0) - tiny) + tiny)
    return -jnp.log(-jnp.log(uniform))


def candidate_draw(desc: jax.Array, ids: jax.Array, keep: jax.Array, others_out: jax.Array, noise: jax.Array,
                   ) -> tuple[jax.Array, jax.Array]:
    """The Gumbel-max draw over a row's candidates: ``desc [R, C]`` its largest scaled logits
    (descending) at token ``ids [R, C]``, ``keep [R, C]`` those the filters keep, ``others_out [R]``
    whether the filters drop every other token, ``noise [R, C]`` the row's Gumbel noise at ``ids``
    -> ``(token [R], exact [R])``.

    ``token`` is the argmax of ``(desc if kept else -inf) + noise``, equal scores to the lower id (as
    the argmax over the whole row). ``exact``: provably the draw over the whole row, as no other
    token can reach the winning score: each is filtered out, or, being at most the smallest
    candidate, stays below the winner even with the largest noise.
    """
    scores = jnp.where(keep, desc, -jnp.inf) + noise
    best = jnp.max(scores, axis=-1)
    token = jnp.min(jnp.where(scores == best[:, None], ids, jnp.iinfo(jnp.int32).max), axis=-1)
    exact = (others_out | (desc[:, -1] + GUMBEL_MAX < best)) & ~jnp.isnan(best)
    return token, exact


def uniforms(seeds: jax.Array, positions: jax.Array, stream: int = ACCEPT_STREAM) -> jax.Array:
    """One uniform in [0, 1) per row of ``seeds [R, 2]`` at ``positions [R]``."""
    keys = row_keys(seeds, positions, stream)
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)


@dataclasses.dataclass(frozen=True)
class Rows:
    """One logits row's parameters ``[R]`` (a state's rows, repeated per block slot), for the processors."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    seeds: jax.Array            # [R, 2]
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    min_end: jax.Array
    bias: jax.Array             # [R, V]
    stop_ids: jax.Array         # [R, n_stop]

    @classmethod
    def of(cls, s: SamplingState, stop_ids: jax.Array, per_row: int = 1) -> "Rows":
        """``per_row`` logits rows for each of the state's rows (a verify block's slots)."""
        rep = (lambda x: x) if per_row == 1 else (lambda x: jnp.repeat(x, per_row, axis=0))
        return cls(temperature=rep(s.temperature), top_p=rep(s.top_p), top_k=rep(s.top_k), min_p=rep(s.min_p),
                   seeds=rep(s.seeds), presence=rep(s.presence), frequency=rep(s.frequency),
                   repetition=rep(s.repetition), min_end=rep(s.min_end), bias=rep(s.bias), stop_ids=rep(stop_ids))


def edit_logits(logits: jax.Array, rows: Rows, positions: jax.Array, counts: jax.Array | None,
                seen: jax.Array | None) -> jax.Array:
    """Processors 1-2 on ``logits [R, V]`` (float32) predicting tokens at ``positions [R]``."""
    logits = bias_and_block(logits, rows.bias, rows.stop_ids, positions < rows.min_end)
    return penalize(logits, counts, seen, rows.repetition, rows.presence, rows.frequency)


def draw_scores(logits: jax.Array, rows: Rows, positions: jax.Array, *, flags: SamplingFlags,
                candidates: int) -> jax.Array:
    """The scores whose argmax is each row's token: the logits themselves for greedy rows, the
    processed scaled logits plus the (seed, position) Gumbel noise for sampled ones. ``logits [R, V]``
    float32 after ``edit_logits``."""
    if not flags.sample:
        return logits
    greedy = rows.temperature == 0
    temperature = jnp.where(greedy, 1.0, rows.temperature)
    theta = jnp.full(logits.shape[:1], -jnp.inf, logits.dtype)
    if flags.filters:
        theta = filter_thresholds(logits / temperature[:, None], rows.top_k, rows.top_p, rows.min_p, flags=flags,
                                  candidates=candidates)
    noisy = processed_logits(logits, temperature, theta) + gumbel_noise(rows.seeds, positions, logits.shape[-1])
    return jnp.where(greedy[:, None], logits, noisy)


def candidate_count(flags: SamplingFlags, candidates: int) -> int:
    """How many candidates a row's draw reads: ``candidates``, or enough for the batch's largest top-k."""
    return max(candidates, flags.top_k_candidates, 1)


def candidate_tokens(logits: jax.Array, rows: Rows, positions: jax.Array, *, flags: SamplingFlags,
                     candidates: int) -> tuple[jax.Array, jax.Array]:
    """``argmax(draw_scores(...))`` read from each row's largest logits, without noise for the
    rest of the vocabulary: ``logits [R, V]`` after ``edit_logits`` (or raw, in any float dtype, when
    nothing edits them) -> ``(tokens [R], exact [R])``; a row's token is its draw where ``exact``
    (always for greedy rows).

    The candidates are the row's ``candidate_count`` largest logits, scaled after the top-k (dividing
    by a temperature keeps the order, so their values are the largest scaled logits); the filters'
    threshold comes from them as in ``filter_thresholds`` and the draw is ``candidate_draw``'s, the
    noise generated at the candidates' ids only (``gumbel_at``). Exact unless the kept set or the
    draw can reach past the candidates, or the threshold needs the whole sorted row.
    """
    count = min(candidate_count(flags, candidates), logits.shape[-1])
    whole = count == logits.shape[-1]  # the candidates are the whole row: exact
    greedy = rows.temperature == 0
    temperature = jnp.where(greedy, 1.0, rows.temperature)
    values, ids, argmax = topk.top_k_and_argmax(logits, count)
    desc = values.astype(jnp.float32) / temperature[:, None]
    theta = jnp.full(logits.shape[:1], -jnp.inf, jnp.float32)
    exact = jnp.ones(logits.shape[:1], bool)
    if flags.top_k or flags.top_p:
        top_k = rows.top_k if flags.top_k else jnp.zeros_like(rows.top_k)
        top_p = rows.top_p if flags.top_p else jnp.ones_like(rows.top_p)
        log_norm = jnp.zeros(logits.shape[:1], jnp.float32)
        if flags.top_p_whole_row:  # read only when some row's top-p needs it (known on the host)
            log_norm = jax.nn.logsumexp(logits.astype(jnp.float32) / temperature[:, None], axis=-1)
        theta, exact = candidate_threshold(desc, log_norm, top_k, top_p)
    if flags.min_p:
        theta = jnp.maximum(theta, desc[:, 0] + jnp.log(rows.min_p))  # the row's maximum + log(min_p)
    noise = gumbel_at(rows.seeds, positions, ids, logits.shape[-1])
    token, bounded = candidate_draw(desc, ids, desc >= theta[:, None], desc[:, -1] < theta, noise)
    return jnp.where(greedy, argmax, token), greedy | (exact & bounded) | whole


def draft_candidates(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, seeds: jax.Array,
                     positions: jax.Array, *, count: int) -> tuple[jax.Array, jax.Array, tuple]:
    """Sampled drafts from a drafter's ``logits [R, V]`` (any float dtype), read from each row's
    ``count`` largest: ``temperature [R]`` (0: the argmax), ``top_k [R]`` (0: off), the row's
    ``seeds [R, 2]`` and the ``positions [R]`` drafted -> ``(tokens [R], exact [R], boundary)``.

    A sampled row's draft is the Gumbel-max draw from ``softmax(logits / temperature)`` restricted
    to the drafter's own k most likely tokens (``lax.top_k``'s: equal logits to the lower id; a
    ``top_k`` above ``count``: no restriction), with the noise the target draws the same position
    with: the token the target draws whenever the drafter's filtered distribution agrees with the
    target's. ``exact`` as in ``candidate_draw`` (always, under a top-k); ``boundary``, the k-th
    token's logit and id and whether the row is restricted, lets ``draft_scores`` make the same
    draw over the whole row.
    """
    count = min(count, logits.shape[-1])
    greedy = temperature == 0
    values, ids, argmax = topk.top_k_and_argmax(logits, count)
    desc = values.astype(jnp.float32) / jnp.where(greedy, 1.0, temperature)[:, None]
    limited = (top_k > 0) & (top_k <= count)
    keep = ~limited[:, None] | (jnp.arange(count)[None, :] < top_k[:, None])
    last = jnp.clip(top_k - 1, 0, count - 1)[:, None]
    boundary = (jnp.take_along_axis(values, last, axis=-1)[:, 0].astype(jnp.float32),
                jnp.take_along_axis(ids, last, axis=-1)[:, 0], limited)
    token, exact = candidate_draw(desc, ids, keep, limited, gumbel_at(seeds, positions, ids, logits.shape[-1]))
    return jnp.where(greedy, argmax, token), greedy | exact | (count == logits.shape[-1]), boundary


def draft_scores(logits: jax.Array, temperature: jax.Array, boundary: tuple, seeds: jax.Array,
                 positions: jax.Array) -> jax.Array:
    """The scores ``[R, V]`` whose argmax is ``draft_candidates``' draft, over the whole row: the
    logits for greedy rows, else the scaled logits (-inf outside the row's top-k, ``boundary`` as
    ``draft_candidates`` gives it) plus the keyed noise."""
    kth, kth_id, limited = boundary
    flat = logits.astype(jnp.float32)
    greedy = temperature == 0
    scaled = flat / jnp.where(greedy, 1.0, temperature)[:, None]
    ids = jnp.arange(flat.shape[-1], dtype=jnp.int32)[None, :]
    kept = ~limited[:, None] | (flat > kth[:, None]) | ((flat == kth[:, None]) & (ids <= kth_id[:, None]))
    noisy = jnp.where(kept, scaled, -jnp.inf) + gumbel_noise(seeds, positions, flat.shape[-1])
    return jnp.where(greedy[:, None], flat, noisy)


def target_probs(logits: jax.Array, rows: Rows, *, flags: SamplingFlags, candidates: int) -> jax.Array:
    """The processed distribution ``[R, V]`` a sampled row draws from (``logits`` after ``edit_logits``)."""
    temperature = jnp.where(rows.temperature == 0, 1.0, rows.temperature)
    theta = jnp.full(logits.shape[:1], -jnp.inf, logits.dtype)
    if flags.filters:
        theta = filter_thresholds(logits / temperature[:, None], rows.top_k, rows.top_p, rows.min_p, flags=flags,
                                  candidates=candidates)
    return jax.nn.softmax(processed_logits(logits, temperature, theta), axis=-1)


def logprobs_of(logits: jax.Array, chosen: jax.Array, top: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """vLLM's default logprobs: the log-softmax of raw ``logits [R, V]`` (any float dtype) at
    ``chosen [R]`` and its ``top`` largest entries -> ``(logprob [R], top_ids [R, top], top_logprobs
    [R, top])``, float32.

    No float32 copy of the rows is made: the maximum, the entries read and the top-k are taken in the
    logits' dtype (converting to float32 is exact and keeps the order), and the float32 conversion
    happens inside the one reduction that sums the exponentials."""
    norm = log_normalizer(logits)
    chosen_lp = jnp.take_along_axis(logits, chosen[:, None], axis=-1)[:, 0].astype(jnp.float32) - norm
    if top == 0:
        empty = jnp.zeros(logits.shape[:1] + (0,), jnp.float32)
        return chosen_lp, empty.astype(jnp.int32), empty
    values, ids = topk.top_k(logits, top)
    return chosen_lp, ids, values.astype(jnp.float32) - norm[:, None]


def log_normalizer(logits: jax.Array) -> jax.Array:
    """``jax.nn.logsumexp(logits.astype(float32), axis=-1)`` of ``logits [R, V]`` -> ``[R]`` float32,
    the row's maximum taken in its own dtype (exact) and the float32 values made inside the sum."""
    peak = jnp.max(logits, axis=-1).astype(jnp.float32)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    total = jnp.sum(jnp.exp(logits.astype(jnp.float32) - peak[:, None]), axis=-1)
    return jnp.log(total) + peak


def block_counts(counts: jax.Array, seen: jax.Array, block_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Penalty state per slot of a verify block: slot j sees ``counts [b, V]`` / ``seen [b, V]`` plus
    the block's tokens 1..j (drafts, as if committed) -> ``[b, B, V]`` each."""
    block = block_ids.shape[1]
    ids = jnp.arange(counts.shape[-1], dtype=jnp.int32)
    extra = [jnp.zeros_like(counts)]
    for slot in range(1, block):
        extra.append(extra[-1] + (block_ids[:, slot:slot + 1] == ids))
    extra = jnp.stack(extra, axis=1)
    return counts[:, None] + extra, seen[:, None] | (extra > 0)


def add_tokens(counts: jax.Array, seen: jax.Array, tokens: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Counts ``tokens [b, n]`` where ``keep [b, n]`` into ``counts``/``seen [b, V]``."""
    rows = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], tokens.shape)
    counts = counts.at[rows, tokens].add(keep.astype(counts.dtype), mode="drop")
    seen = seen.at[rows, tokens].max(keep, mode="drop")
    return counts, seen


def resolve(sampling: SamplingParams | Sequence[SamplingParams | None] | None, n: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt of ``n`` (None: greedy)."""
    if sampling is None or isinstance(sampling, SamplingParams):
        return [sampling or GREEDY] * n
    out = list(sampling)
    if len(out) != n:
        raise ValueError(f"sampling has {len(out)} entries for {n} prompts")
    for i, p in enumerate(out):
        if p is not None and not isinstance(p, SamplingParams):
            raise ValueError(f"sampling[{i}] must be a SamplingParams or None, got {type(p).__name__}")
    return [p or GREEDY for p in out]
