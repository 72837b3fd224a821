"""Intermission's domain types, command and event bodies, and errors (pydantic v2)."""
