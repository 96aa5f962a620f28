"""The persistent compilation cache: programs a process compiles are saved to a directory, and a
later process that compiles the same program (same HLO, compiler options, JAX/XLA version and kind
of device) loads it from there instead. JAX also keeps XLA's per-fusion GEMM autotuning results
there (``jax_persistent_cache_enable_xla_caches``), which programs compiled anew reuse. Beside it,
``compile_seconds`` counts the time a process spends compiling, with or without the cache (for
summaries such as ``serve.py generate``'s).

What it buys and costs, measured (docs/performance.md; Qwen3-8B shapes):
- on the H200, ``Engine.warmup`` (what ``serve.py`` runs before it binds: batch 1 and 8) took
  13-25 s per engine instead of 36-73 s; on the CPU the tiny training recipe's second start took
  8 s instead of 25 s;
- every process that reused the cache ran the same decode step to within 0.1%, where processes that
  compiled (and autotuned) for themselves spread by up to 3% (DFlash 5.36-5.52 ms on one machine);
- but slower than those processes on the same machine: target-only steps by 3.0-3.3% (4.24
  against 4.10 ms), DFlash steps by 2.3-3.0%, whether the process loaded the programs or compiled
  them with the cached autotuning results. They run byte-identical executables from the same device
  addresses, each kernel as fast; what they lose is overlap between kernels (~80 us more gaps per
  36-layer step). Their CUDA graphs (nodes, dependencies, programmatic edges) and CUDA context
  settings read back the same as well: the cause lies below what the driver API shows.
  So a server that restarts often gains; one that runs for days keeps the cache off (the default).

The directory holds executable code: whoever can write to it can run code in the process that
loads it, so it should be writable by its owner alone.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import jax

_HIT = "/jax/compilation_cache/cache_hits"
_MISS = "/jax/compilation_cache/cache_misses"


@dataclasses.dataclass(frozen=True)
class CacheCounts:
    """What the persistent cache did in this process since it was first enabled."""

    loaded: int    # programs taken from the cache
    compiled: int  # programs compiled (and saved to the cache)

    def __sub__(self, earlier: CacheCounts) -> CacheCounts:
        return CacheCounts(self.loaded - earlier.loaded, self.compiled - earlier.compiled)


_counts = {_HIT: 0, _MISS: 0}
_lock = threading.Lock()
_listening = False


def _count(event: str, **_) -> None:
    if event in _counts:
        with _lock:
            _counts[event] += 1


# JAX's duration events of a program's first call: tracing, lowering, XLA compilation (or cache retrieval)
_COMPILE_EVENTS = frozenset({"/jax/core/compile/jaxpr_trace_duration",
                             "/jax/core/compile/jaxpr_to_mlir_module_duration",
                             "/jax/core/compile/backend_compile_duration"})
_compile_time = {"seconds": 0.0, "tracking": False}


def _add_compile_time(event: str, duration: float, **_) -> None:
    if event in _COMPILE_EVENTS:
        with _lock:
            _compile_time["seconds"] += duration


def track_compile_time() -> None:
    """Starts counting the seconds this process spends tracing, lowering and compiling programs
    (``compile_seconds``); with the persistent cache, a loaded program counts its retrieval."""
    with _lock:
        if not _compile_time["tracking"]:
            jax.monitoring.register_event_duration_secs_listener(_add_compile_time)
            _compile_time["tracking"] = True


def compile_seconds() -> float:
    """Seconds spent compiling since ``track_compile_time`` (0 before); subtract two readings for
    what happened between them."""
    with _lock:
        return _compile_time["seconds"]


def check_setting(directory: str | None) -> None:
    """The config check of a ``compilation_cache_dir`` field (``EngineConfig``, ``TrainConfig``):
    null, or a path that is not blank."""
    if directory is not None and not directory.strip():
        raise ValueError("compilation_cache_dir must be a directory or null, got an empty string")


def use_compilation_cache(directory: str | os.PathLike) -> Path:
    """Makes this process save what it compiles from now on to ``directory`` and load what is there
    already; returns the directory, created if missing.

    Process-wide (a JAX setting): every later compilation uses it. Every program is cached, however
    quickly it compiled (JAX's default skips those under a second): an engine's admission, resize
    and release phases are many small programs that together take seconds to compile.

    Raises ``ValueError`` naming ``compilation_cache_dir`` if the directory cannot be created or
    written, or if this process already caches in another directory (JAX opens its cache once).
    """
    path = Path(directory).expanduser().absolute()
    current = jax.config.jax_compilation_cache_dir
    if current and Path(current).expanduser().absolute() != path:
        raise ValueError(f"compilation_cache_dir {str(path)!r}: this process already caches compiled programs in "
                         f"{current!r}; one process has one cache directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"compilation_cache_dir {str(path)!r}: cannot create it ({err.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"compilation_cache_dir {str(path)!r}: not writable by this process")
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_listener(_count)
            _listening = True
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def cache_counts() -> CacheCounts:
    """Programs loaded from and compiled into the persistent cache so far in this process (both 0
    before ``use_compilation_cache``); subtract two readings for what happened between them."""
    with _lock:
        return CacheCounts(loaded=_counts[_HIT], compiled=_counts[_MISS])


def cache_report() -> dict[str, str | int | None]:
    """The directory in use and ``cache_counts()``, for logs and JSON summaries."""
    counts = cache_counts()
    return {"dir": jax.config.jax_compilation_cache_dir, "loaded": counts.loaded, "compiled": counts.compiled}
