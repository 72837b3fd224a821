"""The model protocol the agent loop asks for each assistant turn, and the scripted model.

To plug a real model in, implement ``ModelClient.next_turn`` (call your provider with the request's
system prompt, messages and tool specs, and its ``model``, ``temperature`` and ``max_tokens``; map its reply
to a ``ModelTurn``) and name a factory that returns an ``AgentLoop`` over it in ``INTERMISSION_EXECUTOR``.
The README shows one. The loop checks what it can of the reply itself: a turn reporting more output tokens
than ``max_tokens`` fails the run, whatever the client did with the limit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from intermission.schemas.config import RunConfig
from intermission.schemas.llm import Message, Role, ToolCall, Usage
from intermission.schemas.run import Run


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str


@dataclass(frozen=True)
class ModelRequest:
    run: Run
    system_prompt: str
    # What the model is shown: the run's conversation through its context policy (RunConfig.window).
    messages: list[Message]
    tools: list[ToolSpec]
    config: RunConfig
    # The number of assistant turns the run has had so far.
    step_index: int
    # The run config's model settings, for the provider: send them. Empty / None: the provider's default.
    model: str = ""
    temperature: float | None = None
    # The output tokens this turn may take (None: no limit).
    max_tokens: int | None = None


@dataclass(frozen=True)
class ModelTurn:
    """One assistant turn: tool calls to make, or (with none) the final answer in ``content``."""

    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)


class ModelClient(Protocol):
    async def next_turn(self, request: ModelRequest) -> ModelTurn: ...


def _tokens(text: str) -> int:
    return max(1, len(text) // 4)


class ScriptedModel:
    """Plays the run's ``script``, one turn per step, so the fleet runs end to end with no LLM.

    A script is deterministic by construction, so ``model`` and ``temperature`` have nothing to change in
    it; ``max_tokens`` it honours as a provider does, by cutting a final answer short at the limit (four
    characters a token, as it counts them).

    ``{"call": [...]}`` makes an assistant turn with those tool calls; ``{"say": TEXT}`` is the final
    answer. A script that runs out answers with the last tool result. Call ids are ``call-<step>-<n>``:
    deterministic, so the same step always names its calls the same way.
    """

    async def next_turn(self, request: ModelRequest) -> ModelTurn:
        script = request.run.script or []
        prompt_tokens = sum(_tokens(m.content) for m in request.messages)
        if request.step_index < len(script):
            turn = script[request.step_index]
            if turn.say is not None:
                say = _cut(turn.say, request.max_tokens)
                return ModelTurn(content=say, usage=_usage(prompt_tokens, _tokens(say)))
            calls = [
                ToolCall(id=f"call-{request.step_index}-{n}", name=c.tool, arguments=json.dumps(c.arguments))
                for n, c in enumerate(turn.call or [])
            ]
            return ModelTurn(tool_calls=calls, usage=_usage(prompt_tokens, 8 * len(calls)))
        last_result = next((m for m in reversed(request.messages) if m.role is Role.TOOL), None)
        content = _cut(last_result.content if last_result is not None else request.run.input, request.max_tokens)
        return ModelTurn(content=content, usage=_usage(prompt_tokens, _tokens(content)))


def _cut(text: str, max_tokens: int | None) -> str:
    return text if max_tokens is None else text[: 4 * max_tokens]


def _usage(prompt: int, completion: int) -> Usage:
    return Usage(input_tokens=prompt, output_tokens=completion, total_tokens=prompt + completion)
