"""Loading the executor named by ``INTERMISSION_EXECUTOR`` ("module:factory")."""

from __future__ import annotations

import importlib
from typing import Any

from intermission.agent.executor import Executor
from intermission.schemas.errors import IntermissionError


class ExecutorSettingError(IntermissionError):
    """INTERMISSION_EXECUTOR does not name a usable executor factory."""

    code = "bad_setting"


def load_executor(spec: str) -> Executor:
    """Import ``module:factory`` and call the factory; it must return something with ``execute``."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ExecutorSettingError(f"INTERMISSION_EXECUTOR={spec!r} must look like 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ExecutorSettingError(f"INTERMISSION_EXECUTOR: cannot import {module_name!r}: {exc}") from exc
    factory: Any = getattr(module, attribute, None)
    if not callable(factory):
        raise ExecutorSettingError(f"INTERMISSION_EXECUTOR: {spec!r} is not a callable factory")
    executor = factory()
    if not callable(getattr(executor, "execute", None)):
        raise ExecutorSettingError(f"INTERMISSION_EXECUTOR: {spec!r} returned an object without execute()")
    return executor  # type: ignore[no-any-return]
