"""Reading the product's source as syntax trees, for the tests that check what the code is made of.

CPython 3.11's ``ast.parse`` is not re-entrant: the conversion to Python objects keeps its recursion depth
in state shared by every parse, and a parse that starts while another converts leaves it off by its own
depth, so the outer one fails with ``SystemError: AST constructor recursion depth mismatch``. A collection
of cyclic garbage during the conversion can start one: a finalizer that logs an error with a traceback (an
asyncio future whose exception nobody took, left by an earlier test) formats the traceback, and 3.11's
traceback formatting parses the source line it shows. So the collector is held off while a file parses;
it runs again, with everything it would have collected, right after.
"""

from __future__ import annotations

import ast
import gc
from pathlib import Path


def parse_file(path: Path) -> ast.Module:
    """``path`` parsed, with no finalizer able to run in the middle of the parse."""
    text = path.read_text(encoding="utf-8")
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(text, filename=str(path))
    finally:
        if enabled:
            gc.enable()
