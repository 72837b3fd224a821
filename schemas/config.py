"""RunConfig and the policy types it carries.

Every field the schema accepts is either enforced or refused at start: nothing is accepted and silently
ignored (docs/invariants.md). Values outside what a field can mean are refused when the config is parsed
(``invalid_message``); values this product cannot honour (a context strategy it does not know, another
reasoning loop, a persona it has no registry for) are refused by ``unsupported`` when a run starts
(``unsupported_config``), before anything is written. Where each field is enforced is said beside it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field, SerializerFunctionWrapHandler, model_serializer

from intermission.schemas.base import Model
from intermission.schemas.llm import Message, Role

# The context strategies the agent loop knows. "recent": the last max_messages messages.
CONTEXT_STRATEGIES = frozenset({"recent"})
# The reasoning loops this product runs: its one agent loop (a model turn, its tool calls, their results,
# the next turn), which "" names by default and "react" names explicitly.
REASONING_LOOPS = frozenset({"", "react"})
# The range of sampling temperatures the major providers accept; anything outside it no model honours.
MAX_TEMPERATURE = 2.0
# What a Notice carries instead of a pending call's arguments when the run's publication policy redacts
# them: valid JSON, and deliberately NOT an object, so a host that tries to run the call with it fails
# loudly instead of running it with made-up arguments.
REDACTED_ARGUMENTS = '"[redacted]"'
# A decider is named as RabbitMQ names the user a message's broker-validated user_id carries: an AMQP short
# string, at most 255 bytes.
MAX_USER_NAME_BYTES = 255
# How many tools a config may name approvers for, and how many approvers per tool: a config travels in
# every snapshot and pause of its run, so it stays small. No demo tool needs a tenth of either.
MAX_APPROVER_TOOLS = 64
MAX_APPROVERS_PER_TOOL = 64
MAX_TOOL_NAME_LENGTH = 128


def _printable_name(name: str) -> str:
    """A name that is written into logs, Notices and checkpoints: something, and nothing a terminal acts on."""
    if not name:
        raise ValueError("a name must not be empty")
    if not name.isprintable():
        raise ValueError(f"{name!r} holds characters that are not printable")
    return name


def _user_name(name: str) -> str:
    _printable_name(name)
    if len(name.encode("utf-8")) > MAX_USER_NAME_BYTES:
        raise ValueError(f"a RabbitMQ user name is at most {MAX_USER_NAME_BYTES} bytes")
    return name


# A RabbitMQ user name: the decider a decision's user_id names.
UserName = Annotated[str, AfterValidator(_user_name)]
ToolName = Annotated[str, Field(max_length=MAX_TOOL_NAME_LENGTH), AfterValidator(_printable_name)]
# An empty list would read as "anyone" to some and "no one" to others: a tool whose approvals anyone in
# scope may decide is simply left out of the map.
Approvers = Annotated[list[UserName], Field(min_length=1, max_length=MAX_APPROVERS_PER_TOOL)]


class ContextPolicy(Model):
    """How much conversation the loop shows the model (the original's cognitive.ContextPolicy).

    Enforced by the agent loop (``agent/loop.py``, ``window``) on every model request; the run keeps and
    saves its whole conversation either way."""

    # 0 means the whole conversation.
    max_messages: int = Field(default=0, ge=0)
    # One of CONTEXT_STRATEGIES; any other is refused at start.
    strategy: str = "recent"


class PublicationPolicy(Model):
    """What a run may publish outside itself (the original's safety.Policy)."""

    # Redact pending calls' arguments from the Notices this run's pauses publish (store/runs.py): hosts
    # that show pauses to people use it. The stored pause keeps them, for whoever must execute the call.
    redact_arguments: bool = False
    # Terms a model turn must not contain (case-insensitive substrings): a turn that does fails the run
    # (publication_blocked) before any of its calls runs or its answer is published, and is not kept in the
    # session. An empty term would match everything, so it is refused.
    blocked_terms: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)

    def blocks(self, text: str) -> bool:
        """Whether ``text`` holds one of the blocked terms."""
        if not self.blocked_terms:
            return False
        folded = text.casefold()
        return any(term.casefold() in folded for term in self.blocked_terms)


class Budget(Model):
    """Spending limits of a whole run (the original's execution.Budget), enforced by the agent loop.

    ``max_total_tokens`` 0 means unlimited. ``max_tool_calls`` 0 in a start means the worker's default
    (``INTERMISSION_MAX_TOOL_CALLS``), which the start writes into the stored config; a stored 0 (a run
    started before the default existed) is unlimited."""

    max_total_tokens: int = Field(default=0, ge=0)
    max_tool_calls: int = Field(default=0, ge=0)


class ExecutionProvenance(Model):
    """Where a run's execution came from (the original's run.ExecutionProvenance)."""

    agent_id: str = ""
    executor: str = ""
    model: str = ""
    worker: str = ""


class RunConfig(Model):
    """The resolved configuration a run was executing under: defaults, agent and run overrides, flattened.

    It is stored with the continuation because a resume rebuilds its config from here and from nowhere
    else. A run's overrides live only in the call that started it, so a resume that re-merged the agent's
    config would silently drop them: a run started with a narrowed ``tools`` list would come back with the
    agent's full tool set (authority widening across a pause), and a run started with a raised
    ``max_steps`` would come back on a smaller budget and refuse to continue.
    """

    context: ContextPolicy | None = None
    publication: PublicationPolicy = Field(default_factory=PublicationPolicy)
    budget: Budget = Field(default_factory=Budget)
    # No tool at all (allows_tool).
    all_tools_restricted: bool = False
    # Passed to the model with every request (ModelRequest.model) and recorded in the run's provenance.
    model: str = ""
    # Passed to the model with every request (ModelRequest.temperature); None leaves it to the model.
    # NaN and infinities have no JSON form (they would be stored as null and come back as None).
    temperature: float | None = Field(default=None, allow_inf_nan=False, ge=0.0, le=MAX_TEMPERATURE)
    # The steps (model turns) the run may take; 0 in a start means the worker's default.
    max_steps: int = Field(default=0, ge=0)
    # The output tokens one model turn may take: passed to the model (ModelRequest.max_tokens), and a turn
    # that reports more fails the run (max_tokens_exceeded). 0 means no limit.
    max_tokens: int = Field(default=0, ge=0)
    # One of REASONING_LOOPS; any other is refused at start.
    reasoning_loop: str = ""
    # The tools the run may call (allows_tool).
    tools: list[str] = Field(default_factory=list)
    # This product has no persona registry: a persona is given through the agent's system prompt, and a
    # run that names one is refused at start rather than run without it.
    persona_ref: str = ""
    # Says ``tools`` is an explicit allowlist even when it is empty, which is what an overlay that withdrew
    # the agent's last tool produces. Without it an empty list would read as "every registered tool" and a
    # resume would hand back exactly what the overlay took away. It is absent from rows written before it
    # existed and decodes there as FALSE: the flag can be lost across an upgrade but never spuriously set,
    # which is the safe direction (inventing it would strip tools from a run nobody restricted).
    tools_restricted: bool = False
    # Who may decide the approvals of each tool's calls: tool name -> RabbitMQ user names, named by the host
    # that started the run, never by the model. Enforced by the agent loop when a call of the tool pauses
    # for approval (``agent/loop.py``, ``schemas/answers.py`` ``call_approvers``): the call's own
    # ``approvers`` argument may only narrow this list; a tool left out is decided by anyone who may
    # publish for the scope, or by whom the call names. A tool that never pauses for approval has no
    # decision for its list to restrict. The pause stores the result, and a decision from anybody else is
    # ``forbidden``. It travels with the rest of the config in the continuation, so a resumed run's next
    # pause is restricted exactly as its first.
    approvers: dict[ToolName, Approvers] = Field(default_factory=dict, max_length=MAX_APPROVER_TOOLS)

    @model_serializer(mode="wrap")
    def _leave_out_no_approvers(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A config that names no approvers is written (stored, digested) exactly as before the field
        # existed: a start re-sent across the upgrade is still the same start (its inbox digest and its
        # start digest), not a message_id_conflict or run_exists.
        data = handler(self)
        if not self.approvers and isinstance(data, dict):
            data.pop("approvers", None)
        return data

    def approvers_for(self, tool: str) -> list[str] | None:
        """The host's approvers for ``tool``'s calls; None when it names none (anyone in scope)."""
        named = self.approvers.get(tool)
        return list(named) if named is not None else None

    def allows_tool(self, name: str) -> bool:
        """Whether this run may call the tool ``name``."""
        if self.all_tools_restricted:
            return False
        if self.tools or self.tools_restricted:
            return name in self.tools
        return True

    def unsupported(self) -> list[str]:
        """What in this config the product cannot honour, one reason each; empty when it can honour it all."""
        found = []
        if self.context is not None and self.context.strategy not in CONTEXT_STRATEGIES:
            found.append(f"context.strategy {self.context.strategy!r} is not one of {sorted(CONTEXT_STRATEGIES)}")
        if self.reasoning_loop not in REASONING_LOOPS:
            found.append(f"reasoning_loop {self.reasoning_loop!r} is not one of {sorted(REASONING_LOOPS)}")
        if self.persona_ref:
            found.append(
                "persona_ref: there is no persona registry here; give the agent its persona in its system prompt"
            )
        return found

    def window(self, messages: list[Message]) -> list[Message]:
        """The messages the model is shown (``context``): all of them, or with max_messages set, the most
        recent ones ("recent"), never opening on tool results whose assistant turn was cut off (a provider
        refuses a tool message that answers no call it can see)."""
        policy = self.context
        if policy is None or policy.max_messages == 0 or len(messages) <= policy.max_messages:
            return messages
        shown = messages[-policy.max_messages :]
        start = 0
        while start < len(shown) and shown[start].role is Role.TOOL:
            start += 1
        return shown[start:]
