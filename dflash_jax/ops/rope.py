"""Rotary position embeddings (neox half-split), with the rope types of Qwen3 and Llama-3 checkpoints."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | tuple | None) -> np.ndarray:
    """``[head_dim // 2]`` float32 inverse frequencies, computed as transformers computes them."""
    scaling = dict(scaling) if scaling is not None else None
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if rope_type == "llama3":
        factor = np.float32(scaling["factor"])
        low = np.float32(scaling["low_freq_factor"])
        high = np.float32(scaling["high_freq_factor"])
        old_len = np.float32(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, np.float32(theta), scaling)
    raise ValueError(f"rope type {rope_type!r} is not supported (supported: default, linear, llama3, yarn)")


def _yarn_inv_freq(head_dim: int, theta: np.float32, scaling: dict) -> np.ndarray:
    """YaRN's blend of interpolated and extrapolated frequencies, in float32 as transformers'
    ``_compute_yarn_parameters`` (its ``truncate`` flag rounds the correction range outward)."""
    factor = float(scaling["factor"])
    old_len = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(float(theta)))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True) is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    # The power in float64, rounded: nearer torch's float32 pow than numpy's float32 one (within an ulp).
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    pos_freqs = (np.float64(theta) ** exponents.astype(np.float64)).astype(np.float32)
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1) - ramp.astype(np.float32)).astype(np.float32)
    return (interpolation * (np.float32(1) - keep) + extrapolation * keep).astype(np.float32)


def rope_attention_factor(scaling: dict | tuple | None) -> float:
    """The factor YaRN multiplies cos and sin by (1.0 for every other rope type)."""
    scaling = dict(scaling) if scaling is not None else {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all))
    return get_mscale(factor)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq, attention_factor: float = 1.0) -> jax.Array:
    """Rotates ``x [..., seq, heads, head_dim]`` by ``positions [..., seq]`` (neox half-split);
    ``attention_factor`` scales cos and sin (YaRN)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [..., seq, d/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., seq, 1, d]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
