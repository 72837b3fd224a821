"""Executors for agents written with frameworks: each module wraps a framework's agent so that its pauses
(approvals, external tools, questions to other agents) become durable Intermission pauses.

Each integration needs its framework, installed as an extra (``pip install 'intermission[pydantic-ai]'``,
``'intermission[openai-agents]'``); nothing else in Intermission imports them.
"""
