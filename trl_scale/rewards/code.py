"""`CodeExecutionReward`: a reward function that runs the code each completion holds against the row's tests, in the
sandbox (`sandbox.py`), on a pool of runs at once; the reward is the fraction of tests passed (or `score(outcomes)`).

Tests, one list per row (a dataset column, `tests` by default; a JSON string is read too):
- `{"call": "add(2, 3)", "expected": 5}`: the solution is loaded as a module and the call evaluated in it;
- `{"stdin": "2 3\\n", "stdout": "5\\n"}`: the solution runs as a program, once per test, on that input.

A pass is decided here, outside the sandbox, against expected values that never enter it: the sandbox prints what the
code returned (as JSON) or printed, and code that exits early, fakes a report, returns an object whose `==` always
holds, or kills its own harness scores nothing for the tests it did not answer. Two answers for one test are none.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .sandbox import RunResult, Sandbox, SandboxSettings

# The sandbox's harness for call tests: the solution loaded as module `solution`, each call's value written as a JSON
# line on a copy of stdout taken before the solution ran (it may close or replace sys.stdout).
CALL_HARNESS = """\
import json, os, sys
out = os.fdopen(os.dup(1), "w")
calls = json.load(open("calls.json"))
namespace = {"__name__": "solution"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
except BaseException as error:
    out.write(json.dumps({"load_error": type(error).__name__}) + "\\n")
    out.flush()
    raise SystemExit(1)
for index, call in enumerate(calls):
    try:
        line = '{"i": %d, "value": %s}' % (index, json.dumps(eval(call, namespace)))
    except BaseException as error:
        line = json.dumps({"i": index, "error": type(error).__name__})
    out.write(line + "\\n")
    out.flush()
"""

# A fenced block, its language tag optional and in any case (```python, ```Python, ``` py, ```python3).
FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion) -> str:
    """The code of a completion: its last fenced block (```python ... ```), else the whole text. A conversational
    completion (a list of messages) gives its last message's content."""
    if isinstance(completion, list):
        completion = completion[-1].get("content", "") if completion else ""
        if isinstance(completion, list):  # content blocks
            completion = "".join(block.get("text", "") for block in completion if isinstance(block, dict))
    blocks = FENCE.findall(completion or "")
    return blocks[-1] if blocks else (completion or "")


@dataclass
class TestOutcome:
    """One test of one row: passed or not, and how its run ended (`RunResult.status`, or "answered")."""

