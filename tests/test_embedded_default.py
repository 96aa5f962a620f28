"""The shipped embedded default pair (models/embedded/, built by scripts/build_embedded_default.sh):
the tokenizer loads with its EOS and mask tokens (and, with a chat template, ChatML role tokens whose
end-of-turn stops generation), every file fits the repository's transfer limits, speculative decoding
with the drafter gives the target's exact greedy output with tau well above 1 on held-out prompts,
and the notebook runs. Shape-agnostic: it holds for any pair the build writes."""

import os
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_jax.embedded import DEFAULT_DRAFTER, DEFAULT_TARGET, EMBEDDED_DIR, available, heldout_prompts

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "embedded_default.ipynb"

pytestmark = pytest.mark.skipif(not available(), reason="models/embedded is not built")

MIN_TAU = 3.0  # well below what the build measures on its held-out prompts (models/embedded/eval.json)
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
    if tok.chat_template is None:
        pytest.skip("this pair has no chat template")
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


@pytest.mark.slow
def test_speculative_decoding_is_exact_and_fast(pair):
    import dflash_jax as dj

    target, drafter, tok = pair
    prompts = [tok.encode(p, add_special_tokens=False) for p in heldout_prompts(4)]
    stop = list(target.config.eos_token_ids)
    config = dj.EngineConfig(max_batch_size=len(prompts), max_length=max(map(len, prompts)) + 64)
    spec = dj.Engine(target, drafter, config).generate(prompts, 64, stop)
    plain = dj.Engine(target, None, config).generate(prompts, 64, stop)
    for a, b in zip(spec, plain):
        assert a.output_ids == b.output_ids
        assert len(a.output_ids) > 0
    alone = dj.generate(target, drafter, prompts[1:2], max_new_tokens=64, stop_token_ids=stop)[0]  # the one-call API
    assert (alone.output_ids, alone.acceptance_lengths) == (spec[1].output_ids, spec[1].acceptance_lengths)
    assert dj.generate(target, drafter, [], max_new_tokens=64) == []  # no prompts, nothing to build
    lengths = [n for r in spec for n in r.acceptance_lengths]
    tau = float(np.mean(lengths))
    assert tau >= MIN_TAU, f"tau {tau:.2f} on held-out prompts (lengths {lengths})"


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
