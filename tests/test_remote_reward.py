"""`RemoteReward` against real reward-server processes on loopback (`trl-scale reward-server`, OpenRLHF's contract):
equal to scoring the same function locally, one request per prompt group, failed over when a server is killed
mid-run (a GRPO run goes on), an error naming every URL when all are down, and an answer outside the contract (wrong
length, not numbers, a refusal) named with its server and field."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from transformers import TrainerCallback

from trl_scale.rewards import AsyncRemoteReward, RemoteReward, RewardServiceError

from .helpers import cpu_args, free_port
from .reward_servers import RewardServerProcess, response_length

FUNCTION = "tests.reward_servers:response_length"


@pytest.fixture(scope="module")
def two_servers():
    servers = [RewardServerProcess("--reward", FUNCTION) for _ in range(2)]
    yield servers
    for server in servers:
        server.kill()


def local_scores(prompts: list[str], completions: list[str], labels: list | None = None) -> list[float]:
    """The same function, called here on what OpenRLHF's contract sends it."""
    labels = labels or [""] * len(prompts)
    return response_length([p + c for p, c in zip(prompts, completions)], prompts, labels)


def groups(count: int, size: int) -> tuple[list[str], list[str]]:
    """`count` prompt groups of `size` rows each (consecutive equal prompts, as TRL's sampler lays them out); every
    completion a different length, so a row paired with another row's score is seen."""
    prompts = [f"prompt {g}: " for g in range(count) for _ in range(size)]
    completions = ["x" * (3 * i + 1) for i in range(count * size)]
    return prompts, completions


def test_scores_equal_local_scoring_one_request_per_group(two_servers):
    before = sum(s.requests_served() for s in two_servers)
    reward = RemoteReward([s.url for s in two_servers], routing="least_outstanding", max_inflight_per_server=1)
    prompts, completions = groups(count=8, size=4)
    assert reward(prompts=prompts, completions=completions) == local_scores(prompts, completions)
    served = [s.requests_served() for s in two_servers]
    assert sum(served) - before == 8  # one request per prompt group
    assert all(count > 0 for count in served)  # both servers took requests
    # rows_per_request cuts a group; labels travel as OpenRLHF's `labels`
    reward = RemoteReward([two_servers[0].url], rows_per_request=3, label_column="bonus")
    bonus = [str(i) for i in range(len(prompts))]
    assert reward(prompts=prompts, completions=completions, bonus=bonus) == local_scores(prompts, completions, bonus)


def test_the_async_form_runs_on_an_event_loop_and_scores_the_same(two_servers):
    from trl.trainer.utils import is_async_callable

    reward = AsyncRemoteReward([s.url for s in two_servers])
    assert is_async_callable(reward)  # TRL gathers it with its other async reward functions
    prompts, completions = groups(count=3, size=2)
    assert asyncio.run(reward(prompts=prompts, completions=completions)) == local_scores(prompts, completions)


class KillAtStep(TrainerCallback):
    def __init__(self, server: RewardServerProcess, step: int):
        self.server, self.step = server, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.server.kill()


def local_length(prompts, completions, **kwargs) -> list[float]:
    return local_scores(prompts, completions)


def test_a_grpo_run_goes_on_when_a_reward_server_is_killed_mid_run(tiny_llama, tmp_path):
    """GRPO scored by two reward servers; one is killed (`kill -9`) after step 2: every later request goes to the
    other, no step is lost, and every step's remote reward equals the same function scored in the trainer."""
    import trl_scale
    from trl_scale.toy import counting_prompts

    servers = [RewardServerProcess("--reward", FUNCTION) for _ in range(2)]
    try:
        # one request in flight per server: each step's two prompt groups go one to each, so the killed one is tried
        urls = [s.url for s in servers]
        remote = RemoteReward(urls, routing="least_outstanding", max_inflight_per_server=1, retry_after=30.0)
        args = trl_scale.GRPOConfig(
            **cpu_args(tmp_path, max_steps=5, num_generations=4, max_completion_length=6),
            reward_weights=[1.0, 0.0],
        )
        trainer = trl_scale.GRPOTrainer(
            model=tiny_llama, reward_funcs=[remote, local_length], args=args, train_dataset=counting_prompts(64)
        )
        trainer.add_callback(KillAtStep(servers[0], step=2))
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert [entry["step"] for entry in logs] == [1, 2, 3, 4, 5]
        for entry in logs:
            assert entry["rewards/remote_reward/mean"] == pytest.approx(entry["rewards/local_length/mean"], abs=1e-6)
        assert servers[0].process.poll() is not None and remote.failovers >= 1
        assert remote.servers[0].failures >= 1 and "Connection" in remote.servers[0].last_error
    finally:
        for server in servers:
            server.kill()


