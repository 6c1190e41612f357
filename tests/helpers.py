"""Shared test helpers: small configs and rewards that give non-zero gradients on a random tiny model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import requests
import torch

from .server_zygote import Zygote, forking_enabled

ROOT = Path(__file__).resolve().parents[1]


def end_distributed_worker() -> None:
    """End a multi-process test worker as `trl-scale` ends a multi-process run (`cli._end_distributed`): barrier,
    destroy the process group, then `os._exit`. FSDP2 still holds process groups whose native teardown at exit
    can abort a rank ("terminate called without an active exception", SIGABRT) after the work is done."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def token_parity_reward(completion_ids, **kwargs) -> list[float]:
    """Fraction of odd token ids: varies across samples of a random model, so advantages are not all zero."""
    return [sum(t % 2 for t in ids) / max(1, len(ids)) for ids in completion_ids]


def half_flat_reward(prompts, completion_ids, **kwargs) -> list[float]:
    """0.5 for every completion of about half the prompts (groups without a signal, for dynamic sampling), else
    `token_parity_reward`'s value."""
    varied = token_parity_reward(completion_ids)
    return [0.5 if len(str(prompt)) % 2 == 0 else value for prompt, value in zip(prompts, varied)]


def cpu_args(output_dir, **overrides) -> dict:
    """Common TrainingArguments for fast, deterministic fp32 CPU runs."""
    args = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        max_steps=3,
        report_to="none",
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    args.update(overrides)
    return args


def record_generations(trainer, read) -> list[tuple]:
    """Per generated batch, as `trainer` trains: the sync count it was trained at, and `read(vllm_generation)` right
    after TRL's generate call (e.g. its completions' versions)."""
    generation, seen = trainer.vllm_generation, []
    generate = generation.generate

    def recording(*args, **kwargs):
        result = generate(*args, **kwargs)
        seen.append((generation.sync_count, read(generation)))
        return result

    generation.generate = recording
    return seen


def slowed_unevenly(trainer, request_delay: float = 0.6, step_delay: float = 0.3) -> None:
    """The run's timing changed throughout: requests for every other prompt (by its ids' sum) wait `request_delay`
    before they go out, so groups finish out of the order they were sent, and every step ends `step_delay` later."""
    from transformers import TrainerCallback

    client = trainer.vllm_generation.client
    complete = client.complete

    def slow_for_some(prompt_ids, *args, **kwargs):
        time.sleep(request_delay if sum(prompt_ids) % 2 else 0.0)
        return complete(prompt_ids, *args, **kwargs)

    class SlowSteps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(step_delay)

    client.complete = slow_for_some
    trainer.add_callback(SlowSteps())


def step_logs(trainer, keys=("loss", "grad_norm")) -> list[dict]:
    return [{k: entry[k] for k in keys if k in entry} for entry in trainer.state.log_history if "loss" in entry]


def paired(expected: list, got: list):
    """``zip(expected, got)`` after checking both have the same, non-zero length (an empty log must not pass)."""
    assert len(expected) == len(got) > 0, (len(expected), len(got))
    return zip(expected, got)


def max_param_diff(model_a, model_b) -> float:
    params_b = dict(model_b.named_parameters())
    return max((p - params_b[n]).abs().max().item() for n, p in model_a.named_parameters())


def assert_logs_close(got: list[dict], expected: list[dict], atol: float) -> None:
    assert len(got) == len(expected) and len(got) > 0, (got, expected)
    for step, (g, e) in enumerate(zip(got, expected)):
        assert g.keys() == e.keys(), (step, g, e)
        for key in g:
            assert abs(g[key] - e[key]) <= atol, f"step {step} {key}: trl-scale {g[key]} vs TRL {e[key]}"


