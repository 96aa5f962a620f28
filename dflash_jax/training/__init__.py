"""DFlash drafter training (``python train.py``; see docs/training.md).

Modules, one job each: ``config`` (TrainConfig), ``data`` (JSONL -> tokens + loss mask -> grain),
``anchors`` (anchor blocks, attention lengths, labels), ``losses`` (CE / distillation, decay and
D-PACE slot weights, acceptance metrics), ``optim`` (AdamW + warmup/cosine + clipping + accumulation),
``trainer`` (the jitted step), ``parallel`` (mesh and shardings), ``checkpointing`` (Orbax, resume,
export), ``monitor`` (tqdm, JSONL, TensorBoard, MFU), ``evaluation`` (tau with the engine),
``synthetic`` (self-generated data, the pattern target) and ``run`` (a whole run).
"""

__all__ = ["load_drafter_from_orbax", "train"]


def __getattr__(name):  # light package import: modules load on first use
    if name == "load_drafter_from_orbax":
        from dflash_jax.io.orbax import load_drafter_from_orbax

        return load_drafter_from_orbax
    if name == "train":
        from dflash_jax.training.run import train

        return train
    raise AttributeError(name)
