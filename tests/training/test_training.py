"""Drafter training end to end on CPU: learning, resume, crash-safe saves, export, sharding, data."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.training.config import load_train_config

REPO = Path(__file__).resolve().parents[2]

TINY = dict(
    model=dict(target="pattern:3:0", compute_dtype="float32", target_dtype="float32"),
    drafter=dict(num_layers=2, block_size=8, mask_token_id=95),
    data=dict(seq_len=64, batch_size=8,
              self_generated=dict(num_examples=512, prompt_len=8, new_tokens=56, eval_prompts=8)),
    loss=dict(num_anchors=32),
    optim=dict(lr=5e-3),
    mesh=dict(data=1),
    eval=dict(num_prompts=8, max_new_tokens=56),
    steps=150, save_every=1000, log_every=10, progress=False, tensorboard=True,
)


def _config(tmp_path, name, **changes):
    """TINY with dotted overrides, through the project's config loader (unknown keys are errors)."""
    import yaml

    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(dict(TINY, output_dir=str(tmp_path / name))))
    return load_train_config(path, [f"{k}={json.dumps(v)}" for k, v in changes.items()])


def _rows(run_dir, kind):
    return [r for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


@pytest.mark.slow
def test_training_learns_the_targets_pattern(tmp_path):
    """A pattern target (greedy output follows a cyclic permutation, taps carry the context): loss
    falls, slot-1 accuracy rises, and real speculative decoding with the engine accepts far more."""
    from dflash_jax.training.run import train

    cfg = _config(tmp_path, "learn", **{"eval.at_start": True})
    result = train(cfg)
    train_rows, eval_rows = _rows(cfg.output_dir, "train"), _rows(cfg.output_dir, "eval")
    assert [r["step"] for r in eval_rows] == [0, cfg.steps]
    tau_before, tau_after = eval_rows[0]["tau"], eval_rows[-1]["tau"]
    assert tau_before < 1.3, tau_before
    assert tau_after > 3.0, (tau_before, tau_after)  # measured 5.1 (teacher-forced tau_blocks 7.2 of 8)
    assert train_rows[0]["loss"] > 5.0 * train_rows[-1]["loss"]
    assert train_rows[0]["acc1"] < 0.2 and train_rows[-1]["acc1"] > 0.7
    assert train_rows[-1]["tau_blocks"] > 4.0
    assert result["train"]["tokens_per_s"] > 0
    assert list((Path(cfg.output_dir) / "tb").iterdir())  # TensorBoard events written
    assert (Path(cfg.output_dir) / "config.yaml").exists()
    # The resolved config round-trips through the loader.
    again = load_train_config(Path(cfg.output_dir) / "config.yaml")
    assert again == cfg


def _params(run_dir):
    from dflash_jax.io.orbax import load_drafter_from_orbax
    from flax import nnx

    return jax.tree.leaves(nnx.state(load_drafter_from_orbax(run_dir), nnx.Param))


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
    """The same 6-step run (gradient accumulation 2, packing, D-PACE) done straight, and done as
    3 steps through the CLI, then a restart that resumes automatically for the other 3."""
    from dflash_jax.training import cli as train_cli
    from dflash_jax.io.config import save_config
    from dflash_jax.training.run import train

    tmp = tmp_path_factory.mktemp("resume")
    changes = {"steps": 6, "optim.grad_accum": 2, "data.pack": True, "data.batch_size": 4,
               "loss.weighting": "dpace", "save_every": 2, "eval.num_prompts": 0}  # what is compared: weights
    straight = _config(tmp, "straight", **changes)
    train(straight)
    split = _config(tmp, "split", **changes)
    save_config(split, tmp / "split_cli.yaml")
    assert train_cli.main(["--config", str(tmp / "split_cli.yaml"), "--max-steps", "3"]) == 0
    second = train(split)  # resumes automatically from step 3 (the latest checkpoint)
    return straight, split, second


@pytest.mark.slow
def test_resume_continues_exactly(resumed_runs):
    """N steps in one run == k steps, a restart (restored optimizer state, step and data iterator),
    then N - k steps."""
    from dflash_jax.training.run import setup

    straight, split, second = resumed_runs
    assert second["steps"] == 6
    assert [r["step"] for r in _rows(split.output_dir, "train")] == [3, 6]
    from dflash_jax.training.checkpointing import Checkpointer

    ckpt = Checkpointer(split.output_dir, keep=split.keep)
    steps = ckpt.all_steps()
    ckpt.close()
    assert steps == [3, 4, 6]  # saved at 2, 3 (the stop), 4, 6; the last keep=3 kept
    for a, b in zip(_params(straight.output_dir), _params(split.output_dir)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # And it really moved away from the initialisation.
    session = setup(split, checkpoint=False)
    init = jax.tree.leaves(session.state.params)
    session.close()
    assert any(not np.allclose(np.asarray(a), np.asarray(b)) for a, b in zip(init, _params(split.output_dir)))


CRASH = """
import os, sys
import jax, jax.numpy as jnp, numpy as np
import grain
from dflash_jax.training.checkpointing import Checkpointer
from dflash_jax.training.trainer import TrainState

run_dir = sys.argv[1]
ckpt = Checkpointer(run_dir, keep=3)
def state(v):
    return TrainState(params={"w": jnp.full((64, 64), v)}, opt_state={"m": jnp.full((64,), v)},
                      step=jnp.asarray(int(v), jnp.int32))
it = iter(grain.MapDataset.range(100).to_iter_dataset())
next(it)
ckpt.save(1, state(1.0), it, {"micro_step": 1, "opt_step": 1})
ckpt.wait()
next(it)
# Die in the middle of writing checkpoint 2: right after the data item is written, before the
# checkpoint is finalized.
orig = grain.checkpoint.CheckpointHandler.save
def dying_save(self, directory, *a, **k):
    orig(self, directory, *a, **k)
    os._exit(17)
grain.checkpoint.CheckpointHandler.save = dying_save
ckpt.save(2, state(2.0), it, {"micro_step": 2, "opt_step": 2})
ckpt.wait()
print("NOT REACHED")
"""


@pytest.mark.slow
def test_interrupted_save_keeps_the_last_good_checkpoint(tmp_path):
    import grain
    from dflash_jax.training.checkpointing import Checkpointer
    from dflash_jax.training.trainer import TrainState

    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 17, proc.stdout + proc.stderr
    leftovers = [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()]
    assert any("tmp" in name for name in leftovers), leftovers  # the interrupted save left a partial dir

    ckpt = Checkpointer(tmp_path / "run", keep=3)
    assert ckpt.all_steps() == [1]
    template = TrainState(params={"w": jnp.zeros((64, 64))}, opt_state={"m": jnp.zeros((64,))},
                          step=jnp.zeros((), jnp.int32))
    it = iter(grain.MapDataset.range(100).to_iter_dataset())
    restored, meta = ckpt.restore(1, template, it)
    assert meta["micro_step"] == 1 and float(restored.params["w"][0, 0]) == 1.0
    assert next(it) == 1  # the data iterator continues where checkpoint 1 left it
    ckpt.close()
    assert not any("tmp" in p.name for p in (tmp_path / "run" / "checkpoints").iterdir())


def _reference_draft_logits(ref_target, ref_drafter, ctx, anchor, block):
    import dflash.model as dm
    import torch

    with torch.no_grad():
        out = ref_target(torch.tensor([ctx]), output_hidden_states=True)
        feats = dm.extract_context_feature(out.hidden_states, ref_drafter.target_layer_ids)
        block_ids = torch.tensor([[anchor] + [ref_drafter.mask_token_id] * (block - 1)])
        noise = ref_target.get_input_embeddings()(block_ids)
        positions = torch.arange(len(ctx) + block)[None]
        hidden = ref_drafter(target_hidden=feats, noise_embedding=noise, position_ids=positions)
        return ref_drafter.compute_logits(hidden[:, 1:], ref_target.lm_head)[0].numpy()


@pytest.mark.slow
def test_export_round_trip(tmp_path, reference, resumed_runs):
    """train.py export writes the z-lab format: the authors' DFlashDraftModel loads it with the same
    draft logits as our loader, which equals the Orbax checkpoint."""
    from dflash_jax.training import cli as train_cli
    from dflash_jax.models.api import draft_logits
    from dflash_jax.io.checkpoint import load_drafter, save_target
    from dflash_jax.io.orbax import load_drafter_from_orbax
    from dflash_jax.training.run import load_target_any

    cfg = resumed_runs[1]
    out = tmp_path / "exported"
    assert train_cli.main(["export", "--checkpoint", cfg.output_dir, "--output", str(out), "--dtype", "float32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["block_size"] == 8 and config["dflash_config"]["mask_token_id"] == 95

    target = load_target_any("pattern:3:0", "float32")
    target_dir = tmp_path / "target"
    save_target(target, target_dir)
    ours = load_drafter(out)
    orbax = load_drafter_from_orbax(cfg.output_dir)
    via_loader = load_drafter(cfg.output_dir)  # the lead's loader accepts a run directory too
    ref_target, ref_drafter = reference.target(target_dir), reference.drafter(out)
    seq = np.random.default_rng(5).integers(0, 90, 24).tolist()
    for n in (1, 9, 20):
        want = _reference_draft_logits(ref_target, ref_drafter, seq[:n], seq[n], 8)
        for drafter in (ours, orbax, via_loader):
            got = np.asarray(draft_logits(drafter, target, seq[:n], seq[n]))
            np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_sharded_step_equals_single_device(tmp_path, attention):
    """One train step on a (data=2, fsdp=2, tensor=2) mesh of 8 fake CPU devices equals the same
    step on one device; the drafter's weights and optimizer state really are sharded. With the kernels
    (interpret mode here), each device runs them on its rows and heads (``sharding.with_kernel_mesh``),
    not the whole batch gathered."""
    from dflash_jax.training.run import next_batch, setup

    if jax.device_count() < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/conftest.py)")
    changes = {"data.batch_size": 4, "steps": 2, "optim.lr": 1e-2, "model.attention_impl": attention}
    results = []
    for mesh, devices in [(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1]),
                          (dict(data=2, fsdp=2, tensor=2), jax.devices()[:8])]:
        cfg = _config(tmp_path, f"shard_{attention}", **changes, **{f"mesh.{k}": v for k, v in mesh.items()})
        session = setup(cfg, checkpoint=False, devices=devices)
        batches = [next_batch(session) for _ in range(2)]
        if mesh["data"] > 1:
            lowered = session.step_fn.lower(session.state, session.target_state, batches[0]).as_text()
            assert ("manual_computation" in lowered) == (attention == "pallas")
        metrics = []
        for batch in batches:
            session.state, m = session.step_fn(session.state, session.target_state, batch)
            metrics.append(float(m["loss"]))
        if mesh["fsdp"] > 1:
            specs = {str(x.sharding.spec) for x in jax.tree.leaves(session.state.params)}
            assert any("fsdp" in s for s in specs) and any("tensor" in s for s in specs), specs
            mu_specs = {str(x.sharding.spec) for x in jax.tree.leaves(session.state.opt_state)}
            assert any("fsdp" in s for s in mu_specs)
        results.append((metrics, [np.asarray(x) for x in jax.tree.leaves(session.state.params)]))
        session.close()
    (loss1, p1), (loss8, p8) = results
    np.testing.assert_allclose(loss1, loss8, rtol=1e-5)
    for a, b in zip(p1, p8):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_chat_data_supervises_assistant_tokens_only(tmp_path):
    from tokenizer_fixtures import write_qwen_tokenizer

    from dflash_jax.io.tokenizer import Tokenizer
    from dflash_jax.training.config import DataConfig
    from dflash_jax.training.data import build_dataset, tokenize_record

    tok = Tokenizer(write_qwen_tokenizer(tmp_path / "tok"))
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And three plus three?"},
        {"role": "assistant", "content": "Six, clearly."},
    ]
    ex = tokenize_record({"messages": messages}, tok, 4096)
    ids, mask = ex["input_ids"], ex["loss_mask"]
    assert ids.tolist() == list(tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True))
    spans, start = [], None
    for i, m in enumerate(mask.tolist() + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append(tok.decode(ids[start:i].tolist(), skip_special_tokens=False))
            start = None
    assert len(spans) == 2
    assert "Four." in spans[0] and "Six, clearly." in spans[1]
    for span in spans:
        assert span.rstrip("\n").endswith("<|im_end|>")
        assert "user" not in span and "terse" not in span and "<|im_start|>" not in span
    # Prompt/answer records and plain text; truncation; padding rows carry segment 0.
    pa = tokenize_record({"prompt": "Hi", "response": "Hello there."}, tok, 4096)
    assert pa["loss_mask"].sum() > 0 and pa["loss_mask"][0] == 0
    txt = tokenize_record({"text": "plain text here"}, tok, 3)
    assert len(txt["input_ids"]) == 3 and txt["loss_mask"].tolist() == [1, 1, 1]
    records = [{"messages": messages}, {"text": "some text " * 5}]
    it = iter(build_dataset(DataConfig(train_files=("x",), seq_len=96, batch_size=2, prefetch=0), tok,
                            records=records))
    batch = next(it)
    assert batch["input_ids"].shape == (2, 96)
    assert ((batch["segment_ids"] == 0) <= (batch["loss_mask"] == 0)).all()


def test_cli_rejects_unknown_keys(tmp_path, capsys):
    from dflash_jax.training import cli as train_cli

    assert train_cli.main(["--config", str(REPO / "configs" / "train_tiny.yaml"), "optim.lrr=1"]) == 2
    assert "lrr" in capsys.readouterr().err
    # A compilation cache that cannot be created fails before the target loads, naming the field.
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert train_cli.main(["--config", str(REPO / "configs" / "train_tiny.yaml"),
                           f"compilation_cache_dir={blocker / 'cache'}", f"output_dir={tmp_path / 'run'}"]) == 2
    assert "config error: compilation_cache_dir" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["train_tiny", "qwen3_8b_b16", "qwen3_4b_b16", "llama3.1_8b_b16"])
