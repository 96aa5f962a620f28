"""Pallas kernels of dflash-jax, one folder per op (README.md beside this file).

- ``block_attention``: blocks of queries over a shared context plus their own block (drafting,
  verifying, training); GPU (Triton lowering), TPU (Mosaic), a blockwise jnp backward; differentiable.
- ``cached_attention``: the target's decode/verify attention fused with the q/k norms, RoPE and the
  cache write (GPU, forward only).
- ``experts``: a decode or verify step's routed experts (GPU, Mosaic GPU lowering, forward only).
- ``gated_delta``: the gated delta rule of hybrid linear-attention targets (GPU, forward only).

``dflash_jax.ops`` is the only caller; each op's reference is named in its folder's README. On the
CPU every kernel runs in Pallas interpret mode, which is how the tests check it.
"""
