"""``python -m intermission.ops.cli``: the ``intermission`` command, as the tests and benchmarks start it."""

from intermission.ops.cli import main

main()
