"""An example of plugging your own model into the agent loop (the README points here).

A real model client calls its provider in ``next_turn``: send ``request.system_prompt``,
``request.messages`` and ``request.tools``, and map the reply to a ``ModelTurn`` (text in ``content``, tool
calls in ``tool_calls`` with the provider's call ids and JSON-encoded arguments, token counts in
``usage``). This one needs no network: it looks a keyword up once, then answers with what came back.

Use it with ``INTERMISSION_EXECUTOR=tests.examples.keyword_model:executor``.
"""

from __future__ import annotations

import json

from intermission.agent.loop import AgentLoop
from intermission.agent.model import ModelRequest, ModelTurn
from intermission.agent.tools import demo_tools
from intermission.schemas.llm import Role, ToolCall, Usage


class KeywordModel:
    async def next_turn(self, request: ModelRequest) -> ModelTurn:
        results = [m for m in request.messages if m.role is Role.TOOL]
        if not results:
            question = next(m.content for m in reversed(request.messages) if m.role is Role.USER)
            call = ToolCall(id=f"kw-{request.step_index}", name="lookup", arguments=json.dumps({"query": question}))
            return ModelTurn(tool_calls=[call], usage=Usage(input_tokens=len(question), total_tokens=len(question)))
        return ModelTurn(content=f"I found: {results[-1].content}", usage=Usage(output_tokens=4, total_tokens=4))


def executor() -> AgentLoop:
    """The factory INTERMISSION_EXECUTOR names: any callable returning an object with ``execute(ctx)``."""
    return AgentLoop(KeywordModel(), demo_tools(), system_prompt="You look things up.")
