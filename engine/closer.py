"""The original's ResumeCloser: terminates uncertain execution as incomplete, under host guards.

A start that may have executed cannot be retried (the work may have happened) and cannot be expired (it
did start). The only way out is to prove nothing from it can act any more, and close it. That proof is the
HOST's: the store cannot know whether a remote worker, a pending callback or a delayed external action is
still alive. So the closer is built from three parts, all required:

- an authorizer, which authenticates the actor and the proof (issuer, issuer revision, contents bound to
  this exact request) and checks current access to the run. It is asked on EVERY call, historical retries
  included: a stored receipt or a matching digest is not permission, and access revoked since the first
  call must refuse the retry too;
- a fence, which holds the current grants and the permanent quiescence of every original worker and tool
  for the length of one callback, so nothing can come back to life between the check and the write;
- the store, which checks the evidence under the run's lock and writes the terminal state and its receipt.

Each operation is bounded to thirty seconds. An error can follow a commit (the acknowledgement may be
what was lost), so a caller that gets one retries the IDENTICAL request and receives the original receipt.
Closure neither retries work nor accepts results.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

from intermission.schemas.errors import Forbidden, InvalidArgument, TransientError
from intermission.schemas.resume import ResumeClosure, ResumeClosureRequest
from intermission.schemas.scope import Scope, require_scope

# The original's bound on one closure, authorization and fencing included. Host ports must honour
# cancellation: when it passes, whatever they are awaiting is cancelled.
CLOSE_TIMEOUT_SECONDS = 30.0


@runtime_checkable
class ResumeClosureStore(Protocol):
    """The closure half of the resume store, at one scope (``stores.at(scope).resume``)."""

    async def close_resume(self, request: ResumeClosureRequest) -> ResumeClosure: ...

    async def get_resume_closure(self, run_id: str, suspension_id: int) -> ResumeClosure: ...


@runtime_checkable
class ResumeClosureFence(Protocol):
    """Holds current run/team grants and the permanent quiescence of every original worker and tool
    (remote workers, pending callbacks and delayed external actions included) through ONE callback.
    Stopping one process is enough only when the host proves that process owned all possible execution.
    The fence must call ``action`` with the request it was given, once, and return or raise what it does."""

    async def with_resume_closure(
        self, request: ResumeClosureRequest, action: Callable[[ResumeClosureRequest], Awaitable[None]]
    ) -> None: ...


@runtime_checkable
class ResumeClosureAuthorizer(Protocol):
    """Authenticates the actor, the proof's issuer and revision, and the proof's contents bound to the
    exact request, then checks current run/team access; raises to refuse. Original worker identities must
    come from retained dispatch evidence, never from the agent's current configuration."""

    async def authorize_resume_closure(self, request: ResumeClosureRequest) -> None: ...


class ResumeCloser:
    """Close uncertain starts as incomplete: authority checked every time, under the host's fence."""

    def __init__(
        self,
        store: ResumeClosureStore,
        fence: ResumeClosureFence,
        authorizer: ResumeClosureAuthorizer,
        *,
        timeout_seconds: float = CLOSE_TIMEOUT_SECONDS,
    ) -> None:
        # All three are required: a closer without a fence or an authorizer would close on a digest alone,
        # which proves nothing about external work having stopped.
        for name, part, kind in (
            ("store", store, ResumeClosureStore),
            ("fence", fence, ResumeClosureFence),
            ("authorizer", authorizer, ResumeClosureAuthorizer),
        ):
            if part is None or not isinstance(part, kind):
                raise InvalidArgument(f"a resume closer needs a {name} ({kind.__name__})")
        # A shorter bound is allowed (tests, tighter hosts); a longer one is not the original's guarantee.
        if not 0 < timeout_seconds <= CLOSE_TIMEOUT_SECONDS:
            raise InvalidArgument(f"timeout_seconds must be in (0, {CLOSE_TIMEOUT_SECONDS}]")
        self._store = store
        self._fence = fence
        self._authorizer = authorizer
        self._timeout = timeout_seconds

    async def close(self, scope: Scope, request: ResumeClosureRequest) -> ResumeClosure:
        """Close the start ``request`` names, or return the original receipt of this identical request."""
        require_scope(scope)
        if not isinstance(request, ResumeClosureRequest):
            raise InvalidArgument("a closure request is required")
        frozen, wanted = request.freeze()
        if frozen.scope != scope:
            raise InvalidArgument(f"the request is bound to scope {frozen.scope}, not the caller's {scope}")
        receipt: ResumeClosure | None = None

        async def act(fenced: ResumeClosureRequest) -> None:
            nonlocal receipt
            # The fence hands the request back; it must be the one that was checked, or the write would
            # be authorised for one request and applied to another.
            if not isinstance(fenced, ResumeClosureRequest) or fenced.freeze()[1] != wanted:
                raise Forbidden("the fence passed a different request to the closure")
            if receipt is not None:
                raise Forbidden("the fence ran the closure twice")
            # Authority is checked inside the fence, so the grants it holds cannot be revoked between the
            # check and the write; and on every call, because a retry is a new request for authority.
            await self._authorizer.authorize_resume_closure(frozen)
            receipt = await self._store.close_resume(frozen)

        try:
            async with asyncio.timeout(self._timeout):
                await self._fence.with_resume_closure(frozen, act)
        except TimeoutError as exc:
            raise TransientError(
                f"resume closure did not finish within {self._timeout:g}s; it may have committed: retry the "
                "identical request to learn the outcome"
            ) from exc
        if receipt is None:
            raise Forbidden("the fence returned without running the closure")
        # A receipt is evidence; one that does not check out, or answers another request, is not ours.
        receipt.validate()
        if receipt.request_digest != wanted:
            raise Forbidden("the store returned a receipt for a different request")
        return receipt
