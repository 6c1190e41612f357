"""Rewrite docs/step.md's printed steps from `trl-scale step --example NAME` (the page's text blocks, in order of
`cli_step.EXAMPLES`). tests/test_step.py fails while the page is stale."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trl_scale.cli_step import EXAMPLES, example_step  # noqa: E402

page = ROOT / "docs" / "step.md"
blocks = iter(example_step(name) for name in EXAMPLES)
text = re.sub(r"```text\n.*?\n```", lambda _: f"```text\n{next(blocks)}\n```", page.read_text(), flags=re.S)
page.write_text(text)
