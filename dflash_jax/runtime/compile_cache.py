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
loads it. So it must be this user's and writable by them alone: one that is not (or whose entries
are writable by others while others can reach them) is refused, and a new one is created 0700.
"""

from __future__ import annotations

import dataclasses
import os
import stat
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
    null, or a path that is not blank; if it exists, a directory safe to load code from
    (``check_private``)."""
    if directory is None:
        return
    if not directory.strip():
        raise ValueError("compilation_cache_dir must be a directory or null, got an empty string")
    path = Path(directory).expanduser().absolute()
    if path.exists():
        check_private(path)


_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_OTHERS_ENTER = stat.S_IXGRP | stat.S_IXOTH


def check_private(path: Path) -> None:
    """Raises ``ValueError`` naming ``compilation_cache_dir`` unless ``path`` is a directory owned by
    this user (or root) that no one else can write to, holding no entry that is someone else's or, if
    others can enter the directory, that others can write to."""
    where = f"compilation_cache_dir {str(path)!r}"
    fix = f"use a directory of your own, or run 'chmod go-w {path}'"
    try:
        st = path.stat()
    except OSError as err:
        raise ValueError(f"{where}: cannot read it ({err.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{where}: not a directory")
    uid = os.getuid()
    if st.st_uid not in (uid, 0):
        raise ValueError(f"{where}: owned by another user (uid {st.st_uid}); it holds code this process would run, "
                         "so it must be yours: use a directory of your own")
    if st.st_mode & _OTHERS_WRITE:
        raise ValueError(f"{where}: writable by other users (mode {stat.S_IMODE(st.st_mode):04o}); it holds code this "
                         f"process would run: {fix}")
    try:
        entries = list(os.scandir(path))
    except OSError as err:
        raise ValueError(f"{where}: cannot list it ({err.strerror})") from None
    for entry in entries:
        try:
            est = entry.stat(follow_symlinks=False)
        except OSError:  # gone meanwhile
            continue
        if est.st_uid not in (uid, 0):
            raise ValueError(f"{where}: its entry {entry.name!r} belongs to another user (uid {est.st_uid}); it holds "
                             "code this process would run: use a directory of your own")
        if st.st_mode & _OTHERS_ENTER and est.st_mode & _OTHERS_WRITE and not stat.S_ISLNK(est.st_mode):
            raise ValueError(f"{where}: its entry {entry.name!r} is writable by other users (mode "
                             f"{stat.S_IMODE(est.st_mode):04o}); it holds code this process would run: run "
                             f"'chmod -R go-w {path}', or 'chmod 700 {path}'")


def user_cache_dir() -> Path:
    """This user's cache directory for compiled programs: ``$XDG_CACHE_HOME/dflash-jax/xla``, by
    default ``~/.cache/dflash-jax/xla`` (what the embedded default pair uses unless told otherwise)."""
    base = os.environ.get("XDG_CACHE_HOME") or ""
    root = Path(base).expanduser() if base.strip() and Path(base).expanduser().is_absolute() else Path.home() / ".cache"
    return root / "dflash-jax" / "xla"


def use_compilation_cache(directory: str | os.PathLike) -> Path:
    """Makes this process save what it compiles from now on to ``directory`` and load what is there
    already; returns the directory, created if missing.

    Process-wide (a JAX setting): every later compilation uses it. Every program is cached, however
    quickly it compiled (JAX's default skips those under a second): an engine's admission, resize
    and release phases are many small programs that together take seconds to compile.

    Raises ``ValueError`` naming ``compilation_cache_dir`` if the directory cannot be created or
    written, is not safe to load code from (``check_private``), or if this process already caches
    in another directory (JAX opens its cache once). A directory it creates is 0700.
    """
    path = Path(directory).expanduser().absolute()
    current = jax.config.jax_compilation_cache_dir
    if current and Path(current).expanduser().absolute() != path:
        raise ValueError(f"compilation_cache_dir {str(path)!r}: this process already caches compiled programs in "
                         f"{current!r}; one process has one cache directory")
    try:
        if not path.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                path.mkdir(mode=0o700)
                path.chmod(0o700)  # whatever the umask
            except FileExistsError:  # made meanwhile by another process: checked below as any other
                if not path.is_dir():
                    raise
    except OSError as err:
        raise ValueError(f"compilation_cache_dir {str(path)!r}: cannot create it ({err.strerror})") from None
    check_private(path)
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

