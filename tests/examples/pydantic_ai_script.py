"""The offline model the pydantic-ai example agent runs on in the tests: pydantic-ai's ``FunctionModel``
playing a script, deterministically, with no LLM and no network.

The run's input is the script: a JSON list with one entry per model turn, each a list of
``[tool, arguments]`` calls or a final text, in which ``{results}`` stands for what the previous turn's
calls returned:

    [[["charge", {"amount": 5}], ["lookup", {"query": "q"}]], "done: {results}"]

Any other input is answered ``You said: <input>``. Call ids are ``<tool>-<turn>-<position>``, the same in
every run, as a real provider's may repeat across turns.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel


def _turn_index(messages: list[ModelMessage]) -> int:
    """How many model turns this run has taken since its prompt (a session's earlier runs excluded)."""
    start = 0
    for index, message in enumerate(messages):
        if isinstance(message, ModelRequest) and any(isinstance(p, UserPromptPart) for p in message.parts):
            start = index
    return sum(isinstance(m, ModelResponse) for m in messages[start:])


def _prompt(messages: list[ModelMessage]) -> str:
    for message in reversed(messages):
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, UserPromptPart) and isinstance(part.content, str):
                    return part.content
    return ""


def _results(messages: list[ModelMessage]) -> str:
    """What the calls of the last turn returned, in the order the model sees them."""
    last = max((i for i, m in enumerate(messages) if isinstance(m, ModelResponse)), default=-1)
    seen: list[str] = []
    for message in messages[last + 1 :]:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, ToolReturnPart):
                    seen.append(f"{part.tool_name}={part.model_response_str()}")
                elif isinstance(part, RetryPromptPart) and part.tool_name:
                    seen.append(f"{part.tool_name}!{part.model_response()}")
    return "; ".join(seen)


def play(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    prompt = _prompt(messages)
    try:
        script: Any = json.loads(prompt)
    except json.JSONDecodeError:
        script = None
    if not isinstance(script, list):
        return ModelResponse(parts=[TextPart(f"You said: {prompt}")])
    n = _turn_index(messages)
    turn: Any = script[n] if n < len(script) else "done"
    if isinstance(turn, str):
        text = turn.replace("{results}", _results(messages))
        if info.output_tools:  # a structured output: the model answers through pydantic-ai's output tool
            return ModelResponse(parts=[ToolCallPart(info.output_tools[0].name, text, tool_call_id=f"out-{n}")])
        return ModelResponse(parts=[TextPart(text)])
    return ModelResponse(
        parts=[
            ToolCallPart(name, json.dumps(arguments), tool_call_id=f"{name}-{n}-{k}")
            for k, (name, arguments) in enumerate(turn)
        ]
    )


def scripted_model() -> FunctionModel:
    return FunctionModel(play)
