"""Serving-time machinery: the serving layout, caches' use, the draft-verify-commit step, the engine
and its continuous batcher, the compilation cache."""
