"""Every flag of `labkit serve` is documented in labkit/serve/README.md's flag table."""

from __future__ import annotations

import argparse
from pathlib import Path

from labkit.serve.server import add_arguments

README = Path(__file__).resolve().parents[1] / "labkit" / "serve" / "README.md"


def test_every_flag_is_in_the_readme_table():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = [option for action in parser._actions for option in action.option_strings
             if option.startswith("--") and option != "--help"]
    table = README.read_text().split("## Flags", 1)[1].split("\n## ", 1)[0]
    missing = [flag for flag in flags if f"`{flag}`" not in table]
    assert flags and not missing, f"flags without a row in the README's table: {missing}"


def test_every_request_field_is_in_the_readme_fields_table():
    """Each field the OpenAI routes take has a row (its name in backticks in the first column)."""
    import re

    from labkit.serve.protocol import ChatCompletionRequest, CompletionRequest

    table = README.read_text().split("\n## Fields", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    documented = {name.split(".")[0] for row in rows for name in re.findall(r"`([a-z_.]+)`", row)}
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    missing = sorted(fields - documented)
    assert {"logit_bias", "stop_token_ids", "echo"} <= documented
    assert not missing, f"request fields without a row in the README's Fields table: {missing}"