def test_every_server_down_names_every_url():
    servers = [RewardServerProcess("--reward", FUNCTION) for _ in range(2)]
    urls = [s.url for s in servers]
    for server in servers:
        server.kill()
    reward = RemoteReward(urls, retries=2, retry_after=0.2, timeout=5.0)
    with pytest.raises(RewardServiceError) as error:
        reward(prompts=["a", "a"], completions=["b", "c"])
    message = str(error.value)
    assert all(url in message for url in urls) and "ConnectionError" in message, message


@pytest.fixture
def answering():
    """A stand-in server answering every POST with the given JSON (and status): what a broken server says."""
    started = []
    hits: dict[str, int] = {}  # requests each stand-in got, by its URL

    def start(body, status: int = 200) -> str:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                hits[url] = hits.get(url, 0) + 1
                self.rfile.read(int(self.headers["Content-Length"]))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        url = f"http://127.0.0.1:{server.server_address[1]}/get_reward"
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return url

    start.hits = hits
    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def test_a_server_answering_the_wrong_length_is_named(answering):
    real = RewardServerProcess("--reward", "tests.reward_servers:one_too_many")  # the reference server, a bad function
    try:
        with pytest.raises(RewardServiceError, match=rf"{real.url} answered outside the contract: 'rewards' holds 3"):
            RemoteReward([real.url])(prompts=["p", "p"], completions=["a", "b"])
    finally:
        real.kill()
    url = answering({"rewards": [1.0, "high"]})
    with pytest.raises(RewardServiceError, match=r"answered outside the contract: rewards\[1\] is 'high', not a num"):
        RemoteReward([url])(prompts=["p", "p"], completions=["a", "b"])
    url = answering({"scores": [1.0, 2.0]})
    with pytest.raises(RewardServiceError, match=r"no 'rewards' field \(got \['scores'\]\)"):
        RemoteReward([url])(prompts=["p", "p"], completions=["a", "b"])


def test_a_refusal_is_not_failed_over_and_a_5xx_is(answering, two_servers):
    refusing = answering({"detail": "bad request"}, status=422)
    with pytest.raises(RewardServiceError, match=rf"{refusing} refused the request \(422\)"):
        RemoteReward([refusing, two_servers[0].url], routing="least_outstanding")(prompts=["p"], completions=["a"])
    failing = answering({"error": "boom"}, status=503)
    reward = RemoteReward([failing, two_servers[0].url], routing="least_outstanding", retry_after=30.0)
    prompts, completions = groups(count=4, size=2)
    assert reward(prompts=prompts, completions=completions) == local_scores(prompts, completions)
    assert reward.servers[0].failures >= 1 and reward.servers[0].last_error == "HTTP 503"


def test_a_token_protected_server():
    server = RewardServerProcess("--reward", FUNCTION, api_key="s3cret")
    try:
        with pytest.raises(RewardServiceError, match=r"refused the request \(401\): .*bearer token"):
            RemoteReward([server.url])(prompts=["p"], completions=["a"])
        assert RemoteReward([server.url], api_key="s3cret")(prompts=["p"], completions=["ab"]) == [2.0]
    finally:
        server.kill()