def padded_scoring_batch(tokenizer):
    """Left-padded prompts + right-padded completions (TRL's GRPO layout), a length-1 completion, and labels on
    completion tokens only: ``(input_ids, attention_mask, labels)``."""
    prompts = [[10, 11, 12], [13], [14, 15, 16, 17, 18], [19, 20]]
    completions = [[30, 31, 32, 33, 34, 35], [36], [37, 38, 39], [40, 41, 42, 43, 44, 45, 46, 47]]
    pad = tokenizer.pad_token_id
    p_len, c_len = max(map(len, prompts)), max(map(len, completions))
    rows, masks, labels = [], [], []
    for p, c in zip(prompts, completions):
        row = [pad] * (p_len - len(p)) + p + c + [pad] * (c_len - len(c))
        m = [0] * (p_len - len(p)) + [1] * (len(p) + len(c)) + [0] * (c_len - len(c))
        lab = [-100] * p_len + c + [-100] * (c_len - len(c))
        rows.append(row), masks.append(m), labels.append(lab)
    return torch.tensor(rows), torch.tensor(masks), torch.tensor(labels)


def seeded_tensor(*shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator)


def free_port() -> int:
    from trl_scale.net import free_port as port_free_on

    return port_free_on("127.0.0.1")


@contextmanager
def black_hole_server():
    """A TCP server on 127.0.0.1 that accepts connections and never answers (a hung server, not a dead one).
    Yields ``(url, accepted)``: ``accepted`` lists the connections it took."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    accepted = []
    stop = threading.Event()

    def accept_forever():
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        stop.set()
        thread.join(timeout=5)
        for connection in accepted:
            connection.close()
        listener.close()


def subprocess_env(**extra) -> dict:
    """The test environment for a child process: offline, one thread, the repository importable."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", **extra)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def accelerate_launch(num_processes: int = 2) -> list[str]:
    """`accelerate launch` with several CPU processes (gloo); `--cpu` would silently run one."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(num_processes),
    ]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return command + ["--main_process_port", str(free_port())]


class Server:
    """`trl-scale serve` as a real process on 127.0.0.1. The port comes from `free_port()`, which must release it
    before the child binds it; if another process takes it meanwhile, the server is restarted on a new port."""

    BIND_RETRIES = 3

    def __init__(self, model_path, *extra):
        self.command = [sys.executable, "-m", "trl_scale.cli", "serve", "--model", model_path, *extra]
        self._start()

    def _start(self, port=None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        command = [*self.command, "--port", str(self.port)]
        if forking_enabled():  # the same command, forked from a process that has imported it (tests/server_zygote.py)
            self.process = Zygote.shared().spawn(["trl-scale", *command[3:]], env)
        else:
            self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait_ready(self, timeout=90):
        deadline = time.monotonic() + timeout
        retries = self.BIND_RETRIES
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                error = self.process.stderr.read().decode()
                if "address already in use" in error.lower() and retries > 0:
                    retries -= 1
                    self._start()
                    continue
                raise RuntimeError(f"server exited: {error[-2000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except requests.RequestException:  # not listening yet, or busy loading on a loaded machine
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server {self.url} not ready in {timeout}s")

    def stop(self):
        self.process.kill()
        self.process.wait(timeout=10)

    def restart(self):
        """Kill it and start it again on the same port: a server that came back with its original weights."""
        self.stop()
        self._start(port=self.port)
        return self.wait_ready()


def start_servers(model_path, count, *extra_per_server):
    servers = [Server(model_path, *(extra_per_server[i] if i < len(extra_per_server) else ())) for i in range(count)]
    return [s.wait_ready() for s in servers]


def reload_checkpoint(urls, model_path) -> None:
    """Each server back on the checkpoint's weights: a module's shared servers hold what its earlier runs synced, and
    a LoRA run sends only its adapter, which lands on that base (the mismatch gate measures it, and stops the run)."""
    import requests

    body = {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
    for url in urls:
        requests.post(f"{url}/collective_rpc", json=body, timeout=120).raise_for_status()


def server_grpo(model_path, out, urls, **overrides):
    """A small GRPO run generating on `urls` (server rollout): 3 steps of 8 completions, 4 per prompt. Fields in
    `overrides` go to GRPOConfig, except `peft_config`, `eval_dataset` and `reward_funcs`, which go to the trainer."""
    from transformers import AutoTokenizer

    import trl_scale
    from trl_scale.toy import counting_prompts

    settings = dict(
        num_generations=4,
        max_completion_length=6,
        max_steps=3,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_urls=urls,
        weight_sync_timeout=60,
        rollout_request_timeout=60,
    )
    config = cpu_args(out, **{**settings, **overrides})
    peft_config = config.pop("peft_config", None)
    eval_dataset = config.pop("eval_dataset", None)
    return trl_scale.GRPOTrainer(
        model=model_path,
        reward_funcs=config.pop("reward_funcs", token_parity_reward),
        args=trl_scale.GRPOConfig(**config),
        train_dataset=counting_prompts(64),
        eval_dataset=eval_dataset,
        processing_class=AutoTokenizer.from_pretrained(model_path),
        peft_config=peft_config,
    )


def server_rloo_or_ppo(method, model_path, out, urls, **overrides):
    """RLOO (4 completions per prompt) or PPO generating on `urls`: 2 steps unless `overrides` say otherwise."""
    from transformers import AutoTokenizer

    import trl_scale
    from trl_scale.toy import counting_prompts

    trainer_cls, config_cls = {
        "rloo": (trl_scale.RLOOTrainer, trl_scale.RLOOConfig),
        "ppo": (trl_scale.PPOTrainer, trl_scale.PPOConfig),
    }[method]
    settings = dict(
        max_completion_length=6,
        max_steps=2,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_urls=urls,
        weight_sync_timeout=60,
    )
    if method == "rloo":
        settings["num_generations"] = 4
    return trainer_cls(
        model=model_path,
        reward_funcs=token_parity_reward,
        args=config_cls(**cpu_args(out, **{**settings, **overrides})),
        train_dataset=counting_prompts(64),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )


def sft_counting_model(directory) -> str:
    """The learning tests' starting point: a tiny Llama after a short supervised warm-up on counting text (seed 0),
    saved with its tokenizer under `directory/sft`; returns that path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_scale.toy import build_tiny_model
    from trl_scale.toy.demo import warm_up

    base = build_tiny_model(os.path.join(directory, "base"))
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(0)
    warm_up(model, tokenizer, steps=60)
    sft = os.path.join(directory, "sft")
    model.save_pretrained(sft)
    tokenizer.save_pretrained(sft)
    return sft


