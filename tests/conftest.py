"""Shared fixtures: 8 fake CPU devices for sharding tests, tiny random model directories, oracles."""

import os

# The suite compiles far more than it runs: XLA:CPU with LLVM's optimisations off compiles about a
# third faster (the whole suite 20-25% shorter on 2 cores; the few step-heavy tests run ~2x slower).
# Both flags reach the subprocesses the tests start, through the environment.
_TEST_XLA_FLAGS = {"--xla_force_host_platform_device_count": "8", "--xla_backend_optimization_level": "0"}
# XLA:CPU's classic elemental emitters compile these tiny programs in about two thirds of the CPU time
# of its fusion emitters (the suite about 30% less CPU time). Only some jaxlib versions know the flag, and XLA
# aborts the process on a flag it does not know: a subprocess asks this jaxlib first (once: the
# workers of pytest-xdist and the tests' subprocesses inherit the result through the environment).
_CLASSIC_EMITTERS = ("--xla_cpu_use_fusion_emitters", "false")
# XLA:CPU splits each program's LLVM module into parts compiled by a thread pool: for these tiny
# programs the parts cost more (about 15% of the suite's CPU time) than the threads give back on 2 cores
# shared by two workers. One part each. Probed like the emitters' flag.
_ONE_CODEGEN_PART = ("--xla_cpu_parallel_codegen_split_count", "1")


def _xla_accepts(flag: str) -> bool:
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = "import jax; jax.devices('cpu')"
    try:
        return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


_flags = os.environ.get("XLA_FLAGS", "")
_optional = [f for f in (_CLASSIC_EMITTERS, _ONE_CODEGEN_PART) if f[0] not in _flags]
# One probe for all of them (a subprocess that imports jax takes seconds); each alone only if that fails.
if _optional and _xla_accepts(" ".join("=".join(f) for f in _optional)):
    _TEST_XLA_FLAGS.update(dict(_optional))
else:
    _TEST_XLA_FLAGS.update({k: v for k, v in _optional if _xla_accepts(f"{k}={v}")})
os.environ["XLA_FLAGS"] = " ".join([_flags, *(f"{k}={v}" for k, v in _TEST_XLA_FLAGS.items() if k not in _flags)]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The oracles (torch) run tiny models: one thread each op. With a thread pool, every op of a
# 64-wide model wakes and spins its threads, 10-20x the CPU time of one thread (worst on a loaded
# machine); at these sizes an op runs on one thread either way, so the results are the same.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import time  # noqa: E402

import pytest  # noqa: E402

from dflash_jax.tiny import write_tiny_pair  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_freed_after_each_module():
    """Each module's compiled programs are dropped when it ends (JAX's caches cleared): XLA:CPU maps every
    program's kernels into the process, and a worker that kept a whole run's programs reached ~52,000 of
    Linux's default 65,530 mappings (``vm.max_map_count``, past which XLA:CPU crashes while compiling).
    Cleared, a worker stays near 1,400 after each module; modules share no engines, so nothing compiles
    twice but a few small library functions."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def qwen3_pair(tmp_path_factory):
    """A tiny Qwen3 target (6 layers, GQA 4/2) and a 2-layer block-8 drafter tapping layers (1, 3)."""
    return write_tiny_pair(tmp_path_factory.mktemp("qwen3"), model_type="qwen3",
                           target_overrides=dict(num_layers=6), drafter_overrides=dict(block_size=8))


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory):
    """A tiny Llama-3 target (llama3 RoPE scaling, tied embeddings) and its drafter."""
    return write_tiny_pair(tmp_path_factory.mktemp("llama"), model_type="llama",
                           target_overrides=dict(num_layers=5, tie_word_embeddings=True),
                           drafter_overrides=dict(block_size=8, num_layers=3))


@pytest.fixture(scope="session")
def reference():
    """The oracles: transformers and the authors' `dflash` package, with CPU timing."""
    torch = pytest.importorskip("torch")
    import dflash.model as dm
    from transformers import AutoModelForCausalLM

    dm._cuda_time = time.perf_counter  # dflash_generate(return_stats=True) syncs CUDA otherwise
    torch.manual_seed(0)

    class Oracles:
        model = dm

        @staticmethod
        def target(path):
            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

        @staticmethod
        def drafter(path):
            return dm.DFlashDraftModel.from_pretrained(path, dtype=torch.float32).eval()

    return Oracles


@pytest.fixture
def tpu_flash_interpreted(monkeypatch):
    """Prompts take their TPU path on the CPU: ``attention.library_flash_attention`` says
    "tpu_flash", and JAX's Pallas TPU flash attention runs in TPU interpret mode (entered around
    that kernel only: the GPU kernels keep their own interpret mode). Yields the ``lens`` of every
    call (a call traced per device under a kernel mesh sees its shard's rows)."""
    from jax.experimental.pallas import tpu as pltpu

    from dflash_jax.ops import attention

    calls, flash = [], attention.tpu_flash_attention

    def interpreted(q, k, v, lens, **kwargs):
        calls.append(lens)
        with pltpu.force_tpu_interpret_mode():
            return flash(q, k, v, lens, **kwargs)

    monkeypatch.setattr(attention, "library_flash_attention", lambda dtype, head_dim: "tpu_flash")
    monkeypatch.setattr(attention, "tpu_flash_attention", interpreted)
    return calls


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` (``tests/gpu``: the kernels compiled by Triton, the engine's GPU-only paths)
    need a GPU and are skipped elsewhere. This file defaults ``JAX_PLATFORMS`` to ``cpu``, so on a GPU
    machine run them as ``JAX_PLATFORMS=cuda python -m pytest -m gpu tests/gpu``.

    In a pytest-xdist worker, modules run in the order of their number of ``slow`` tests, most first
    (each module's tests stay together and in their order)."""
    if hasattr(config, "workerinput"):
        _slow_modules_first(items)
    import jax

    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU (JAX's backend here is {jax.default_backend()!r}; "
                                   "on a GPU machine run with JAX_PLATFORMS=cuda)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _slow_modules_first(items) -> None:
    """scripts/test.sh hands whole modules to its workers (``--dist loadfile``) in collection order
    (``--no-loadscope-reorder``): with the modules of most slow tests first, the last ones handed out
    are short and both workers finish together. pytest-xdist's own order (most tests first) leaves the
    single-test end-to-end modules (the demo job, the loaded servers) for the end, and a worker that
    takes one of them also takes the next modules while the other runs dry."""
    from collections import Counter

    slow = Counter(item.path for item in items if "slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.path])  # stable: a module's tests stay together, in order