def test_conversational_rows_are_rendered_with_the_chat_template(two_servers, tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = [[{"role": "user", "content": "count"}]] * 2
    completions = [[{"role": "assistant", "content": "one"}], [{"role": "assistant", "content": "one two"}]]
    with pytest.raises(ValueError, match="conversational rows .* pass tokenizer="):
        RemoteReward([two_servers[0].url])(prompts=prompts, completions=completions)
    got = RemoteReward([two_servers[0].url], tokenizer=tokenizer)(prompts=prompts, completions=completions)
    render = tokenizer.apply_chat_template
    queries = [render(p + c, tokenize=False) for p, c in zip(prompts, completions)]
    texts = [render(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    assert got == response_length(queries, texts, ["", ""]) and got[1] > got[0]


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"timeout": 0}, r"timeout=0: use a positive number"),
        ({"retries": -1}, r"retries=-1: use a whole number >= 0"),
        ({"retries": 1.5}, r"retries=1.5"),
        ({"max_concurrency": 0}, r"max_concurrency=0"),
        ({"rows_per_request": 0}, r"rows_per_request=0"),
        ({"routing": "random"}, r"routing='random': use one of \['latency', 'least_outstanding'\]"),
        ({"retry_afterr": 1}, r"unexpected keyword argument 'retry_afterr'"),
    ],
)
def test_bad_settings_name_the_field(fields, match):
    with pytest.raises((ValueError, TypeError), match=match):
        RemoteReward(["http://127.0.0.1:1/get_reward"], **fields)


def test_bad_urls_and_a_missing_label_column_are_named():
    with pytest.raises(ValueError, match=r"urls=\['127.0.0.1:8100'\]: give one or more http"):
        RemoteReward(["127.0.0.1:8100"])
    reward = RemoteReward("http://127.0.0.1:1/get_reward", label_column="answer")
    with pytest.raises(KeyError, match=r"label_column='answer' is not a column of this batch \(columns: \['id'\]\)"):
        reward(prompts=["p"], completions=["a"], id=[0])


def test_the_code_verifier_behind_the_reference_server_scores_as_it_does_locally():
    """`trl-scale reward-server --reward code`: the sandboxed verifier over HTTP; the tests travel as OpenRLHF's
    labels (a JSON column), the response is the query after its prompt."""
    from trl_scale.rewards import CodeExecutionReward, SandboxSettings

    server = RewardServerProcess("--reward", "code", "--wall-seconds", "3", "--cpu-seconds", "2", "--slots", "2")
    tests = [[{"call": "double(2)", "expected": 4}, {"call": "double(-1)", "expected": -2}]] * 3
    prompts = ["Write double(x).\n"] * 3
    completions = ["def double(x):\n    return 2 * x", "def double(x):\n    return 4", "while True: pass"]
    try:
        remote = RemoteReward([server.url], label_column="tests")(
            prompts=prompts, completions=completions, tests=tests
        )
    finally:
        server.kill()
    local = CodeExecutionReward(sandbox=SandboxSettings(wall_seconds=3, cpu_seconds=2, slots=2))
    assert remote == local(completions=completions, tests=tests) == [1.0, 0.5, 0.0]
    local.close()


def test_grpo_scored_by_the_sandboxed_verifier_on_a_reward_server_gets_the_counting_reward(tiny_llama, tmp_path):
    """The toy counting task with its answer run as a program (`trl_scale.toy.code_task`), scored by the sandboxed
    verifier behind `trl-scale reward-server`: every step's reward is the counting reward computed in the trainer
    (which `tests/test_examples.py` shows the toy model learns; the end-to-end learning run is
    `test_the_sandboxed_reward_example_learns`, outside CI)."""
    import trl_scale
    from trl_scale.toy import counting_code_prompts, counting_reward

    server = RewardServerProcess("--reward", "code", "--extract", "trl_scale.toy:number_words_as_code")
    try:
        args = trl_scale.GRPOConfig(
            **cpu_args(tmp_path, max_steps=3, num_generations=4, max_completion_length=4), reward_weights=[1.0, 0.0]
        )
        remote = RemoteReward([server.url], label_column="tests")
        trainer = trl_scale.GRPOTrainer(
            model=tiny_llama,
            reward_funcs=[remote, counting_reward],
            args=args,
            train_dataset=counting_code_prompts(32),
        )
        trainer.train()
        assert server.requests_served() == 3 * 2  # a request per prompt group
    finally:
        server.kill()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    for entry in logs:
        assert entry["rewards/remote_reward/mean"] == pytest.approx(entry["rewards/counting_reward/mean"], abs=1e-6)


