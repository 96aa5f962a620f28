"""The OpenAI-compatible server: request protocol, scheduler, metrics, Starlette app, uvicorn runner.

Loaded on first use (``dflash_jax.lazy``), so that ``serve.py`` (``dflash_jax.serving.cli``) starts
talking before JAX and the web stack are imported."""

from dflash_jax.lazy import lazy_api

_API = {"create_app": "dflash_jax.serving.app", "Scheduler": "dflash_jax.serving.scheduler",
        "Metrics": "dflash_jax.serving.metrics", "ServerThread": "dflash_jax.serving.runner",
        "run_server": "dflash_jax.serving.runner"}
__all__ = ["create_app", "Scheduler", "Metrics", "ServerThread", "run_server"]
__getattr__ = lazy_api(__name__, globals(), _API)
