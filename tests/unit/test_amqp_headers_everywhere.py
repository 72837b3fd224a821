"""Every process of the product decodes header tables within bounds (intermission/amqp_headers.py), not only
those whose test called ``install()``: a fresh interpreter that imports the module a process starts from
(worker, sweeper, CLI, console, a host's client) has pamqp's table and array decoders replaced. A process
left on pamqp's recursive decoder would drop its whole connection on one deeply nested header."""

from __future__ import annotations

import subprocess
import sys

import pytest

# What each kind of process imports first: the fleet's entry points and what a host imports.
ENTRY_MODULES = [
    "intermission",
    "intermission.fleet.worker",
    "intermission.publishers.sweeper",
    "intermission.publishers.clients",
    "intermission.ops.cli.app",
    "intermission.ops.console.app",
]

# Run in a fresh interpreter; it reads the decoders' module by name rather than importing
# intermission.amqp_headers, whose package import would itself install the decoder and prove nothing.
PROBE = """
import importlib, sys
importlib.import_module(sys.argv[1])
from pamqp import decode
bounded = "intermission.amqp_headers"
assert decode.METHODS["table"].__module__ == bounded, "message properties' tables"
assert decode.METHODS["array"].__module__ == bounded, "message properties' arrays"
assert decode.TABLE_MAPPING[b"F"].__module__ == bounded, "tables inside tables"
assert decode.TABLE_MAPPING[b"A"].__module__ == bounded, "arrays inside tables"
"""


@pytest.mark.unit
@pytest.mark.parametrize("module", ENTRY_MODULES)
def test_a_process_starting_from_any_entry_point_decodes_headers_within_bounds(module: str) -> None:
    done = subprocess.run(  # noqa: S603 - our own interpreter and a fixed probe
        [sys.executable, "-c", PROBE, module], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
