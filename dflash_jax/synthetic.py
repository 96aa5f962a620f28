"""A drafter of known acceptance, for benchmarks and tests (never built by the serving path).

``SyntheticDrafter`` runs a real drafter's forward pass (so a step costs what a DFlash step of its shapes
costs) and then replaces its proposals: slot ``j`` of a block proposes the target's own next token
at that position with probability ``accept_rate``, else the drafter's own proposal (or, where that happens
to be the target's token, the next id): a token the target will not pick. The wrong proposals read the
drafter's, so its whole forward pass stays in the compiled step (XLA would drop a pass whose output no
one reads, and the step would cost a verify alone). The
target must be predictable from the previous token alone (``transition[token]`` is its next token):
``repeat_target`` makes any target of any shapes, random weights and all, repeat its last token
(``transition`` the identity), robustly in bf16. Whether a position's proposal is right is keyed by
``(seed, the row's first token, position)`` only, so acceptance is geometric: a block of ``B`` commits
``1 + r + ... + r ** (B - 1)`` tokens per step on average (``runtime.speculation.expected_tokens``),
whatever the block size or the batch; a sequence draws the same whatever block sizes run and whether
it runs alone or batched, and sequences of different first tokens draw independently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target


class SyntheticDrafter(Drafter):
    """A ``Drafter`` whose drafts are right with probability ``accept_rate`` per position (see the module)."""

    def __init__(self, config, *, accept_rate: float, transition: jax.Array | None = None, seed: int = 0,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(config, dtype=dtype, rngs=rngs)
        if not 0.0 <= accept_rate <= 1.0:
            raise ValueError(f"accept_rate must be in [0, 1], got {accept_rate}")
        vocab = config.vocab_size
        self.transition = nnx.Variable(jnp.arange(vocab, dtype=jnp.int32) if transition is None
                                       else jnp.asarray(transition, jnp.int32))
        if self.transition.shape != (vocab,):
            raise ValueError(f"transition must be [vocab_size={vocab}] next-token ids, got {self.transition.shape}")
        self.accept_rate = nnx.Variable(jnp.float32(accept_rate))
        self.seed = nnx.Variable(jnp.uint32(seed))

    def override_drafts(self, draft: jax.Array, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """``Drafter.override_drafts``: ``draft [batch, B-1]`` replaced: slot ``j``'s proposal for position ``positions[:, j]`` is
        the target's token there after the anchor (at ``positions[:, 0]`` of ``tokens``) and right
        proposals, with probability ``accept_rate``, else the drafter's own ``draft`` (the next id where
        that is right)."""
        transition = self.transition[...]
        token = jnp.take_along_axis(tokens, positions[:, :1], axis=1)[:, 0]
        truth = []
        for _ in range(draft.shape[1]):
            token = transition[token]
            truth.append(token)
        truth = jnp.stack(truth, axis=1)
        # Keyed by the row's first token too: rows of different sequences draw independently (a batch's
        # acceptance averages over its rows, as independent requests' does), a sequence alone or batched alike.
        key = jax.random.key(self.seed[...])
        rows = jax.vmap(lambda t: jax.random.fold_in(key, t))(tokens[:, 0])
        u = jax.vmap(lambda k, ps: jax.vmap(lambda p: jax.random.uniform(jax.random.fold_in(k, p)))(ps))(
            rows, positions[:, 1:])
        wrong = jnp.where(draft == truth, (truth + 1) % self.config.vocab_size, draft)
        return jnp.where(u < self.accept_rate[...], truth, wrong).astype(draft.dtype)


def synthetic_drafter(drafter: Drafter, accept_rate: float, *, transition: jax.Array | None = None,
                      seed: int = 0) -> SyntheticDrafter:
    """A ``SyntheticDrafter`` with ``drafter``'s config and weights (its cost), proposing as the module says."""
    out = SyntheticDrafter(drafter.config, accept_rate=accept_rate, transition=transition, seed=seed,
                           dtype=drafter.dtype, rngs=nnx.Rngs(0))
    nnx.update(out, nnx.state(drafter, nnx.Param))
    return out


def repeat_target(target: Target, *, residual_scale: float = 1e-3) -> Target:
    """``target`` changed in place to repeat its last token, whatever its weights: every layer's output
    projections scaled by ``residual_scale`` (the residual stream stays its input embedding), the final
    norm's weight ones and the LM head the embedding table, so a token's own logit (its squared norm)
    stands far above every other (random dot products). The shapes, and so each step's cost, are unchanged."""
    scale = jnp.asarray(residual_scale, target.embed_tokens.dtype)
    for layer in target.layers:
        layer.self_attn.o_proj[...] = layer.self_attn.o_proj[...] * scale
        layer.mlp.down_proj[...] = layer.mlp.down_proj[...] * scale
    target.norm.weight[...] = jnp.ones_like(target.norm.weight[...])
    if getattr(target, "lm_head", None) is not None:
        target.lm_head[...] = target.embed_tokens[...].T.astype(target.lm_head.dtype)
    return target


def set_accept_rate(engine, rate: float) -> None:
    """Changes the acceptance rate of ``engine``'s ``SyntheticDrafter`` in place: an argument of the
    compiled steps, so nothing recompiles (a benchmark sweeps rates through one engine)."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"accept_rate must be in [0, 1], got {rate}")
    drafter = nnx.merge(engine._drafter_def, jax.tree.unflatten(engine._drafter_tree, engine._drafter_state))
    if not isinstance(drafter, SyntheticDrafter):
        raise ValueError(f"the engine's drafter is a {type(drafter).__name__}, not a SyntheticDrafter")
    drafter.accept_rate[...] = jnp.full_like(drafter.accept_rate[...], rate)
    leaves, tree = jax.tree.flatten(nnx.split(drafter)[1])
    if tree != engine._drafter_tree:
        raise AssertionError("the drafter's state changed structure")
    engine._drafter_state = leaves