@pytest.mark.learning  # 200 steps of 64 sandboxed runs each: minutes on 2 cores
def test_the_sandboxed_reward_example_learns(tmp_path):
    import re
    import subprocess
    import sys

    from .helpers import ROOT, subprocess_env

    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grpo_sandboxed_reward.py"), "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    before, after = map(
        float, re.search(r"counting reward: ([\d.]+) before GRPO, ([\d.]+) after", result.stdout).groups()
    )
    assert after >= before + 0.1, (before, after)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--host", "0.0.0.0"],
            "refusing to serve on '0.0.0.0' without a bearer token: anyone who can reach it could",
        ),
        (
            ["--reward", "tests.reward_servers:nothing"],
            "--reward 'tests.reward_servers:nothing': tests.reward_servers has",
        ),
        (["--reward", "no_such_module_xyz:f"], "No module named 'no_such_module_xyz'"),
        (
            ["--reward", FUNCTION, "--extract", "trl_scale.toy:number_words_as_code"],
            "--extract .* is read by --reward code",
        ),
        (["--wall-seconds", "0"], "wall_seconds=0.0: use a positive number"),
        (["--isolation", "none"], "invalid choice: 'none'"),
    ],
)
def test_the_reward_server_refuses_bad_options_before_serving(argv, message, capsys):
    from trl_scale.cli import main

    try:
        code = main(["reward-server", "--port", str(free_port()), *argv])
    except SystemExit as exit:  # argparse's own refusals
        code = exit.code
    assert code == 2
    assert re.search(message, capsys.readouterr().err), message


class TextsAndScores:
    """Another JSON shape (`adapter=`): `{"texts": [...]}` answered by `{"scores": [...]}`."""

    def request(self, queries: list[str], prompts: list[str], labels: list) -> dict:
        return {"texts": [q[len(p) :] for q, p in zip(queries, prompts)]}

    def rewards(self, answer: dict, count: int):
        scores = answer["scores"]
        if len(scores) != count:
            raise ValueError(f"'scores' holds {len(scores)} values for {count} rows")
        return [float(s) for s in scores], {}


