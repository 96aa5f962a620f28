"""The README's main-job command, end to end on a fresh checkout (CPU)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_main_job_reports_tau_and_speedup_on_a_fresh_checkout(tmp_path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout")
    checkout = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", str(REPO), str(checkout)], check=True)
    target = checkout / "models" / "embedded" / "target"
    if not any((target / name).exists() for name in ("model.safetensors", "model.safetensors.index.json")):
        pytest.skip("the embedded default pair is not committed in this checkout")
    # scripts/demo.sh = `pip install -e .` + `python serve.py demo`; the install is already done here
    # (re-pointing it at a temporary clone would break the other tests), so run the job itself.
    env = dict(os.environ, PYTHONPATH=str(checkout), XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("JAX_PLATFORMS", None)  # JAX probes its backends (and says nothing of it by default)
    proc = subprocess.run([sys.executable, "serve.py", "demo", "--prompts", "3", "--max-new-tokens", "48"],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert str(checkout / "models" / "embedded") in out  # the shipped pair, not the fallback
    assert "DFlash demo on cpu (" in out  # the device it ran on
    assert "greedy output identical with and without the drafter: yes (3 of 3 prompts)" in out
    assert re.search(r"block size (16|12|8): the fastest on this device in the warm-up \(16: \d+ tok/s, 12: \d+ tok/s, "
                     r"8: \d+ tok/s\)", out), out
    tau = float(re.search(r"tau \(tokens committed per DFlash step\): ([0-9.]+)", out).group(1))
    speedup = float(re.search(r"speedup ([0-9.]+)x", out).group(1))
    assert tau > 1.5, out
    assert speedup > 0, out
    # tau of seeded sampling in both verification modes; exact verification is target-only sampling's tokens
    assert re.search(r"tau with seeded sampling: T=0\.7 exact [0-9.]+ \(= target-only sampling: yes\), "
                     r"rejection [0-9.]+; T=1 exact [0-9.]+ \(= target-only sampling: yes\), rejection [0-9.]+", out), out
    if (checkout / "models" / "embedded" / "drafter2" / "model.safetensors").exists():  # both generations
        assert re.search(r"DFlash vs DFlash2, block size \d+, the same prompts and target-only run:", out), out
        for name in ("DFlash", "DFlash2"):
            assert re.search(rf"^    {name} +[0-9.]+ +[0-9.]+x +\d+  yes \(3 of 3\)$", out, re.M), out
    if speedup < 0.9 * tau:  # says why, in target-only steps per DFlash step
        assert re.search(r"why not [0-9.]+x: here one DFlash step .* costs [0-9.]+ target-only steps", out), out
    prompt_at, completion_at = out.index("---- prompt ----"), out.index("---- completion (DFlash")
    assert prompt_at < completion_at and "def " in out[prompt_at:completion_at]
    # only the demo's own progress lines on stderr, none of the frameworks' (JAX probing for a TPU...)
    assert proc.stderr.strip() and all(" dflash_jax." in line for line in proc.stderr.strip().splitlines()), proc.stderr
