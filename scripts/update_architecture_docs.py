"""Rewrite docs/architecture.md's module index from the code: every module of `trl_scale/`, by package, with the
first sentence of its docstring. tests/test_docs.py fails while the page is stale."""

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- module index: scripts/update_architecture_docs.py -->", "<!-- end of the module index -->"


def first_sentence(path: Path) -> str:
    text = " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split("\n\n")[0].split())
    depth, end = 0, len(text)
    for index, char in enumerate(text):  # the first "." or ":" ending a sentence, outside parentheses
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char in ".:" and depth == 0 and (index + 1 == len(text) or text[index + 1] == " "):
            end = index
            break
    return text[:end].replace("|", "\\|") or "(no docstring)"


def module_index() -> str:
    rows = ["| module | what it is |", "|---|---|"]
    for path in sorted((ROOT / "trl_scale").rglob("*.py")):
        if path.name == "__main__.py":
            continue
        name = str(path.relative_to(ROOT / "trl_scale"))
        name = name.removesuffix("__init__.py") or "trl_scale/" if path.name == "__init__.py" else name
        rows.append(f"| `{name}` | {first_sentence(path)} |")
    return "\n".join([BEGIN, *rows, END])


def updated(page: str) -> str:
    if BEGIN not in page:
        return page.rstrip("\n") + "\n\n## Every module\n\n" + module_index() + "\n"
    return re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: module_index(), page, flags=re.S)


if __name__ == "__main__":
    PAGE.write_text(updated(PAGE.read_text()))
    sys.exit(0)
