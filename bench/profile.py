"""Summarise py-spy's collapsed stacks (``bench.resume --profile DIR`` writes them).

    python -m bench.profile FILE [--top N] [--match TEXT]

Prints the functions with the most samples on top of the stack (self time) and the functions with the
most samples anywhere on the stack (inclusive time), as shares of all samples. ``--match`` keeps only
frames whose text contains TEXT in the inclusive list (for instance ``/work/main/`` for the project's own
code).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LINE = re.compile(r"^(.*) (\d+)$")
# "function (path/to/file.py:123)" -> "function (file.py)": lines split one function into many rows.
_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<path>[^:()]+)(?::\d+)?\)$")


def frame_name(frame: str, keep_path: bool = False) -> str:
    match = _FRAME.match(frame.strip())
    if match is None:
        return frame.strip()
    path = match.group("path")
    where = path if keep_path else "/".join(path.split("/")[-2:])
    return f"{match.group('fn')} ({where})"


def summarise(path: Path, top: int, needle: str | None) -> str:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        frames = [f for f in match.group(1).split(";") if f]
        count = int(match.group(2))
        total += count
        if not frames:
            continue
        own[frame_name(frames[-1])] += count
        seen: set[str] = set()
        for frame in frames:
            if needle is not None and needle not in frame:
                continue
            name = frame_name(frame)
            if name not in seen:
                seen.add(name)
                inclusive[name] += count
    lines = [f"{path}: {total} samples", "", "self:"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in own.most_common(top)]
    lines += ["", "inclusive:"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in inclusive.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--match", default=None)
    args = parser.parse_args()
    print(summarise(args.file, args.top, args.match))


if __name__ == "__main__":
    main()