def test_shipped_configs_load(name):
    from dflash_jax.ops.config import resolve_attention_impl

    cfg = load_train_config(REPO / "configs" / f"{name}.yaml")
    if name != "train_tiny":
        assert (cfg.drafter.block_size, cfg.drafter.num_layers, cfg.optim.lr, cfg.optim.warmup_ratio,
                cfg.data.seq_len, cfg.loss.num_anchors) == (16, 5, 6e-4, 0.04, 4096, 512)
        assert cfg.gamma(16) == 7.0
        # the kernels (the drafter's Pallas kernel, the target's flash attention) on accelerators
        assert cfg.model.attention_impl == "auto"
        assert resolve_attention_impl(cfg.model.attention_impl) == "xla"  # the suite runs on the CPU


def test_gpu_lowering_reaches_the_step_ops():
    """``model.gpu_lowering`` is the step's ``OpsConfig.gpu_lowering`` (the drafter's block attention
    and its backward on the Mosaic GPU kernels); a value that is no lowering is refused, naming it."""
    from dflash_jax.training.run import step_spec
    from dflash_jax.tiny import tiny_drafter_config, tiny_target_config

    cfg = load_train_config(REPO / "configs" / "train_tiny.yaml", ["model.gpu_lowering=mosaic"])
    dcfg = tiny_drafter_config(tiny_target_config(), num_layers=1, block_size=4, mask_token_id=0)
    assert cfg.model.gpu_lowering == "mosaic" and step_spec(cfg, dcfg).ops.gpu_lowering == "mosaic"
    assert load_train_config(REPO / "configs" / "train_tiny.yaml").model.gpu_lowering == "mosaic"
    triton = load_train_config(REPO / "configs" / "train_tiny.yaml", ["model.gpu_lowering=triton"])
    assert step_spec(triton, dcfg).ops.gpu_lowering == "triton"
    with pytest.raises(ValueError, match="gpu_lowering"):
        load_train_config(REPO / "configs" / "train_tiny.yaml", ["model.gpu_lowering=cuda"]).validate()


