"""Protocols between a model and its callers: chat templates rendered so that only the template
writes a role boundary (`templates`), replies parsed back into messages and tool calls
(`replies`), and the Harmony format of channels and recipients (`harmony`)."""
