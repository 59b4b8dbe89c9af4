"""Protocols between a model and its callers: chat templates rendered so that only the template
writes a role boundary (`templates`), replies parsed back into messages and tool calls
(`replies`), the Harmony format of channels and recipients (`harmony`), and tool calling as every
protocol's adapter shares it (`tool_use`: tools checked, described to the model, forced by a
grammar or read back and validated, past calls and results rendered as data)."""