@pytest.mark.parametrize("kind,weighting", [("kl", "dpace")])
@pytest.mark.slow
def test_chunked_loss_equals_unchunked(kind, weighting):
    """``loss.loss_chunk`` (head + loss over chunks of blocks under jax.checkpoint) changes memory,
    not the loss or the gradients; distillation losses included."""
    from flax import nnx

    from dflash_jax.tiny import random_drafter, random_target, tiny_drafter_config, tiny_target_config
    from dflash_jax.training.trainer import StepSpec, drafter_loss, split_drafter, split_target, target_forward

    tcfg = tiny_target_config(num_layers=4)
    dcfg = tiny_drafter_config(tcfg, block_size=4, num_layers=1)
    target, drafter = random_target(tcfg, seed=0), random_drafter(dcfg, seed=1)
    gd, params, rest = split_drafter(drafter)
    target_graph, target_params = split_target(target)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 90, (2, 24)), jnp.int32)
    batch = {"input_ids": ids, "loss_mask": jnp.ones_like(ids).at[:, :5].set(0), "segment_ids": jnp.ones_like(ids)}
    out = []
    for chunk in (0, 2):
        spec = StepSpec(block_size=4, mask_token_id=dcfg.mask_token_id, target_layer_ids=dcfg.target_layer_ids,
                        num_anchors=8, kind=kind, weighting=weighting, loss_chunk=chunk, compute_dtype=jnp.float32)

        @jax.jit
        def f(params):
            fwd = target_forward(target_graph, target_params, ids, spec)
            return jax.value_and_grad(drafter_loss, has_aux=True)(params, gd, rest, target, batch, fwd,
                                                                  jax.random.key(0), spec)

        (loss, metrics), grads = f(params)
        assert np.isfinite(float(loss)) and float(loss) > 0
        out.append((float(loss), jax.tree.leaves(grads), float(metrics["tau_blocks"])))
    (l0, g0, t0), (l1, g1, t1) = out
    np.testing.assert_allclose(l0, l1, rtol=1e-5)
    assert t0 == t1
    for a, b in zip(g0, g1):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    del nnx