def launcher_failure(output: str, tail: int = 2500) -> str:
    """What a failed multi-process run says: every line naming an error (the rank that failed first is often not the
    one whose traceback ends the output), then the output's tail."""
    errors = [line for line in output.splitlines() if "Error" in line or "Exception" in line][:40]
    return "\n".join(["-- lines naming errors --", *errors, "-- tail --", output[-tail:]])


def accelerate_launch_with_config(config_file) -> list[str]:
    """`accelerate launch --config_file CONFIG` with 2 processes on a free port."""
    command = [*accelerate_launch(2)[:3], "--config_file", str(config_file), "--num_processes", "2"]
    return command + ["--main_process_port", str(free_port())]


def run_cli_in_process(command: list[str]) -> None:
    """`python -m trl_scale.cli ...` (`command` without the interpreter) run in this process: the single-process
    reference runs the launcher tests compare with. A process of its own would spend about 10 s of CPU importing
    torch, transformers and TRL, which this one has imported already."""
    from trl_scale.cli import main

    assert command[:2] == ["-m", "trl_scale.cli"], command
    assert main([str(part) for part in command[2:]]) == 0


def run_to_completion(command: list[str], timeout: int = 400) -> str:
    """Run a (launcher) command that must finish: a hang fails with its stderr's tail, a non-zero exit with every
    line naming an error. Returns the output."""
    import pytest

    try:
        result = subprocess.run(
            command, cwd=ROOT, env=subprocess_env(DS_BUILD_OPS="0"), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"hung for {error.timeout} s: {((error.stderr or b'')[-2000:])!r}")
    output = result.stdout + result.stderr
    assert result.returncode == 0, launcher_failure(output)
    return output


def deepspeed_launcher_config(stage: int, init_flag: str) -> str:
    """An accelerate config for DeepSpeed ZeRO-``stage`` on 2 CPU processes (gloo), no offload, fp32."""
    return f"""compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: {stage}
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: {init_flag}
  zero3_save_16bit_model: true
num_machines: 1
num_processes: 2
mixed_precision: 'no'
use_cpu: true
"""


