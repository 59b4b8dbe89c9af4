"""Extract the prose paragraphs of reStructuredText files (drop code, directives, headings).

Used once to make data/eval/python-docs-prose.txt (now labkit/data/eval/python-docs-prose.txt)
from the Python 3.11 documentation sources in Debian's python3.11-doc package (see
labkit/data/eval/README.md):

    apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb x
    python data/tools/extract_rst_prose.py x/usr/share/doc/python3.11/html/_sources/{tutorial,faq}/*.rst.txt
"""

import re
import sys

ROLE = re.compile(r":[a-z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`_+")
LITERAL = re.compile(r"``([^`]+)``")
EMPH = re.compile(r"\*\*?([^*\s][^*]*?)\*\*?")
REF = re.compile(r"`([^`]+)`_*")


def inline(text: str) -> str:
    for pattern in (ROLE, LINK, LITERAL, EMPH, REF):
        text = pattern.sub(r"\1", text)
    return text


def paragraphs(source: str):
    lines = source.splitlines()
    block: list[str] = []
    skip_indent = None  # inside a code block or directive: skip lines indented past this
    for line in lines + [""]:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if stripped == "" or indent > skip_indent:
                continue
            skip_indent = None
        if stripped.startswith(".."):
            skip_indent = indent
            block = []
            continue
        if re.fullmatch(r"[=\-~^*#+\"']{3,}", stripped):  # heading underline: drop the heading
            block = []
            continue
        if stripped == "":
            if block:
                yield " ".join(block)
            block = []
            continue
        if indent > 0 and not block:  # an indented block on its own (quote, code): skip
            continue
        if stripped.startswith((">>>", "...", "$ ", "|", "* ", "- ", "#. ")) or "::" == stripped:
            block = []
            skip_indent = indent
            continue
        block.append(stripped)
        if stripped.endswith("::"):  # the paragraph introduces a literal block
            block[-1] = stripped[:-2].rstrip() + ("" if stripped == "::" else ":")
            yield " ".join(block)
            block = []
            skip_indent = indent


def main(paths: list[str]) -> None:
    for path in paths:
        for para in paragraphs(open(path, encoding="utf-8").read()):
            para = inline(para).strip()
            if len(para.split()) >= 12 and not para.startswith(("(", ":")):
                print(para)
                print()


if __name__ == "__main__":
    main(sys.argv[1:])
