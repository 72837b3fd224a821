"""Identifier formats (docs/contracts.md)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints

RUN_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"

# Chosen by the caller, so a repeated start is a no-op and a different start under the same id is a
# conflict. A UUID fits.
RunId = Annotated[str, StringConstraints(pattern=RUN_ID_PATTERN)]

# 1-128 characters; the demo agent is "demo".
AgentId = Annotated[str, StringConstraints(min_length=1, max_length=128)]

# Suspension and checkpoint ids are assigned by Intermission from database sequences, so "the highest
# suspension id" (LatestResumeAdmission) is the latest pause of a run by one clock, whichever worker
# wrote it.
#
# Ids and revisions are bigint columns: a number past what they hold can match no row, and the driver
# refuses to send it at all, so it is refused here as a malformed message instead.
INT64_MAX = 2**63 - 1
SuspensionId = Annotated[int, Field(ge=0, le=INT64_MAX)]
CheckpointId = Annotated[int, Field(ge=0, le=INT64_MAX)]
Revision = Annotated[int, Field(ge=0, le=INT64_MAX)]
