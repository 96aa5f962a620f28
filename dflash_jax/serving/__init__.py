"""The OpenAI-compatible server: request protocol, scheduler, metrics, Starlette app, uvicorn runner.

Loaded on first use, so that ``serve.py`` (``dflash_jax.serving.cli``) starts talking before JAX and
the web stack are imported."""

import importlib

_API = {"create_app": "dflash_jax.serving.app", "Scheduler": "dflash_jax.serving.scheduler",
        "Metrics": "dflash_jax.serving.metrics", "ServerThread": "dflash_jax.serving.runner",
        "run_server": "dflash_jax.serving.runner"}

__all__ = ["create_app", "Scheduler", "Metrics", "ServerThread", "run_server"]


def __getattr__(name: str):
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dflash_jax.serving' has no attribute {name!r}")
