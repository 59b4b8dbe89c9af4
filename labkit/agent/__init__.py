"""A small agent runtime: tools on an allow-list, run in a sandbox, in a loop with a model.

    confine.py   the confinement of a tool's process (namespaces, caps, seccomp, rlimits)
    sandbox.py   Sandbox.run: limits, a scratch directory, how a run ended (ToolResult)
    tools.py     Tool, ToolRegistry (the allow-list, arguments checked with jsonschema)
    toolbox/     calculator, word_count, run_python
    runtime.py   run_agent: model -> tool calls -> tool turns -> model ..., one trace id
"""