def test_an_adapter_speaks_another_json_shape():
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            data = json.dumps({"scores": [len(text) for text in body["texts"]]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        prompts, completions = groups(count=3, size=2)
        got = RemoteReward([url], adapter=TextsAndScores())(prompts=prompts, completions=completions)
        assert got == local_scores(prompts, completions)  # the response's length, as the other shape computes it
    finally:
        server.shutdown()
        server.server_close()


def test_a_scoring_function_answering_non_numbers_is_a_500_naming_it():
    server = RewardServerProcess("--reward", "tests.reward_servers:not_numbers")
    try:
        reward = RemoteReward([server.url], retries=1, retry_after=0.2)
        with pytest.raises(RewardServiceError, match=r"HTTP 500: .*ValueError: could not convert string to float"):
            reward(prompts=["p"], completions=["a"])
    finally:
        server.kill()


def test_a_429_is_failed_over_and_retries_zero_sends_once(answering, two_servers):
    busy = answering({"error": "slow down"}, status=429)
    reward = RemoteReward([busy, two_servers[0].url], routing="least_outstanding", retry_after=30.0)
    prompts, completions = groups(count=2, size=2)
    assert reward(prompts=prompts, completions=completions) == local_scores(prompts, completions)
    assert answering.hits[busy] >= 1 and reward.servers[0].last_error == "HTTP 429"
    failing = answering({"error": "boom"}, status=503)
    with pytest.raises(RewardServiceError, match="after 0 retries"):
        RemoteReward([failing], retries=0)(prompts=["p"], completions=["a"])
    assert answering.hits[failing] == 1  # one send, none again


@pytest.mark.parametrize("answer", [[True, 1.0], [1.0, False]])
def test_true_and_false_are_not_rewards(answering, answer):
    url = answering({"rewards": answer})
    with pytest.raises(RewardServiceError, match=r"rewards\[\d\] is (True|False), not a number"):
        RemoteReward([url])(prompts=["p", "p"], completions=["a", "b"])


def test_a_nan_answer_means_does_not_apply_and_says_so_once(answering, caplog):
    url = answering({"rewards": [float("nan"), 1.0]})
    reward = RemoteReward([url])
    with caplog.at_level("WARNING", logger="trl_scale"):
        for _ in range(2):
            got = reward(prompts=["p", "p"], completions=["a", "b"])
            assert got[1] == 1.0 and got[0] != got[0]  # NaN: TRL's "does not apply"
    warnings = [r for r in caplog.records if "answered NaN for 1 of 2 rows" in r.getMessage()]
    assert len(warnings) == 1


def test_a_token_over_plain_http_off_this_machine_is_warned(caplog):
    with caplog.at_level("WARNING", logger="trl_scale"):
        RemoteReward(["http://127.0.0.1:1/get_reward", "https://10.1.2.3/get_reward"], api_key="k")
        assert not caplog.records
        RemoteReward(["http://10.1.2.3:8100/get_reward"], api_key="k")
    assert "api_key in clear over plain HTTP to http://10.1.2.3:8100/get_reward" in caplog.text


def test_https_to_a_plain_server_says_so(two_servers):
    url = two_servers[0].url.replace("http://", "https://")
    with pytest.raises(RewardServiceError, match=r"SSLError: .*an https:// URL to a plain-HTTP server: use http://"):
        RemoteReward([url], retries=0)(prompts=["p"], completions=["a"])


def test_tests_not_sent_as_labels_are_refused_not_failed_over():
    """`--reward code` got empty labels (`label_column` not set): a 400 naming the fix, not a 500 the client retried
    on every server as if they were broken."""
    server = RewardServerProcess("--reward", "code", "--slots", "1")
    try:
        with pytest.raises(RewardServiceError, match=r"refused the request \(400\): .*label_column='tests'"):
            RemoteReward([server.url])(prompts=["p"], completions=["a"])
        with pytest.raises(RewardServiceError, match=r"refused the request \(400\): .*row 0: column 'labels' is not"):
            RemoteReward([server.url], label_column="tests")(prompts=["p"], completions=["a"], tests=["[{"])
    finally:
        server.kill()


def _certificate(tmp_path):
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_a_tls_reward_server_serves_https(tmp_path, monkeypatch):
    cert, key = _certificate(tmp_path)
    server = RewardServerProcess("--reward", FUNCTION, "--tls-cert", str(cert), "--tls-key", str(key), tls=True)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
    try:
        assert RemoteReward([server.url])(prompts=["p"], completions=["abc"]) == [3.0]
        # http:// to it: the server closes the connection unanswered; the error says what to use
        plain = server.url.replace("https://", "http://")
        with pytest.raises(RewardServiceError, match=r"if it serves HTTPS \(--tls-cert\), use https://"):
            RemoteReward([plain], retries=0)(prompts=["p"], completions=["abc"])
    finally:
        server.kill()


def test_a_tls_reward_server_answers_others_while_a_client_holds_a_connection_idle(tmp_path, monkeypatch):
    """One client connects and sends nothing (no TLS handshake): another is scored meanwhile, and the idle one is
    still connected (its handshake runs in its own thread, bounded; it ran inside accept() and stalled everyone)."""
    import socket
    from urllib.parse import urlparse

    from trl_scale.rewards.server import HANDSHAKE_TIMEOUT

    cert, key = _certificate(tmp_path)
    server = RewardServerProcess("--reward", FUNCTION, "--tls-cert", str(cert), "--tls-key", str(key), tls=True)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
    address = urlparse(server.url)
    try:
        with socket.create_connection((address.hostname, address.port)) as idle:
            scored = RemoteReward([server.url], timeout=HANDSHAKE_TIMEOUT / 2, retries=0)
            assert scored(prompts=["p"], completions=["abcd"]) == [4.0]
            idle.setblocking(False)
            with pytest.raises(BlockingIOError):  # nothing to read, and not closed (a closed one reads b"")
                idle.recv(1)
    finally:
        server.kill()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "70000"], "argument --port: 70000 is not a TCP port"),
        (["--route", "get_reward"], "argument --route: 'get_reward' is not a path: routes start with '/'"),
        (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-key", "k.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-cert", "nope.pem", "--tls-key", "nope.key"], "--tls-cert nope.pem: no such file"),
    ],
)
def test_the_reward_servers_port_route_and_tls_options_are_checked(argv, message, capsys):
    from trl_scale.cli import main

    try:
        code = main(["reward-server", *argv])
    except SystemExit as exit:
        code = exit.code
    assert code == 2 and message in capsys.readouterr().err


def test_a_reward_module_in_the_current_directory_is_found(tmp_path, monkeypatch):
    from trl_scale.rewards.server import load_function

    (tmp_path / "my_local_reward.py").write_text(
        "def score(queries, prompts, labels):\n    return [1.0] * len(queries)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    assert load_function("my_local_reward:score", "--reward")(["q"], ["p"], [""]) == [1.0]