def test_serve_generate_output_is_training_data(tmp_path):
    """``serve.py generate`` lines (prompt + the target's output_ids) train on the exact output tokens."""
    from tokenizer_fixtures import write_qwen_tokenizer

    from dflash_jax.io.tokenizer import Tokenizer
    from dflash_jax.training.data import read_prompts, tokenize_record

    tok = Tokenizer(write_qwen_tokenizer(tmp_path / "tok"))
    messages = [{"role": "user", "content": "Count to three."}]
    line = {"messages": messages, "output_ids": [5, 6, 7, 8], "text": "ignored", "tau": 1.0}
    ex = tokenize_record(line, tok, 4096)
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert ex["input_ids"].tolist() == prompt + [5, 6, 7, 8]
    assert ex["loss_mask"].tolist() == [0] * len(prompt) + [1] * 4
    ex = tokenize_record({"prompt_ids": [1, 2, 3], "output_ids": [9, 9]}, None, 4096)
    assert ex["input_ids"].tolist() == [1, 2, 3, 9, 9] and ex["loss_mask"].tolist() == [0, 0, 0, 1, 1]
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps({"messages": messages + [{"role": "assistant", "content": "1 2 3"}]}) + "\n"
                    + json.dumps({"prompt_ids": [4, 5]}) + "\n")
    assert read_prompts(path, tok) == [prompt, [4, 5]]


