"""Observability of a training run: tqdm bar, JSONL metrics, TensorBoard events, throughput and MFU."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

# Dense bf16 peak FLOP/s per chip, by ``device_kind`` substring (vendor datasheets).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "TPU v6": 918e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v4": 275e12,
}


def peak_flops_per_device() -> float | None:
    kind = jax.devices()[0].device_kind
    for key, flops in PEAK_BF16_FLOPS.items():
        if key.lower() in kind.lower():
            return flops
    return None


def train_flops_per_sequence(target_cfg, drafter_cfg, seq_len: int, num_anchors: int, *, distill: bool) -> float:
    """Model FLOPs of one training sequence (matmuls and attention; no recomputation counted):

    - target forward, no backward: ``D`` layers, ``D`` = deepest tap + 1 (all layers when distilling,
      the later ones are skipped otherwise): ``2 D P_t S + 2 D S^2 h d`` (causal attention: half
      of the ``4 S^2 h d`` of the dense scores), plus the head ``2 S H V`` when distilling;
    - drafter context over all ``S`` tokens: ``fc`` (``n_taps H -> H``) forward + weight gradient
      (its input, the taps, is frozen): ``2 x 2 S n_taps H H``; every layer's context K/V projection
      forward + both gradients: ``3 x 2 S L H 2 kv d``;
    - drafter layers over ``T = anchors * B`` block tokens, forward + backward: ``3 x 2 L P_d T``;
      attention ``3 x 4 T (S/2 + B) h d L`` (a block sees on average half the sequence plus itself);
    - the shared LM head over ``T`` tokens, forward + gradient w.r.t. its input only (it is
      frozen): ``2 x 2 T H V``.

    ``P`` = a layer's matmul parameters (Q, K, V, O, gate, up, down); ``h, kv, d`` heads, KV heads
    and head dim; ``H`` hidden; ``V`` vocabulary.
    """
    t, d = target_cfg, drafter_cfg
    H = t.hidden_size

    def layer_params(c):
        attn = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
        return attn + 3 * c.hidden_size * c.intermediate_size

    S = seq_len
    depth = t.num_layers if distill else max(d.target_layer_ids) + 1
    target = 2 * depth * layer_params(t) * S + 2 * depth * S * S * t.num_heads * t.head_dim
    if distill:
        target += 2 * S * H * t.vocab_size
    tokens = num_anchors * d.block_size
    n_taps = len(d.target_layer_ids)
    fc = 2 * S * n_taps * H * d.hidden_size
    ctx_kv = 2 * S * d.num_layers * d.hidden_size * 2 * d.num_kv_heads * d.head_dim
    layers = 2 * d.num_layers * layer_params(d) * tokens
    attn = 4 * tokens * (S / 2 + d.block_size) * d.num_heads * d.head_dim * d.num_layers
    head = 2 * tokens * d.hidden_size * t.vocab_size
    return float(target + 2 * fc + 3 * (ctx_kv + layers + attn) + 2 * head)


class Monitor:
    """Writes metric lines (host 0 only) and drives the progress bar."""

    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int, *, progress: bool, tensorboard: bool,
                 flops_per_step: float | None = None):
        self.enabled = jax.process_index() == 0
        self.run_dir = Path(run_dir)
        self.flops_per_step = flops_per_step
        self.peak = peak_flops_per_device()
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a") if self.enabled else None
        self._tb = None
        if self.enabled and tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tb"))
            except ImportError:  # pragma: no cover - tensorboardX is a dependency
                self._tb = None
        self._bar = None
        if self.enabled and progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
        self._t0 = time.perf_counter()
        self._last_step = start_step

    def log(self, step: int, metrics: dict[str, Any], *, tokens: int, prefix: str = "train") -> dict[str, Any]:
        """Logs host-side ``metrics`` at optimizer ``step``; ``tokens`` processed since the last call."""
        now = time.perf_counter()
        dt = max(now - self._t0, 1e-9)
        steps = max(step - self._last_step, 1)
        self._t0, self._last_step = now, step
        row: dict[str, Any] = {"step": step}
        for k, v in metrics.items():
            a = np.asarray(v)
            row[k] = a.tolist() if a.ndim else float(a)
        if prefix == "train":
            row["tokens_per_s"] = tokens / dt
            row["step_time_s"] = dt / steps
            if self.flops_per_step and self.peak:
                row["mfu"] = self.flops_per_step * steps / dt / (self.peak * jax.device_count())
        if not self.enabled:
            return row
        self._jsonl.write(json.dumps({"kind": prefix, **row}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k == "step":
                    continue
                if isinstance(v, list):
                    for i, x in enumerate(v):
                        self._tb.add_scalar(f"{prefix}/{k}/{i}", x, step)
                else:
                    self._tb.add_scalar(f"{prefix}/{k}", v, step)
            self._tb.flush()
        if self._bar is not None and prefix == "train":
            post = {"loss": f"{row.get('loss', float('nan')):.3f}", "acc1": f"{row.get('acc1', float('nan')):.3f}",
                    "tok/s": f"{row['tokens_per_s']:.0f}"}
            if "mfu" in row:
                post["mfu"] = f"{row['mfu']:.1%}"
            self._bar.set_postfix(post, refresh=False)
        return row

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


def read_metrics(run_dir: str | Path) -> dict[str, Any]:
    """What a run's ``metrics.jsonl`` says, over every session of the run: ``train`` and ``eval``,
    the last row of each kind ({} if none), and ``best_loss``, ``best_loss_step`` (the lowest logged
    training loss; None if none). Unreadable lines (a write cut by a kill) are skipped."""
    last: dict[str, dict[str, Any]] = {"train": {}, "eval": {}}
    best: tuple[float, int] | None = None
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or row.get("kind") not in last:
            continue
        kind = row.pop("kind")
        last[kind] = row
        loss = row.get("loss")
        if kind == "train" and isinstance(loss, (int, float)) and np.isfinite(loss) and (best is None or loss < best[0]):
            best = (float(loss), int(row.get("step", 0)))
    return {**last, "best_loss": None if best is None else best[0], "best_loss_step": None if best is None else best[1]}
