"""The span a run continues in on this worker, in the run's own trace.

A run's trace is the trace its start began; the run records the span context it is in with its snapshot
and with every pause (``Continuation.traceparent``, ``intermission/tracing.py``). When a worker continues
the run, its ``run.continue`` span goes on in that trace:

- claimed by a command whose span is in the run's trace already (a start; a resume that carried the
  pause's own ``traceparent``): the child of that command's span, which is current in the run's task (the
  task copies the context the consumer handed the run over in);
- claimed by a command in another trace (a host's own ``traceparent``, or none, which began a trace of its
  own): the child of the span context the run recorded (its pause's), linked to the command's span; so the
  run's later events and pauses stay in the run's trace, and the command's trace leads to it by the link;
- taken over after its worker died: the child of the context the run recorded last (its start's or its
  last pause's), linked to it as taken over; the takeover is part of the run's story, on another worker;
- a run with no recorded context (started without one, none recording): the child of whatever is current.

The run's steps, tool calls and pause are children of this span (``agent/``).
"""

from __future__ import annotations

import contextlib
from typing import Final

from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue

from intermission.schemas.run import Run
from intermission.schemas.suspension import Progress
from intermission.tracing import LINK_COMMAND, LINK_TAKEN_OVER, current_span, open_span, parsed, recording

SPAN_NAME: Final = "run.continue"


def continuing(run: Run, progress: Progress, *, taken_over: bool = False) -> contextlib.AbstractContextManager[Span]:
    """The run's ``run.continue`` span on this worker, current within the block (see the module docstring)."""
    recorded = parsed(progress.continuation.traceparent)
    attributes: dict[str, AttributeValue] | None = (
        {
            "intermission.run_id": run.id,
            "intermission.app": run.scope.app,
            "intermission.tenant": run.scope.tenant,
            "intermission.agent_id": run.agent_id,
            "intermission.run.revision": run.revision,
            "intermission.taken_over": taken_over,
        }
        if recording()
        else None
    )
    if recorded is None:
        return open_span(SPAN_NAME, attributes=attributes)
    if taken_over:
        return open_span(SPAN_NAME, parent=recorded, attributes=attributes, links=[(recorded, LINK_TAKEN_OVER)])
    claimer = current_span().get_span_context()
    if claimer.is_valid and claimer.trace_id == recorded.trace_id:
        return open_span(SPAN_NAME, attributes=attributes)
    return open_span(SPAN_NAME, parent=recorded, attributes=attributes, links=[(claimer, LINK_COMMAND)])
