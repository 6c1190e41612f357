"""MkDocs hook: the pictures the pages show, drawn before the build collects its files (`benchmarks/charts.py`)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def on_pre_build(config, **kwargs):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT))
    from charts import draw_all

    draw_all(str(ROOT / "docs" / "figures"))