    passed: bool
    status: str


def _same(got, expected) -> bool:
    """Equal as JSON values, strictly: `True` is not 1, though Python says so; 1 and 1.0 are equal numbers; an
    expected tuple (`divmod`'s) is the list JSON makes of it."""
    if isinstance(expected, tuple):
        expected = list(expected)
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
        return got == expected
    if isinstance(expected, list) and isinstance(got, list):
        return len(got) == len(expected) and all(_same(g, e) for g, e in zip(got, expected))
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(_same(got[k], expected[k]) for k in expected)
    return type(got) is type(expected) and got == expected


def _normalised(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def parse_tests(tests, row: int, column: str) -> list[dict]:
    """A row's tests, checked and each reduced to its kind's keys: `{"call", "expected"}` or `{"stdin", "stdout"}`
    (a `datasets` column that mixes both kinds gives every test all four keys, the other kind's as None)."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as error:
            raise ValueError(f"row {row}: column {column!r} is not JSON ({error})") from None
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"row {row}: column {column!r} must be a non-empty list of tests, got {type(tests).__name__}")
    parsed = []
    for test in tests:
        if isinstance(test, dict) and isinstance(test.get("call"), str) and "expected" in test:
            json.dumps(test["expected"])  # raises for a value the sandbox could not answer with
            parsed.append({"call": test["call"], "expected": test["expected"]})
        elif isinstance(test, dict) and isinstance(test.get("stdin"), str) and isinstance(test.get("stdout"), str):
            parsed.append({"stdin": test["stdin"], "stdout": test["stdout"]})
        else:
            raise ValueError(
                f"row {row}: each test in {column!r} is {{'call': str, 'expected': value}} or "
                f"{{'stdin': str, 'stdout': str}}; got {test!r}"
            )
    return parsed


@dataclass
class CodeExecutionReward:
    """A reward function (for `reward_funcs` of every trainer): the fraction of the row's tests the completion's code
    passes, run in the sandbox.

    Args:
        tests_column: the dataset column holding each row's tests.
        sandbox: the sandbox's limits (`SandboxSettings`).
        score: `score(outcomes) -> float` instead of the fraction passed.
        extract: `extract(completion) -> code` instead of the last fenced block.
    """

    tests_column: str = "tests"
    sandbox: SandboxSettings = field(default_factory=SandboxSettings)
    score: Callable[[list[TestOutcome]], float] | None = None
    extract: Callable[[object], str] = extract_code

    def __post_init__(self):
        self._sandbox = Sandbox(self.sandbox)  # refuses here, naming the fix, where no sandbox can be made
        self._pool = ThreadPoolExecutor(self._sandbox.slots, thread_name_prefix="sandbox")
        self.statuses: dict[str, int] = {}  # how the runs ended, since the reward was made
        self._lock = threading.Lock()  # the stream's reward workers may call it from several threads at once

    def __call__(self, completions: list, log_metric: Callable | None = None, **kwargs) -> list[float]:
        if self.tests_column not in kwargs:
            raise KeyError(
                f"CodeExecutionReward reads each row's tests from the dataset column {self.tests_column!r}, which "
                f"this batch lacks (columns: {sorted(kwargs)}). Fix: add it, or set tests_column"
            )
        rows = [parse_tests(t, i, self.tests_column) for i, t in enumerate(kwargs[self.tests_column])]
        outcomes = self.verify([self.extract(c) for c in completions], rows)
        if log_metric is not None:
            for status, count in Counter(o.status for row in outcomes for o in row).items():
                log_metric(f"code_execution/{status}", count)
        return [self.score(row) if self.score else sum(o.passed for o in row) / len(row) for row in outcomes]

    def verify(self, codes: list[str], tests: list[list[dict]]) -> list[list[TestOutcome]]:
        """Each code against its tests: every sandboxed run of the batch at once (up to the sandbox's slots)."""
        jobs = []  # (row, [test indices], future)
        for row, (code, row_tests) in enumerate(zip(codes, tests, strict=True)):
            calls = [i for i, t in enumerate(row_tests) if "call" in t]
            if calls:
                job = self._pool.submit(self._run_calls, code, [row_tests[i]["call"] for i in calls])
                jobs.append((row, calls, job))
            for i, test in enumerate(row_tests):
                if "stdin" in test:
                    jobs.append((row, [i], self._pool.submit(self._sandbox.run, code, stdin=test["stdin"])))
        outcomes = [[TestOutcome(False, "not run") for _ in row_tests] for row_tests in tests]
        for row, indices, job in jobs:
            result = job.result()
            with self._lock:
                self.statuses[result.status] = self.statuses.get(result.status, 0) + 1
            for index, passed in zip(indices, _judge(result, [tests[row][i] for i in indices]), strict=True):
                outcomes[row][index] = TestOutcome(passed, "answered" if passed else result.status)
        return outcomes

    def _run_calls(self, code: str, calls: list[str]) -> RunResult:
        files = {"solution.py": code, "calls.json": json.dumps(calls)}
        return self._sandbox.run(CALL_HARNESS, files=files, argv=(secrets.token_hex(4),))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _judge(result: RunResult, tests: list[dict]) -> list[bool]:
    """Which of `tests` (run together in `result`) passed."""
    if "stdin" in tests[0]:
        ok = result.status == "exited" and result.returncode == 0
        return [ok and _normalised(result.stdout) == _normalised(tests[0]["stdout"])]
    answers: dict[int, list] = {}
    for line in result.stdout.splitlines():
        try:
            answer = json.loads(line)
        except ValueError:
            continue  # the solution's own prints
        if isinstance(answer, dict) and isinstance(answer.get("i"), int):
            answers.setdefault(answer["i"], []).append(answer)
    passed = []
    for index, test in enumerate(tests):
        given = answers.get(index, [])
        passed.append(len(given) == 1 and "value" in given[0] and _same(given[0]["value"], test["expected"]))
    return passed
