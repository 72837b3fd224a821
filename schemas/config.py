"""RunConfig and the policy types it carries."""

from __future__ import annotations

from pydantic import Field

from intermission.schemas.base import Model


class ContextPolicy(Model):
    """How much conversation the loop shows the model (the original's cognitive.ContextPolicy)."""

    # 0 means the whole conversation.
    max_messages: int = Field(default=0, ge=0)
    strategy: str = "recent"


class PublicationPolicy(Model):
    """What a run may publish outside itself (the original's safety.Policy)."""

    # Redact tool arguments from Notices and events; hosts that show pauses to people use it.
    redact_arguments: bool = False
    blocked_terms: list[str] = Field(default_factory=list)


class Budget(Model):
    """Spending limits of a whole run (the original's execution.Budget).

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
    all_tools_restricted: bool = False
    model: str = ""
    # NaN and infinities have no JSON form: they would be stored as null and come back as None.
    temperature: float | None = Field(default=None, allow_inf_nan=False)
    max_steps: int = 0
    max_tokens: int = 0
    reasoning_loop: str = ""
    tools: list[str] = Field(default_factory=list)
    persona_ref: str = ""
    # Says ``tools`` is an explicit allowlist even when it is empty, which is what an overlay that withdrew
    # the agent's last tool produces. Without it an empty list would read as "every registered tool" and a
    # resume would hand back exactly what the overlay took away. It is absent from rows written before it
    # existed and decodes there as FALSE: the flag can be lost across an upgrade but never spuriously set,
    # which is the safe direction (inventing it would strip tools from a run nobody restricted).
    tools_restricted: bool = False

    def allows_tool(self, name: str) -> bool:
        """Whether this run may call the tool ``name``."""
        if self.all_tools_restricted:
            return False
        if self.tools or self.tools_restricted:
            return name in self.tools
        return True
