"""A whole training run from a ``TrainConfig``: load, shard, resume, loop, log, evaluate, save."""

from __future__ import annotations

import dataclasses
import errno
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.ops.config import OpsConfig, resolve_attention_impl
from dflash_jax.runtime.compile_cache import use_compilation_cache
from dflash_jax.io.config import ConfigError, config_to_dict
from dflash_jax.models.config import DrafterConfig, TargetConfig, default_target_layer_ids, pair_mismatch
from dflash_jax.models.dflash2 import DFlash2Config, DFlash2Drafter
from dflash_jax.models.target import Target, unstack_layers
from dflash_jax.training import parallel
from dflash_jax.io.orbax import CheckpointError, step_dirs
from dflash_jax.training.checkpointing import Checkpointer, save_drafter_config
from dflash_jax.training.config import TrainConfig, save_train_config
from dflash_jax.training.data import build_dataset, read_prompts
from dflash_jax.training.monitor import Monitor, train_flops_per_sequence
from dflash_jax.training.optim import make_optimizer
from dflash_jax.training.trainer import (
    StepSpec, TargetGraph, TargetParams, TrainState, make_train_step, merge_drafter, split_drafter, split_target,
)

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def fresh_drafter_config(target: TargetConfig, config: TrainConfig) -> DrafterConfig:
    """A drafter shaped like one target layer, with the run's depth, block size, mask id and taps."""
    shape = config.drafter
    if shape.mask_token_id is None:
        raise ConfigError("drafter.mask_token_id is required to train a fresh drafter")
    ids = shape.target_layer_ids or default_target_layer_ids(target.num_layers, shape.num_layers)
    cfg = DrafterConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size, num_layers=shape.num_layers,
        num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
        attention_bias=False, mlp_bias=False, qk_norm=True, block_size=shape.block_size,
        mask_token_id=shape.mask_token_id, target_layer_ids=tuple(ids), num_target_layers=target.num_layers,
        max_position_embeddings=target.max_position_embeddings,
    )
    if shape.kind == "dflash2":
        cfg = as_dflash2_config(cfg, shape)
    cfg.validate("drafter")
    return cfg


def as_dflash2_config(cfg: DrafterConfig, shape) -> DFlash2Config:
    """``cfg`` with the DFlash2 fields of ``drafter:`` (``shape``)."""
    return DFlash2Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(DrafterConfig)},
                         conv_kernel_size=shape.conv_kernel_size, conv_group_size=shape.conv_group_size,
                         selector_rank=shape.selector_rank, selector_top_k=shape.selector_top_k)


def dflash2_from_dflash(drafter, config: TrainConfig) -> DFlash2Drafter:
    """A DFlash2 drafter that starts from a trained DFlash drafter: its every weight, identity
    convolutions (the same function at step 0) and a fresh selector (``drafter.init_seed``)."""
    dcfg = as_dflash2_config(drafter.config, config.drafter)
    dcfg.validate("drafter")
    new = DFlash2Drafter(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(config.drafter.init_seed))
    for mine, theirs in zip(new.layers, drafter.layers):
        for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
            nnx.update(getattr(mine, name), nnx.state(getattr(theirs, name)))
    for name in ("hidden_norm", "norm"):
        nnx.update(getattr(new, name), nnx.state(getattr(drafter, name)))
    new.fc[...] = drafter.fc[...]
    return new


def step_spec(config: TrainConfig, dcfg: DrafterConfig) -> StepSpec:
    return StepSpec(
        block_size=dcfg.block_size,
        mask_token_id=dcfg.mask_token_id,
        target_layer_ids=tuple(dcfg.target_layer_ids),
        num_anchors=config.loss.num_anchors,
        kind=config.loss.kind,
        weighting=config.loss.weighting,
        gamma=config.gamma(dcfg.block_size),
        dpace_alpha=config.loss.dpace_alpha,
        loss_chunk=config.loss.loss_chunk,
        normalizer=config.loss.normalizer,
        selector_alpha=config.loss.selector_alpha,
        compute_dtype=_DTYPES[config.model.compute_dtype],
        ops=OpsConfig(attention=resolve_attention_impl(config.model.attention_impl),
                      gpu_lowering=config.model.gpu_lowering),
        seed=config.seed,
    )


