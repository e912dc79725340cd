"""Grammars for structured outputs and strict tool calls, on xgrammar (an optional dependency):
compiled once per distinct text, enforced as a token bitmask inside the engine's sampling step."""
