"""Write tests/module_seconds.json from a suite run's JUnit XML: each test file's measured seconds (all its tests'
setup, call and teardown). tests/conftest.py hands the slowest files to pytest-xdist first, so the two workers end
together instead of one running the heaviest modules alone at the end.

    bash scripts/test.sh --junitxml=/tmp/suite.xml && .venv/bin/python scripts/module_seconds.py /tmp/suite.xml
"""

import collections
import json
import pathlib
import sys
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(junit_xml: str) -> None:
    seconds: collections.Counter = collections.Counter()
    for case in ET.parse(junit_xml).iter("testcase"):
        path = case.get("classname").replace(".", "/") + ".py"  # tests.test_ray -> tests/test_ray.py
        while not (ROOT / path).is_file() and "/" in path:  # a class inside the module: drop its name
            path = path.rsplit("/", 1)[0] + ".py"
        seconds[path] += float(case.get("time") or 0.0)
    ordered = {path: round(value, 1) for path, value in seconds.most_common()}
    (ROOT / "tests" / "module_seconds.json").write_text(json.dumps(ordered, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