def group_sync(client, timeout: float = 60):
    """A `GroupSync` over the servers' weight-transfer engine, read as the trainer's preflight reads it."""
    from trl_scale.rollout.preflight import inspect_all
    from trl_scale.rollout.weight_sync import GroupSync, SyncSettings

    reports = [
        r
        for r in inspect_all(client.transport.get_url, client.transport.post_url, [s.url for s in client.servers])
        if r.reachable
    ]
    backends = {r.weight_transfer for r in reports}
    assert reports and len(backends) == 1 and None not in backends, backends
    return GroupSync(client, SyncSettings(timeout=timeout, backend=backends.pop()))


def push(sync, state_dict: dict, version: str | None = None) -> str:
    """Send a whole state dict through a weight-sync mode; returns the version it got."""
    import uuid

    from trl_scale.rollout.weight_sync import PolicyWeights

    version = version or f"push-{uuid.uuid4().hex[:8]}"
    sync.sync(PolicyWeights.of_state_dict(state_dict), version)
    return version


def push_weights(urls: list[str], state_dict: dict, timeout: float = 60) -> str:
    """Send a whole state dict to servers over their weight-transfer engine (a fresh group, closed after)."""
    from trl_scale.rollout import RolloutClient

    client = RolloutClient(urls, request_timeout=60)
    sync = group_sync(client, timeout)
    try:
        return push(sync, state_dict)
    finally:
        sync.close()
        client.close()


HITS: dict[int, list[str]] = {}  # plain_http_server's requests, by port: the paths asked for, in order


def hits(url: str) -> list[str]:
    return HITS[int(url.rsplit(":", 1)[1])]


@contextmanager
def plain_http_server(status: int = 404, body: bytes = b'{"detail":"Not Found"}', routes: dict | None = None):
    """A plain-HTTP server on 127.0.0.1 answering every GET and POST with `status` (not a vLLM server: another
    service, or a path it does not have), except the paths in `routes` (path -> (status, body)). Yields its URL;
    `.hits` on the yielded string's server counts requests per path (see `hits`)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    routes = routes or {}

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            code, payload = routes.get(self.path, (status, body))
            HITS[self.server.server_address[1]].append(self.path)
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    HITS[server.server_address[1]] = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def banner_server(banner: bytes = b"SSH-2.0-OpenSSH_9.2\r\n"):
    """A TCP server on 127.0.0.1 that speaks another protocol: it sends `banner` to each connection and closes it.
    Yields its URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                connection = listener.accept()[0]
            except OSError:
                continue
            with connection:
                connection.sendall(banner)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def flat_on_rank_1_reward(completion_ids, **kwargs) -> list[float]:
    """0.5 for every completion scored by the process of rank 1 (its groups never have a signal), else
    `token_parity_reward`'s value: two data-parallel processes missing different numbers of groups."""
    if os.environ.get("RANK") == "1":
        return [0.5] * len(completion_ids)
    return token_parity_reward(completion_ids)


def rloo_correction_view(backend, clip_min, clip_max, mode: str, **attributes):
    """The attributes RLOO's `importance_weights` reads, around a generation `backend` (with its `records`): to
    call the trainer's own method without a trainer (one process, training)."""
    from collections import defaultdict
    from types import SimpleNamespace

    return SimpleNamespace(
        vllm_generation=backend,
        args=SimpleNamespace(
            vllm_importance_sampling_clip_min=clip_min,
            vllm_importance_sampling_clip_max=clip_max,
            vllm_importance_sampling_mode=mode,
        ),
        _metrics={"train": defaultdict(list)},
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(gather=lambda t: t),
        **attributes,
    )


def saved_state(checkpoint, feature: str, rank: int = 0) -> dict | None:
    """A feature's state as a checkpoint saved it (`trainers/feature_state.py`: one file per data-parallel rank,
    keyed by feature name); None where that rank saved none for it."""
    from trl_scale.trainers.feature_state import state_path

    path = state_path(str(checkpoint), rank)
    if not os.path.isfile(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=False)["features"].get(feature)
