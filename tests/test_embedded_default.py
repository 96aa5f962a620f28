"""The shipped embedded default pair (models/embedded/, built by scripts/build_embedded_default.sh):
the tokenizer loads with its EOS and mask tokens (and, with a chat template, ChatML role tokens whose
end-of-turn stops generation), every file fits the repository's transfer limits, the Orbax checkpoint
(where the pair ships one) holds the same drafter as the z-lab export, speculative decoding with the
drafter gives the target's exact greedy output with tau well above 1 on held-out prompts, and the
notebook runs; the DFlash2 drafter beside it loads from the authors' DFlash2 format with its config
matching its tensors and gives the same exact output. The checks of shape hold for any pair the build
writes; the tau floors are the shipped pair's."""

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_jax.embedded import (DEFAULT_DRAFTER, DEFAULT_DRAFTER2, DEFAULT_TARGET, EMBEDDED_DIR,
                                  EVAL_REPORT, available, drafter2_available, heldout_prompts)

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "embedded_default.ipynb"

pytestmark = pytest.mark.skipif(not available(), reason="models/embedded is not built")

MIN_TAU = 5.0  # the shipped pair measures 7.75 at block 16 on 24 held-out prompts (docs/embedded_default.md)
MIN_TAU_DFLASH2 = 6.0  # the DFlash2 drafter: 9.21 at block 16 on the 24 held-out prompts
MAX_FILE_BYTES = 15 * 2**20  # every shipped file travels through channels limited to 16 MiB per file
MAX_TOTAL_BYTES = 48 * 10**6  # the repository (models included) travels under a 64 MiB cap


@pytest.fixture(scope="module")
def pair():
    import dflash_jax as dj
    from dflash_jax.io.tokenizer import Tokenizer

    return dj.load_target(DEFAULT_TARGET), dj.load_drafter(DEFAULT_DRAFTER), Tokenizer(DEFAULT_TARGET)


def test_tokenizer_and_configs(pair):
    target, drafter, tok = pair
    assert tok.eos_token_id in tok.stop_token_ids
    assert set(tok.stop_token_ids) == set(target.config.eos_token_ids)
    assert tok.decode([drafter.config.mask_token_id], False) == "<|mask|>"
    assert tok.vocab_size == target.config.vocab_size
    assert drafter.config.hidden_size == target.config.hidden_size
    text = "def f(x):\n    return x\n"
    assert tok.decode(tok.encode(text, add_special_tokens=True)) == text


def test_chat_template_ends_turns_with_a_stop_token(pair):
    _, _, tok = pair
    assert tok.chat_template is not None, "the embedded target's tokenizer_config.json has no chat_template"
    messages = [{"role": "user", "content": "Write a function `f(x)`."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    end_of_turn = tok.token_to_id("<|im_end|>")
    assert end_of_turn is not None and end_of_turn in tok.stop_token_ids
    assert ids.count(end_of_turn) == 1 and ids[-1] != end_of_turn  # the prompt ends at the assistant's turn
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_files_fit_the_transfer_limits():
    files = [p for p in EMBEDDED_DIR.rglob("*") if p.is_file()]
    big = [f"{p.relative_to(EMBEDDED_DIR)} ({p.stat().st_size} bytes)" for p in files if p.stat().st_size > MAX_FILE_BYTES]
    assert not big, f"files over {MAX_FILE_BYTES} bytes (shard them): {big}"
    total = sum(p.stat().st_size for p in files)
    assert total <= MAX_TOTAL_BYTES, f"models/embedded holds {total} bytes"


NEW_TOKENS = 64


@pytest.fixture(scope="module")
def heldout(pair):
    """Four held-out prompts, the engine configuration that runs them in one batch, and the target's greedy
    output alone (one run for both drafters)."""
    import dflash_jax as dj

    target, _, tok = pair
    prompts = [tok.encode(p, add_special_tokens=False) for p in heldout_prompts(4)]
    config = dj.EngineConfig(max_batch_size=len(prompts), max_length=max(map(len, prompts)) + NEW_TOKENS)
    plain = dj.Engine(target, None, config).generate(prompts, NEW_TOKENS, list(target.config.eos_token_ids))
    return prompts, config, plain


def exact_on_heldout(target, drafter, heldout, min_tau: float):
    """The held-out prompts in one batch with ``drafter``: the target's greedy output alone, tau of at
    least ``min_tau``; returns (prompts, the speculative results)."""
    import dflash_jax as dj

    prompts, config, plain = heldout
    spec = dj.Engine(target, drafter, config).generate(prompts, NEW_TOKENS, list(target.config.eos_token_ids))
    for a, b in zip(spec, plain):
        assert a.output_ids == b.output_ids
        assert len(a.output_ids) > 0
    lengths = [n for r in spec for n in r.acceptance_lengths]
    tau = float(np.mean(lengths))
    assert tau >= min_tau, f"tau {tau:.2f} on held-out prompts (lengths {lengths})"
    return prompts, spec


@pytest.mark.slow
def test_speculative_decoding_is_exact_and_fast(pair, heldout):
    import dflash_jax as dj

    target, drafter, _ = pair
    prompts, spec = exact_on_heldout(target, drafter, heldout, MIN_TAU)
    stop = list(target.config.eos_token_ids)
    alone = dj.generate(target, drafter, prompts[1:2], max_new_tokens=64, stop_token_ids=stop)[0]  # the one-call API
    assert (alone.output_ids, alone.acceptance_lengths) == (spec[1].output_ids, spec[1].acceptance_lengths)
    assert dj.generate(target, drafter, [], max_new_tokens=64) == []  # no prompts, nothing to build


@pytest.mark.slow
def test_notebook_executes(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    figure = tmp_path / "hist.png"
    old = os.environ.get("DFLASH_NB_FIGURE")
    os.environ["DFLASH_NB_FIGURE"] = str(figure)
    try:
        t0 = time.perf_counter()
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(REPO)}}).execute()
        wall = time.perf_counter() - t0
    finally:
        if old is None:
            os.environ.pop("DFLASH_NB_FIGURE", None)
        else:
            os.environ["DFLASH_NB_FIGURE"] = old
    assert figure.exists() and figure.stat().st_size > 0
    out = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "identical greedy output with and without the drafter: True" in out
    assert wall < 240, f"the notebook took {wall:.0f}s"