@pytest.mark.parametrize("override,field", [
    ("optim.lr=.nan", "optim.lr"), ("optim.lr=.inf", "optim.lr"), ("optim.b1=5", "optim.b1"),
    ("optim.eps=-1", "optim.eps"), ("optim.clip_norm=-1", "optim.clip_norm"),
    ("optim.weight_decay=-1", "optim.weight_decay"), ("optim.min_lr_ratio=-3", "optim.min_lr_ratio"),
    ("data.prefetch=-1", "data.prefetch"), ("data.worker_count=-1", "data.worker_count"),
    ("data.max_examples=-1", "data.max_examples"), ("eval.num_prompts=-1", "num_prompts"),
    ("model.target=tiny:foo", "model.target"), ("model.target=pattern:abc", "model.target"),
    ("data.self_generated.num_examples=-5", "data.self_generated.num_examples"),
    ("loss.loss_chunk=-1", "loss.loss_chunk"), ("drafter.mask_token_id=-1", "drafter.mask_token_id"),
])
def test_config_rejects_out_of_range_values(override, field):
    from dflash_jax.io.config import ConfigError

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_train_config(REPO / "configs" / "train_tiny.yaml", [override])


def _cli(argv, capsys):
    """``train.py`` in-process: ``(exit status, last stderr line)``."""
    from dflash_jax.training import cli as train_cli

    rc = train_cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err[-1] if err else ""


