"""Numeric limits of what a command may ask for, each set by what the database stores."""

from __future__ import annotations

from typing import Final

# The longest a pause may wait, in seconds (68 years): a deadline is ``now() + ttl`` in a timestamptz, and
# the TTL travels as a 32-bit integer column; a larger one would make the database raise instead of the
# command being refused.
MAX_PAUSE_TTL_SECONDS: Final = 2**31 - 1