needs_drafter2 = pytest.mark.skipif(not drafter2_available(), reason="models/embedded/drafter2 is not built")


@needs_drafter2
def test_dflash2_drafter_loads_with_its_config_matching_its_tensors(pair):
    from safetensors import safe_open

    import dflash_jax as dj
    from dflash_jax.embedded import load_default
    from dflash_jax.models.dflash2 import DFlash2Drafter

    target, drafter, _ = pair
    second = dj.load_drafter(DEFAULT_DRAFTER2)
    assert isinstance(second, DFlash2Drafter)
    cfg = second.config
    raw = json.loads((DEFAULT_DRAFTER2 / "config.json").read_text())
    # exported in the DFlash drafter's dtype (the build writes both in bfloat16)
    dtype = json.loads((DEFAULT_DRAFTER / "config.json").read_text())["torch_dtype"]
    assert raw["architectures"] == ["DFlash2DraftModel"] and raw["torch_dtype"] == dtype
    assert {k: raw["dflash_config"][k] for k in ("selector_rank", "selector_top_k", "conv_kernel_size",
                                                   "conv_group_size")} == {
        "selector_rank": cfg.selector_rank, "selector_top_k": cfg.selector_top_k,
        "conv_kernel_size": cfg.conv_kernel_size, "conv_group_size": cfg.conv_group_size}
    # the DFlash drafter's shape, taps, block and mask token: trained from it, for the same target
    for field in ("num_layers", "hidden_size", "vocab_size", "block_size", "mask_token_id", "target_layer_ids",
                  "num_target_layers"):
        assert getattr(cfg, field) == getattr(drafter.config, field), field
    rank, groups, taps = cfg.selector_rank, cfg.hidden_size // cfg.conv_group_size, cfg.conv_kernel_size
    want = {"candidate_selector.predecessor_codebook": (cfg.vocab_size, rank),
            "candidate_selector.successor_codebook": (cfg.vocab_size, rank)}
    for i in range(cfg.num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            want[f"layers.{i}.{conv}.base_kernel"] = (2, taps, cfg.hidden_size)
            want[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * groups, cfg.hidden_size)
    with safe_open(str(DEFAULT_DRAFTER2 / "model.safetensors"), "np") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {{"float32": "F32", "bfloat16": "BF16"}[dtype]}
    for name, shape in want.items():
        assert shapes[name] == shape, name
    assert len(shapes["candidate_selector.hidden_projection.weight"]) == 2
    assert sorted(shapes["candidate_selector.hidden_projection.weight"]) == sorted((cfg.hidden_size, rank))
    # trained: convolutions off the identity, and load_default(generation=2) gives this drafter
    conv = second.layers[0].attention_conv
    assert float(np.abs(np.asarray(conv.kernel_projection[...])).max()) > 0
    _, via_default, _ = load_default(generation=2)
    assert via_default.config == cfg
    with pytest.raises(ValueError, match="generation must be 1"):
        load_default(generation=3)


@needs_drafter2
def test_eval_report_has_both_generations():
    report = json.loads(EVAL_REPORT.read_text())
    assert report["drafter"] == "dflash" and report["dflash2"]["drafter"] == "dflash2"
    for row, block in ((report, 16), (report["block_8"], 8), (report["dflash2"], 16), (report["dflash2"]["block_8"], 8)):
        assert row["block_size"] == block and row["identical"] is True and row["prompts"] == 24
        steps = sum(row["histogram"].values())
        assert row["tau"] == pytest.approx(sum(int(k) * v for k, v in row["histogram"].items()) / steps)
        assert max(map(int, row["histogram"])) <= block
    assert report["dflash2"]["tau"] >= MIN_TAU_DFLASH2


@pytest.mark.slow
@needs_drafter2
def test_dflash2_speculative_decoding_is_exact(pair, heldout):
    import dflash_jax as dj

    target, _, _ = pair
    exact_on_heldout(target, dj.load_drafter(DEFAULT_DRAFTER2), heldout, MIN_TAU_DFLASH2)
