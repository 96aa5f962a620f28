"""The OpenAI-compatible server: request protocol, scheduler, metrics, Starlette app, uvicorn runner."""

from dflash_jax.serving.app import create_app
from dflash_jax.serving.runner import ServerThread, run_server
from dflash_jax.serving.metrics import Metrics
from dflash_jax.serving.scheduler import Scheduler

__all__ = ["create_app", "Scheduler", "Metrics", "ServerThread", "run_server"]