# Fields a resumed run may change: how long it runs and how it logs, saves, evaluates, shards and
# compiles. Every other field defines the saved state (drafter shape, optimizer and its schedule,
# data order and iterator state, loss) and must equal the run's config.yaml.
RESUME_MAY_CHANGE = ("steps", "save_every", "keep", "log_every", "progress", "tensorboard", "compilation_cache_dir",
                     "output_dir", "eval.", "mesh.", "model.attention_impl", "model.gpu_lowering", "data.eval_prompts",
                     "loss.loss_chunk")


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_resume(config: TrainConfig, run_dir: Path, resume: bool | None) -> int | None:
    """The step a run in ``run_dir`` resumes from (None: a fresh start), checked before anything is
    loaded or written: a changed config would fail in Orbax's restore, or worse restore and then
    overwrite config.yaml and drafter_config.json, which the kept checkpoints are exported with."""
    import yaml

    steps = step_dirs(run_dir)
    if not steps:
        if resume:
            raise FileNotFoundError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
        return None
    latest = steps[-1]
    if resume is False:
        raise FileExistsError(f"{run_dir} already has checkpoints (latest step {latest}); "
                              "pick another output_dir or resume")
    saved_path = run_dir / "config.yaml"
    # Without the run's config.yaml nothing says what the checkpoints hold: the resume is refused.
    # Writing the recipe the run was started with to that path (the documented way to go on) lets
    # the comparison below run against it.
    if not saved_path.is_file():
        raise ConfigError(
            f"output_dir {run_dir} holds checkpoints (latest step {latest}) but no config.yaml to check the new "
            f"config against; to resume, copy the config the run was started with to {saved_path}, "
            "or pick another output_dir"
        )
    try:
        saved = yaml.safe_load(saved_path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{saved_path}: invalid YAML: {err}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{saved_path}: cannot be read: {err}") from None
    if not isinstance(saved, dict) or not saved:
        raise ConfigError(f"{saved_path}: expected the run's config (a YAML mapping), got {type(saved).__name__}; "
                          "copy the config the run was started with there, or pick another output_dir")
    # Round-tripped through YAML so that tuples and lists, ints and floats compare as saved.
    new = _flat(yaml.safe_load(yaml.safe_dump(config_to_dict(config))))
    old = _flat(saved)
    changed = [f"{k} (run: {old[k]!r}, now: {new[k]!r})" for k in sorted(set(old) & set(new))
               if old[k] != new[k] and not k.startswith(RESUME_MAY_CHANGE)]
    if changed:
        raise ConfigError(
            f"output_dir {run_dir} holds a run (latest step {latest}) whose config.yaml differs in fields that "
            f"define its saved state: {'; '.join(changed)}. Resume with the run's config (only "
            f"{', '.join(k.rstrip('.') + ('.*' if k.endswith('.') else '') for k in RESUME_MAY_CHANGE)} "
            "may change) or pick another output_dir"
        )
    if config.steps < latest:
        raise ConfigError(f"steps={config.steps} is below the step {latest} that the run in {run_dir} has reached; "
                          f"resume with steps >= {latest}")
    return latest


@dataclasses.dataclass
class Session:
    """Everything a run holds; also handy in notebooks and tests (``setup`` then ``train_steps``)."""

    config: TrainConfig
    mesh: Any
    target_config: TargetConfig
    target_graph: TargetGraph  # the frozen target, split by ``split_target`` (layers stacked once)
    target_state: TargetParams  # (no per-layer copy is kept: ``target()`` rebuilds one on demand)
    drafter_config: DrafterConfig
    drafter_graphdef: Any
    drafter_rest: Any
    tx: Any
    state: TrainState
    step_fn: Any
    data: Any  # grain IterDataset
    data_iter: Any
    checkpointer: Checkpointer | None
    tokenizer: Any
    spec: StepSpec
    meta: dict
    eval_prompts: list | None = None

    def target(self) -> Target:
        """The target as a ``Target`` module (for the engine): per-layer copies of the stacked
        weights, alive only as long as the caller keeps the module."""
        if isinstance(self.target_graph, nnx.GraphDef):
            return nnx.merge(self.target_graph, self.target_state)
        return unstack_layers(self.target_graph, self.target_state)

    def drafter(self, dtype=None) -> nnx.Module:
        """The drafter with the current weights (float32 master weights cast to ``dtype``)."""
        return merge_drafter(self.drafter_graphdef, self.state.params, self.drafter_rest, dtype)

    @property
    def opt_step(self) -> int:
        return int(self.state.step) // self.config.optim.grad_accum

    def close(self) -> None:
        """Waits for the last checkpoint and closes the data iterator; the first error of the two
        is raised once both are closed."""
        error = None
        try:
            if self.checkpointer is not None:
                self.checkpointer.close()
        except Exception as err:
            error = err
        try:
            close = getattr(self.data_iter, "close", None)
            if close is not None:
                close()
        except Exception as err:
            error = error or err
        # Drop the iterator now: grain's prefetch iterator also closes itself in __del__, which
        # fails noisily when it only runs at interpreter shutdown.
        self.data_iter = None
        import gc

        gc.collect()
        if error is not None:
            raise error


def _load_tokenizer(config: TrainConfig):
    if config.model.target.startswith(("tiny:", "pattern:")) and not config.model.tokenizer:
        return None  # tiny random targets have no tokenizer: pre-tokenized / self-generated data only
    from dflash_jax.io.tokenizer import Tokenizer

    return Tokenizer(config.model.tokenizer or config.model.target)


def load_target_any(spec: str, dtype: str):
    """An HF target directory; ``tiny:<qwen3|llama>[:seed]``: a tiny random target; or
    ``pattern:<period>[:seed]``: a tiny target whose greedy output follows a cyclic permutation
    (``synthetic.pattern_target``, a learnable task for demos and tests)."""
    if spec.startswith("pattern:"):
        from dflash_jax.training.synthetic import pattern_target

        parts = spec.split(":")
        seed = int(parts[2]) if len(parts) > 2 else 0
        target, perm = pattern_target(int(parts[1]), seed=seed, dtype=_DTYPES[dtype])
        target.pattern_perm = tuple(int(x) for x in perm)  # static metadata for the data generator
        return target
    if spec.startswith("tiny:"):
        from dflash_jax.tiny import random_target, tiny_target_config

        parts = spec.split(":")
        kind = parts[1] or "qwen3"
        seed = int(parts[2]) if len(parts) > 2 else 0
        return random_target(tiny_target_config(kind), seed=seed, dtype=_DTYPES[dtype])
    from dflash_jax.io.checkpoint import load_target

    return load_target(spec, dtype=dtype)


def setup(config: TrainConfig, *, tokenizer=None, records=None, resume: bool | None = None,
          checkpoint: bool = True, devices=None) -> Session:
    """Builds a session; resumes from the latest checkpoint of ``output_dir`` when there is one
    (``resume=True`` requires one, ``resume=False`` refuses to reuse a directory with checkpoints)."""
    from dflash_jax.io.checkpoint import load_drafter

    parallel.maybe_initialize_distributed(config.mesh)
    if config.compilation_cache_dir is not None:
        use_compilation_cache(config.compilation_cache_dir)
    mesh = parallel.make_mesh(config.mesh, devices)
    run_dir = Path(config.output_dir)
    if checkpoint:
        check_resume(config, run_dir, resume)
    spec = config.model.target
    if not spec.startswith(("tiny:", "pattern:")) and not Path(spec).is_dir():
        raise FileNotFoundError(f"model.target: {spec}: no such directory")
    if config.model.drafter and not Path(config.model.drafter).is_dir():  # before the target takes minutes to load
        raise FileNotFoundError(f"model.drafter: {config.model.drafter}: no such directory")
    tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(config)

    target = load_target_any(config.model.target, config.model.target_dtype)
    if config.model.drafter:
        drafter = load_drafter(config.model.drafter, dtype="float32")
        if config.drafter.kind == "dflash2" and not isinstance(drafter, DFlash2Drafter):
            drafter = dflash2_from_dflash(drafter, config)
    else:
        dcfg = fresh_drafter_config(target.config, config)
        from dflash_jax.models.drafter import Drafter

        cls = DFlash2Drafter if isinstance(dcfg, DFlash2Config) else Drafter
        drafter = cls(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(config.drafter.init_seed))
    dcfg = drafter.config
    if pair_mismatch(dcfg, target.config) is not None:
        raise ConfigError(
            f"model.drafter: the drafter (num_target_layers={dcfg.num_target_layers}, vocab={dcfg.vocab_size}, "
            f"hidden_size={dcfg.hidden_size}) does not fit the target ({target.config.num_layers} layers, vocab "
            f"{target.config.vocab_size}, hidden_size {target.config.hidden_size})"
        )
    if config.data.seq_len < dcfg.block_size + 1:
        raise ConfigError(f"data.seq_len={config.data.seq_len} must exceed the block size {dcfg.block_size}")

    drafter_graphdef, params, drafter_rest = split_drafter(drafter)
    params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    params = jax.device_put(params, parallel.state_shardings(params, mesh, "drafter"))

    tx = make_optimizer(config.optim, config.steps)
    state_sh = parallel.train_state_shardings(params, tx, mesh)
    opt_state = jax.jit(tx.init, out_shardings=state_sh.opt_state)(params)
    state = TrainState(params, opt_state, jax.device_put(jnp.zeros((), jnp.int32), state_sh.step))

    eval_prompts = None
    if records is None and config.data.self_generated.num_examples:
        from dflash_jax.training.synthetic import pattern_records, self_generated

        sg = config.data.self_generated
        perm = getattr(target, "pattern_perm", None)
        if perm is not None:  # the target's greedy output is known in closed form: no decoding needed
            records, prompts = pattern_records(np.asarray(perm), sg.num_examples + sg.eval_prompts, sg.prompt_len,
                                               sg.new_tokens, sg.seed, exclude=(dcfg.mask_token_id,))
            records, eval_prompts = records[: sg.num_examples], prompts[sg.num_examples:]
        else:
            records, eval_prompts = self_generated(target, sg, exclude=(dcfg.mask_token_id,))
    if config.data.eval_prompts:
        eval_prompts = read_prompts(config.data.eval_prompts, tokenizer, config.eval.num_prompts,
                                    vocab_size=target.config.vocab_size)
    elif eval_prompts is not None:
        eval_prompts = eval_prompts[: config.eval.num_prompts]
    data = build_dataset(config.data, tokenizer, records=records, vocab_size=target.config.vocab_size,
                         process_index=jax.process_index(), process_count=jax.process_count())

    # The target's layers are stacked once here (after the data generation above, which runs the
    # engine on the unstacked module); dropping the module then frees its per-layer arrays.
    target_config = target.config
    target_graph, target_state = split_target(target)
    del target
    target_state = jax.device_put(target_state, parallel.state_shardings(target_state, mesh, "target"))
    data_iter = iter(data)

    checkpointer = None
    meta: dict[str, Any] = {"micro_step": 0, "opt_step": 0}
    if checkpoint:
        checkpointer = Checkpointer(run_dir, keep=config.keep)
        latest = checkpointer.latest_step()
        if latest is not None:  # check_resume allowed it
            try:
                state, meta = checkpointer.restore(latest, state, data_iter)
            except CheckpointError:
                checkpointer.close()
                raise
            state = jax.device_put(state, state_sh)
        if jax.process_index() == 0:
            save_train_config(config, run_dir)
            save_drafter_config(run_dir, dcfg)

    spec = step_spec(config, dcfg)
    step = make_train_step(drafter_graphdef, drafter_rest, target_graph, tx, spec)
    step_fn = parallel.jit_train_step(step, mesh, state_sh, parallel.tree_shardings(target_state))
    return Session(
        config=config, mesh=mesh, target_config=target_config, target_graph=target_graph, target_state=target_state,
        drafter_config=dcfg, drafter_graphdef=drafter_graphdef, drafter_rest=drafter_rest, tx=tx, state=state,
        step_fn=step_fn, data=data, data_iter=data_iter, checkpointer=checkpointer, tokenizer=tokenizer,
        spec=spec, meta=meta, eval_prompts=eval_prompts,
    )


def next_batch(session: Session) -> dict[str, jax.Array]:
    local = next(session.data_iter)
    return parallel.global_batch({k: np.asarray(v) for k, v in local.items()}, session.mesh)


class NonFiniteError(RuntimeError):
    """The loss, the gradient norm or the weights became NaN or infinite: the run stops before a
    checkpoint is written, so the kept checkpoints hold finite weights (``train.py`` reports it in one
    line). Its usual cause is the data, else the optimizer settings."""


@jax.jit
def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _is_disk_full(err: BaseException | None) -> bool:
    """Whether ``err`` or an exception it was raised from is ENOSPC (Orbax re-raises and wraps)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "No space left on device" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _kept(session: Session) -> str:
    """The finalized checkpoint steps of the run, once a save in progress has ended."""
    if session.checkpointer is not None:
        try:
            session.checkpointer.wait()
        except Exception:  # the save in progress failed: it is not among the finalized steps
            pass
    return ", ".join(map(str, step_dirs(Path(session.config.output_dir)))) or "none"


def _disk_full_error(session: Session, step: int | None) -> CheckpointError:
    directory = session.checkpointer.directory if session.checkpointer is not None else Path(session.config.output_dir)
    which = f"the checkpoint of step {step}" if step is not None else "the last checkpoint"
    return CheckpointError(
        f"{directory}: cannot write {which}: No space left on device; the earlier checkpoints "
        f"({_kept(session)}) are intact: free space and rerun the command to resume"
    )


def save(session: Session) -> None:
    """Writes a checkpoint of the current state; refuses (``NonFiniteError``) when the weights are
    not finite, and reports a full disk in one line (``CheckpointError``)."""
    if session.checkpointer is None:
        return
    micro = int(session.state.step)
    meta = {"micro_step": micro, "opt_step": micro // session.config.optim.grad_accum,
            "time": time.time()}
    if not bool(_all_finite(session.state.params)):
        raise NonFiniteError(
            f"step {meta['opt_step']}: the drafter's weights are not finite (NaN or inf); the run stops without "
            f"saving them (kept checkpoints: {_kept(session)})")
    try:
        session.checkpointer.save(meta["opt_step"], session.state, session.data_iter, meta)
    except Exception as err:
        if _is_disk_full(err):
            raise _disk_full_error(session, meta["opt_step"]) from None
        raise


def _check_finite(metrics: list[dict], steps: list[tuple[int, int]], session: Session) -> None:
    """Raises ``NonFiniteError`` naming the first step whose loss or gradient norm is not finite
    (``metrics`` already on the host, ``steps`` their ``(optimizer step, micro-step)``)."""
    for (opt_step, micro), m in zip(steps, metrics):
        bad = {k: float(np.asarray(m[k]).reshape(-1)[0]) for k in ("loss", "grad_norm")
               if k in m and not np.all(np.isfinite(m[k]))}
        if bad:
            what = " and ".join(f"the {k.replace('_', ' ')} ({v})" for k, v in bad.items())
            raise NonFiniteError(
                f"step {opt_step}{f' (micro-step {micro})' if micro != opt_step else ''}: {what} "
                f"{'is' if len(bad) == 1 else 'are'} not finite; the run stops without saving "
                f"(kept checkpoints: {_kept(session)}). Usual causes: token ids the target's embedding "
                "lacks, or optim.lr too high")


def evaluate(session: Session, prompts) -> dict[str, float]:
    from dflash_jax.training.evaluation import speculative_tau

    target = session.target()  # per-layer copies for the engine, freed after the evaluation
    drafter = session.drafter(dtype=jnp.dtype(session.config.model.target_dtype))
    stop = list(session.target_config.eos_token_ids) or None
    return speculative_tau(target, drafter, prompts, session.config.eval.max_new_tokens, stop_token_ids=stop)


def train(config: TrainConfig, *, tokenizer=None, records=None, resume: bool | None = None,
          max_steps: int | None = None) -> dict[str, Any]:
    """Trains to ``config.steps`` optimizer steps (or stops after ``max_steps`` more, for tests:
    the run is then left resumable). Returns the last logged train and eval metrics, the step
    reached, the step it resumed from (0: a fresh run) and ``already_complete``: the run in
    ``output_dir`` had reached ``steps`` already, so nothing ran (its metrics are the logged ones)."""
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    latest = check_resume(config, Path(config.output_dir), resume)
    if latest is not None and latest >= config.steps:  # nothing to train, nor to evaluate again
        from dflash_jax.training.monitor import read_metrics

        history = read_metrics(config.output_dir)
        return {"train": history["train"], "eval": history["eval"], "steps": latest, "resumed_from": latest,
                "already_complete": True}
    session = setup(config, tokenizer=tokenizer, records=records, resume=resume)
    cfg = config
    accum = cfg.optim.grad_accum
    start_opt = session.opt_step
    end_opt = cfg.steps if max_steps is None else min(cfg.steps, start_opt + max_steps)
    flops = train_flops_per_sequence(session.target_config, session.drafter_config, cfg.data.seq_len,
                                      cfg.loss.num_anchors, distill=cfg.loss.kind != "ce") * cfg.data.batch_size * accum
    monitor = Monitor(cfg.output_dir, cfg.steps, start_opt, progress=cfg.progress, tensorboard=cfg.tensorboard,
                      flops_per_step=flops)
    if start_opt:
        monitor.note(f"resumed from step {start_opt} of {cfg.steps} ({Path(cfg.output_dir) / 'checkpoints'})")
    prompts = session.eval_prompts
    last: dict[str, Any] = {}
    last_eval: dict[str, Any] = {}

    def run_eval(step: int) -> None:
        nonlocal last_eval
        if prompts:
            row = evaluate(session, prompts)
            last_eval = monitor.log(step, row, tokens=0, prefix="eval")
            monitor.note(f"step {step}: eval tau {row['tau']:.3f}")

    try:
        if cfg.eval.at_start and start_opt == 0:
            run_eval(0)
        acc_metrics: list[dict] = []
        acc_steps: list[tuple[int, int]] = []  # (optimizer step, micro-step) of each entry
        checked = 0  # acc_metrics[:checked] are known to be finite
        tokens = 0
        for opt_step in range(start_opt + 1, end_opt + 1):
            for j in range(accum):
                batch = next_batch(session)
                acc_steps.append((opt_step, (opt_step - 1) * accum + j + 1))
                session.state, metrics = session.step_fn(session.state, session.target_state, batch)
                acc_metrics.append(metrics)
                tokens += int(np.prod(batch["input_ids"].shape))
            monitor.advance()
            # Metrics come to the host only here and before a save (which waits for the step anyway);
            # a non-finite loss or gradient norm stops the run there, before anything is saved.
            if opt_step % cfg.log_every == 0 or opt_step == end_opt:
                host = jax.device_get(acc_metrics)
                _check_finite(host[checked:], acc_steps[checked:], session)
                mean = {k: np.mean([m[k] for m in host], axis=0) for k in host[0]}
                last = monitor.log(opt_step, mean, tokens=tokens)
                acc_metrics, acc_steps, checked, tokens = [], [], 0, 0
            if opt_step % cfg.save_every == 0 or opt_step == end_opt:
                _check_finite(jax.device_get(acc_metrics[checked:]), acc_steps[checked:], session)
                checked = len(acc_metrics)
                save(session)
            if cfg.eval.every and opt_step % cfg.eval.every == 0 and opt_step != cfg.steps:
                run_eval(opt_step)
        if end_opt == cfg.steps and (cfg.eval.every or prompts):
            if session.opt_step == cfg.steps and prompts:
                run_eval(cfg.steps)
    except BaseException:
        # The error in flight is the one to report: closing (which waits for a checkpoint being
        # written, on a disk that may be full) must neither replace it nor add to it.
        monitor.close()
        try:
            session.close()
        except Exception:
            pass
        raise
    monitor.close()
    try:
        session.close()  # waits for the last checkpoint to be written
    except Exception as err:
        if _is_disk_full(err):
            raise _disk_full_error(session, None) from None
        raise
    return {"train": last, "eval": last_eval, "steps": end_opt, "resumed_from": start_opt, "already_complete": False}
