"""Cut OpenAI's OpenAPI document down to the operations labkit serves.

    git -C OPENAI_OPENAPI_REPO show HEAD:openapi.json > /tmp/openapi.json
    python tests/openai_openapi/cut.py /tmp/openapi.json > tests/openai_openapi/completions.json
    python tests/openai_openapi/cut.py /tmp/openapi.json responses > tests/openai_openapi/responses.json

`completions` (the default) keeps `POST /completions` (createCompletion) and
`POST /chat/completions` (createChatCompletion); `responses` keeps `POST /responses`
(createResponse). Each keeps every component (schema, response, security scheme) they reference,
transitively, and the document's own `openapi`, `info` and `security`. Each operation's
`x-oaiMeta` (documentation examples, hundreds of lines, no part of the contract) is dropped;
nothing else is changed.
"""

from __future__ import annotations

import json
import sys

CUTS = {"completions": {"/completions": "post", "/chat/completions": "post"},
        "responses": {"/responses": "post"}}
DROPPED_OPERATION_KEYS = ("x-oaiMeta",)


def references(node) -> set[str]:
    """Every `$ref` target under node, as a JSON pointer."""
    found, pending = set(), [node]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            if isinstance(item.get("$ref"), str):
                found.add(item["$ref"])
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return found


def cut(full: dict, operations: dict[str, str] = CUTS["completions"]) -> dict:
    paths = {}
    for path, method in operations.items():
        operation = {k: v for k, v in full["paths"][path][method].items() if k not in DROPPED_OPERATION_KEYS}
        paths[path] = {method: operation}
    components: dict[str, dict] = {}
    pending = references(paths)
    seen: set[str] = set()
    while pending:
        pointer = pending.pop()
        if pointer in seen:
            continue
        seen.add(pointer)
        _, _, section, name = pointer.split("/", 3)   # "#/components/schemas/Name"
        target = full["components"][section][name]
        components.setdefault(section, {})[name] = target
        pending |= references(target)
    security = full.get("security", [])
    for requirement in security:
        for scheme in requirement:
            components.setdefault("securitySchemes", {})[scheme] = full["components"]["securitySchemes"][scheme]
    components = {section: dict(sorted(entries.items())) for section, entries in sorted(components.items())}
    return {"openapi": full["openapi"], "info": full["info"], "security": security, "paths": paths,
            "components": components}


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as source:
        document = cut(json.load(source), CUTS[sys.argv[2] if len(sys.argv) > 2 else "completions"])
    json.dump(document, sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")
