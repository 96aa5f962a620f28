"""A package's public API loaded on first use (PEP 562), for packages the command-line tools import
before they can say anything: JAX takes seconds to import on a busy CPU."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_api(package: str, namespace: dict[str, Any], api: dict[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package`` (whose globals are ``namespace``): each name of ``api``
    (name -> module defining it) is imported on first access and kept in ``namespace``."""

    def __getattr__(name: str) -> Any:
        if name not in api:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(api[name]), name)
        namespace[name] = value
        return value

    return __getattr__