def test_cli_setup_errors_are_one_line(tmp_path, capsys):
    """User mistakes found while a run is set up exit 2 with a one-line error naming the field or
    file, not a traceback; nothing is written to output_dir."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3]}\nnot json\n')
    base = ["--config", str(REPO / "configs" / "train_tiny.yaml"), f"output_dir={tmp_path / 'run'}", "steps=2"]
    for extra, want in [
        (["data.seq_len=4"], "config error: data.seq_len=4"),
        (["drafter.mask_token_id=null"], "config error: drafter.mask_token_id"),
        (["drafter.mask_token_id=100000"], "error: drafter: dflash_config.mask_token_id=100000"),
        (["drafter.target_layer_ids=[0,99]"], "error: drafter: target_layer_ids [99]"),
        (["model.target=/nonexistent"], "error: model.target: /nonexistent"),
        (["model.drafter=/nonexistent"], "error: model.drafter: /nonexistent: no such directory"),
        (["data.self_generated.num_examples=0", f"data.train_files=[{bad}]"], f"error: {bad}:2: invalid JSON"),
        (["--max-steps", "-3"], "error: --max-steps"),
    ]:
        rc, line = _cli(base + extra, capsys)
        assert (rc, line[:len(want)]) == (2, want), (extra, line)
    assert not (tmp_path / "run").exists()


def _snapshot(run_dir):
    return {str(p.relative_to(run_dir)): p.read_bytes() if p.is_file() else None for p in Path(run_dir).rglob("*")}


@pytest.fixture
def run_copy(resumed_runs, tmp_path):
    """A copy of the finished 6-step run (checkpoints 3, 4, 6) to damage or resume wrongly."""
    import shutil

    split = resumed_runs[1]
    run = tmp_path / "run"
    shutil.copytree(split.output_dir, run)
    (tmp_path / "cli.yaml").write_text((run / "config.yaml").read_text())
    return run, ["--config", str(tmp_path / "cli.yaml"), f"output_dir={run}"]


@pytest.mark.slow
def test_resume_refuses_a_changed_config(run_copy, capsys):
    """A resume whose config changes what the saved state is (drafter shape, mask id, optimizer
    structure) or asks for fewer steps than done is refused before anything is loaded or written."""
    from dflash_jax.training.run import check_resume

    run, base = run_copy
    before = _snapshot(run)
    for extra, fields in [
        (["drafter.num_layers=3"], ["drafter.num_layers"]),
        (["optim.grad_accum=1"], ["optim.grad_accum"]),
        (["drafter.block_size=4", "drafter.mask_token_id=90"], ["drafter.block_size", "drafter.mask_token_id"]),
        (["model.target=pattern:3:1"], ["model.target"]),
    ]:
        rc, line = _cli(base + ["steps=8"] + extra, capsys)
        assert rc == 2 and line.startswith("config error: output_dir"), line
        assert all(f"{f} (run:" in line for f in fields), line
    rc, line = _cli(base + ["steps=5"], capsys)
    assert rc == 2 and "steps=5 is below the step 6" in line, line
    assert _snapshot(run) == before
    # What only changes how the run continues, logs, saves and evaluates may change.
    cfg = load_train_config(run / "config.yaml", ["steps=9", "log_every=1", "save_every=3", "keep=5",
                                                  "eval.num_prompts=2", "loss.loss_chunk=4", f"output_dir={run}"])
    assert check_resume(cfg, run, None) == 6


def test_damaged_latest_checkpoint_names_it_and_the_intact_ones(run_copy, tmp_path, capsys):
    run, base = run_copy
    for f in (run / "checkpoints" / "6" / "params").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[:10])
    before = _snapshot(run)
    want = f"error: {run / 'checkpoints' / '6'}: checkpoint step 6 cannot be read"
    rc, line = _cli(base + ["steps=8"], capsys)
    assert rc == 2 and line.startswith(want) and "steps 3, 4" in line and "resume from step 4" in line, line
    rc, line = _cli(["export", "--checkpoint", str(run), "--output", str(tmp_path / "out")], capsys)
    assert rc == 2 and line.startswith(want), line
    assert _snapshot(run) == before  # nothing deleted or rewritten
    # An empty step directory (a partial copy) is reported the same way.
    emptied = tmp_path / "emptied"
    emptied.mkdir()
    for item in (run / "checkpoints" / "6").iterdir():
        item.rename(emptied / item.name)
    rc, line = _cli(["export", "--checkpoint", str(run), "--output", str(tmp_path / "out")], capsys)
    assert rc == 2 and line.startswith(want), line
    # The earlier checkpoints are intact.
    assert _cli(["export", "--checkpoint", str(run), "--step", "4", "--output", str(tmp_path / "out")], capsys)[0] == 0
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_export_errors(run_copy, tmp_path, capsys):
    run, _ = run_copy
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for args, want in [
        (["--checkpoint", str(tmp_path / "nonexistent")], "not a training run directory"),
        (["--checkpoint", str(run), "--step", "999"], "no checkpoint of step 999 (steps: [3, 4, 6])"),
        (["--checkpoint", str(run), "--output", str(a_file)], "exists and is not a directory"),
        (["--checkpoint", str(run / "checkpoints" / "4"), "--step", "6"], "is the checkpoint of step 4, but step 6"),
    ]:
        if "--output" not in args:
            args = args + ["--output", str(tmp_path / "out")]
        rc, line = _cli(["export"] + args, capsys)
        assert rc == 2 and line.startswith("error: ") and want in line, (args, line)
    assert not (tmp_path / "out").exists()


def test_pretrain_input_errors(tmp_path, capsys):
    from dflash_jax.io.config import ConfigError
    from dflash_jax.training.pretrain import load_pretrain_config, main

    config = REPO / "configs" / "embedded_target.yaml"
    (tmp_path / "empty").mkdir()
    for override, want in [("export_dtype=foo", "export_dtype"), (f"data.corpus={tmp_path / 'nope'}", "data.corpus"),
                           (f"data.corpus={tmp_path / 'empty'}", "holds no .py or .txt files")]:
        with pytest.raises(ConfigError, match=want):
            load_pretrain_config(config, [override, "tokenizer=x"])
    assert main(["--config", str(config), f"tokenizer={tmp_path / 'no_tok'}", f"output_dir={tmp_path / 'out'}"]) == 2
    assert "no_tok" in capsys.readouterr().err


def test_a_drafter_of_another_hidden_size_is_refused_before_anything_is_written(tmp_path, capsys):
    """model.drafter must fit the target's vocabulary, tapped layers and hidden size (it embeds with
    the target's table): a misfit is a one-line config error naming the field, not a shape error of
    the first step, and output_dir stays unwritten."""
    import dataclasses

    import jax.numpy as jnp
    from flax import nnx

    from dflash_jax.io.checkpoint import save_drafter
    from dflash_jax.models.drafter import Drafter
    from dflash_jax.tiny import tiny_target_config
    from dflash_jax.training.run import fresh_drafter_config

    cfg = _config(tmp_path, "fit")
    target = tiny_target_config("qwen3")  # the shape of pattern:3:0
    dcfg = fresh_drafter_config(target, cfg)
    narrow = dataclasses.replace(dcfg, hidden_size=target.hidden_size // 2, head_dim=target.head_dim // 2)
    save_drafter(Drafter(narrow, dtype=jnp.float32, rngs=nnx.Rngs(0)), tmp_path / "narrow")
    run = tmp_path / "run"
    rc, line = _cli(["--config", str(REPO / "configs" / "train_tiny.yaml"), f"output_dir={run}", "steps=2",
                     f"model.drafter={tmp_path / 'narrow'}"], capsys)
    assert rc == 2 and line.startswith("config error: model.drafter: the drafter ("), line
    assert f"hidden_size={narrow.hidden_size}) does not fit the target (" in line, line
    assert f"hidden_size {target.hidden_size})" in line, line
    assert not run.exists()
