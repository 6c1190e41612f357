"""The chaos run: streaming GRPO over a fleet of `trl-scale serve` servers while faults are injected from a seeded
schedule, with the invariants checked and the figures printed as one JSON line.

The harness owns the fleet (trl-scale's `ServerFleet`, which restarts a server that exits at its address, with
backoff) and puts a `FaultProxy` (chaos_faults.py) in front of each server; the trainer, a subprocess of this script
(`trainer` role), is given the proxies' URLs as `vllm_server_base_urls`. So the trainer can be killed with `kill -9`
and resumed from its last checkpoint against the same servers, which hold the killed run's newer weights by then.
Faults, each injected once the trainer has finished the scheduled step: a server killed (`kill -9` of its process
group; the fleet restarts it, on its original weights), stopped (`SIGSTOP` for longer than the request timeout, then
`SIGCONT`), answering 500 for a while, or slow for a while; and once the trainer killed and resumed.

Invariants: every prompt group trained once, as one group (none lost, none twice but for the steps the kill lost
after the checkpoint, which are trained again); no trained token more than `async_rollout_staleness` syncs old; the
resumed trainer sends nothing before its first sync and that sync pushes the checkpoint's weights (not the killed
run's newer ones the servers held); no process left at the end.
Figures: faults by kind, survived (training went on and the server answered again), steps lost, recovery (the fault
to the server's first answer to a request asked after it was lifted; the trainer: kill to the resumed run's first
step), and the step-time cost against the same run without faults on the same fleet.

Usage: python benchmarks/chaos.py [--short] [--seed 0] [--servers 6] [--steps 300] [--faults 12] [--out DIR]
[--no-baseline]. The last line printed is one JSON object; the exit code is 1 when an invariant fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from chaos_faults import SERVER_FAULTS, Fault, FaultProxy, schedule  # noqa: E402

MARK = "TRL_SCALE_CHAOS_MARK"  # in the environment of every process the run starts: none may be left at the end
GROUP = 4  # completions per prompt
STALENESS = 2


# ---- the trainer (a subprocess) ----------------------------------------------------------------------------------


def fingerprint(model) -> float:
    """A number that changes with any weight: which weights a sync pushed."""
    total = 0.0
    for index, (_, parameter) in enumerate(sorted(model.named_parameters(), key=lambda item: item[0])):
        values = parameter.detach().double()
        total += float(values.sum()) * (index + 1) + float((values * values).sum())
    return total


def run_trainer(options) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    import trl_scale
    from trl_scale.toy import TOY_WORDS

    events = open(options.events, "a", buffering=1)

    def emit(kind: str, **record) -> None:
        events.write(json.dumps({"kind": kind, "pid": os.getpid(), "t": time.time(), **record}) + "\n")

    rows = [{"prompt": f"{TOY_WORDS[i % 40]} {TOY_WORDS[(i // 40) % 40]} {TOY_WORDS[7]}", "id": i} for i in range(600)]

    class Recorded:
        __name__ = "recorded_reward"
        trainer = None

        def __call__(self, completion_ids, id, **kwargs):
            generation = self.trainer.vllm_generation
            step, spans = self.trainer.state.global_step + 1, list(generation.steps.newest_record().version_spans)
            emit("trained", step=step, ids=list(id), spans=spans, sync=generation.sync_count)
            return [sum(t % 2 for t in ids) / max(1, len(ids)) for ids in completion_ids]

    reward = Recorded()
    config = trl_scale.GRPOConfig(
        output_dir=options.output_dir,
        per_device_train_batch_size=2 * GROUP,
        num_generations=GROUP,
        max_completion_length=8,
        learning_rate=1e-3,
        logging_steps=1,
        max_steps=options.steps,
        save_strategy="steps",
        save_steps=options.save_steps,
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
        shuffle_dataset=False,  # ids are read in order: what was skipped can be named
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_urls=options.urls.split(","),
        weight_sync="shared_dir",
        async_rollout_staleness=STALENESS,
        async_rollout_mode="streaming",
        rollout_request_timeout=60,
        rollout_generation_timeout=options.request_timeout,
        weight_sync_timeout=options.request_timeout,
    )
    trainer = trl_scale.GRPOTrainer(
        model=options.model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(options.model),
    )
    reward.trainer = trainer
    generation = trainer.vllm_generation
    sync, send = generation.sync_weights, generation.ahead.streamer.send

    def recorded_sync():
        emit("sync", index=generation.sync_count + 1, fingerprint=fingerprint(trainer.model))
        sync()

    def recorded_send(prompt_ids, n, dispatched):
        emit("sent", version=generation.sync_count)
        return send(prompt_ids, n, dispatched)

    generation.sync_weights, generation.ahead.streamer.send = recorded_sync, recorded_send

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            emit("step", step=state.global_step)

    trainer.add_callback(Steps())
    emit("start", resume=options.resume)
    trainer.train(resume_from_checkpoint=options.resume)
    streamer = generation.ahead.streamer
    left = [row["id"] for g in [*streamer.out, *streamer.pending] for row in g.rows]
    emit("end", left=left)
    trainer.close_rollout()


# ---- the harness -------------------------------------------------------------------------------------------------


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


class Phase:
    """One training run (the trainer, and its resume after a kill) with its faults injected on schedule."""

    def __init__(self, name: str, out: Path, model: str, proxies, fleet, options, faults: list[Fault]):
        self.name, self.out, self.model, self.proxies, self.fleet = name, out, model, proxies, fleet
        self.options, self.faults = options, faults
        self.events = out / "events.jsonl"
        self.resumed_from: int | None = None  # the checkpoint step the trainer resumed from
        self.probes: list[threading.Thread] = []  # one per server fault: until its server answers again
        self.killed_at: int | None = None  # the last step the killed trainer finished

    def _trainer(self, resume: str | None) -> subprocess.Popen:
        command = [sys.executable, os.path.abspath(__file__), "trainer", "--model", self.model]
        command += ["--urls", ",".join(p.url for p in self.proxies), "--output-dir", str(self.out / "run")]
        command += ["--events", str(self.events), "--steps", str(self.options.steps)]
        command += ["--save-steps", str(self.options.save_steps), "--request-timeout", str(self.options.timeout)]
        if resume:
            command += ["--resume", resume]
        env = dict(os.environ, OMP_NUM_THREADS="1", **{MARK: self.options.marker})
        log = open(self.out / "trainer.log", "ab")
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def run(self) -> float:
        """Train to the last step, injecting the faults; the wall-clock seconds it took."""
        self.out.mkdir(parents=True, exist_ok=True)
        began = time.time()
        trainer, pending = self._trainer(None), list(self.faults)
        deadline = time.monotonic() + self.options.phase_timeout
        while True:
            events = read_events(self.events)
            done = max((e["step"] for e in events if e["kind"] == "step" and e["pid"] == trainer.pid), default=0)
            while pending and pending[0].step <= done:
                if pending[0].kind == "trainer_kill":
                    if self._servers_out() or done % self.options.save_steps == 0:
                        break  # a server's return to the rotation is its own; a checkpoint is not half-written
                    trainer = self._kill_and_resume(trainer, pending.pop(0), done)
                    break  # the next faults wait for the resumed trainer's own steps
                else:
                    self._inject(pending.pop(0))
            code = trainer.poll()
            if code is not None:
                if code != 0:
                    tail = (self.out / "trainer.log").read_text(errors="replace")[-4000:]
                    raise RuntimeError(f"{self.name}: the trainer exited with {code}:\n{tail}")
                return time.time() - began
            if time.monotonic() > deadline:
                trainer.kill()
                raise TimeoutError(f"{self.name}: not done within {self.options.phase_timeout} s (step {done})")
            time.sleep(0.2)

    def _servers_out(self, patience: float = 30.0) -> bool:
        """Whether a server fault is not yet back in the trainer's rotation (waited for up to `patience` seconds after
        it was lifted)."""
        now = time.time()
        return any(
            f.started is not None
            and f.ended + patience > now
            and self.proxies[f.server].first_answer_after(f.ended) is None
            for f in self.faults
            if f.kind in SERVER_FAULTS
        )

    def _kill_and_resume(self, trainer: subprocess.Popen, fault: Fault, done: int) -> subprocess.Popen:
        fault.started = time.time()
        trainer.kill()
        trainer.wait()
        self.killed_at = done
        checkpoints = sorted((self.out / "run").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        self.resumed_from = int(checkpoints[-1].name.split("-")[1])
        fault.ended = time.time()
        return self._trainer(str(checkpoints[-1]))

    def _inject(self, fault: Fault) -> None:
        fault.started = time.time()
        proxy = self.proxies[fault.server]
        probe = threading.Thread(target=lambda: setattr(fault, "recovered", proxy.probe(fault.ended)), daemon=True)
        if fault.kind == "kill":
            os.killpg(self.fleet.handles[fault.server].group, signal.SIGKILL)
            fault.ended = fault.started
        elif fault.kind == "stop":
            group = self.fleet.handles[fault.server].group
            os.killpg(group, signal.SIGSTOP)
            fault.ended = fault.started + fault.seconds
            threading.Timer(fault.seconds, os.killpg, args=(group, signal.SIGCONT)).start()
        elif fault.kind == "error":
            proxy.error_until = fault.ended = fault.started + fault.seconds
        elif fault.kind == "slow":
            proxy.slow_seconds = self.options.slow_seconds
            proxy.slow_until = fault.ended = fault.started + fault.seconds
        probe.start()
        self.probes.append(probe)


def step_seconds(events: list[dict]) -> list[float]:
    """Seconds between consecutive steps of one trainer process (the first step and a resume's gap left out)."""
    ends: dict[int, list[tuple[int, float]]] = {}
    for event in events:
        if event["kind"] == "step":
            ends.setdefault(event["pid"], []).append((event["step"], event["t"]))
    return [b[1] - a[1] for run in ends.values() for a, b in zip(run, run[1:]) if b[0] == a[0] + 1]


def check(phase: Phase, staleness: int) -> dict:
    """The invariants of one phase (see the module docstring), each True or a description of what broke."""
    events = read_events(phase.events)
    pids = list(dict.fromkeys(e["pid"] for e in events if e["kind"] == "start"))
    last = pids[-1]
    trained = [e for e in events if e["kind"] == "trained"]
    if phase.resumed_from is not None:  # the killed run's steps after its checkpoint were trained again
        trained = [e for e in trained if e["pid"] == last or e["step"] <= phase.resumed_from]
    counts = Counter(i for e in trained for i in e["ids"])
    end = next(e for e in events if e["kind"] == "end" and e["pid"] == last)
    left = set(end["left"])
    top = max(counts, default=-1)
    missing = sorted(set(range(top + 1)) - set(counts) - left)
    results = {
        "each_group_trained_once": set(counts.values()) == {GROUP} or f"counts {sorted(set(counts.values()))}",
        "none_lost": not missing or f"ids never trained: {missing[:20]}",
        "left_not_trained": not (left & set(counts)) or f"out at the end and trained: {sorted(left & set(counts))}",
        "steps_trained": len({e["step"] for e in trained}) == phase.options.steps or "steps missing",
    }
    ages = [e["sync"] - first for e in trained for first, _ in e["spans"]]
    results["no_token_older_than_k"] = (0 <= min(ages) and max(ages) <= staleness) or f"ages {min(ages)}..{max(ages)}"
    if phase.resumed_from is not None:
        resumed = [e for e in events if e["pid"] == last]
        first_sync = next(e for e in resumed if e["kind"] == "sync")
        sent = [e["version"] for e in resumed if e["kind"] == "sent"]
        killed_syncs = [e for e in events if e["kind"] == "sync" and e["pid"] == pids[-2]]
        expected = checkpoint_fingerprint(phase.out / "run" / f"checkpoint-{phase.resumed_from}")
        same = abs(first_sync["fingerprint"] - expected) <= 1e-9 * max(1.0, abs(expected))
        differs = abs(killed_syncs[-1]["fingerprint"] - expected) > 1e-9 * max(1.0, abs(expected))
        results["resume_syncs_checkpoint_weights_first"] = (same and differs) or (
            f"first sync {first_sync['fingerprint']}, checkpoint {expected}, killed run's last "
            f"{killed_syncs[-1]['fingerprint']}"
        )
        results["resume_sends_after_its_first_sync"] = min(sent) >= 1 or f"sent at sync {min(sent)}"
    return results


def checkpoint_fingerprint(path: Path) -> float:
    from transformers import AutoModelForCausalLM

    return fingerprint(AutoModelForCausalLM.from_pretrained(path))


def recoveries(phase: Phase) -> None:
    """Each server fault's recovery (its probe's answer, waited for here) and its return to the trainer's rotation
    (the first of the trainer's requests it answered that was asked after the fault was lifted); the trainer's kill:
    the resumed run's first step."""
    events = read_events(phase.events)
    for probe in phase.probes:
        probe.join()
    for fault in phase.faults:
        if fault.started is None:
            continue
        if fault.kind == "trainer_kill":
            starts = [e["t"] for e in events if e["kind"] == "step" and e["t"] > fault.ended]
            fault.recovered = min(starts, default=None)
        else:
            fault.in_rotation = phase.proxies[fault.server].first_answer_after(fault.ended)


def seconds_after(faults: list[Fault], moment: str) -> dict:
    """Mean and worst seconds from each fault's start to `moment` ("recovered" / "in_rotation"), and per kind."""
    took = [getattr(f, moment) - f.started for f in faults if getattr(f, moment) is not None]
    row = {"mean": round(statistics.mean(took), 2) if took else None, "worst": round(max(took), 2) if took else None}
    row["count"] = len(took)
    for kind in SERVER_FAULTS:
        row[kind] = [
            round(getattr(f, moment) - f.started, 2) if getattr(f, moment) else None for f in faults if f.kind == kind
        ]
    return row


def report(options, phases: dict[str, Phase], walls: dict[str, float], fleet, left: list[str]) -> dict:
    chaos = phases["chaos"]
    injected = [f for f in chaos.faults if f.started is not None]
    server = [f for f in injected if f.kind in SERVER_FAULTS]
    trainer = next((f for f in injected if f.kind == "trainer_kill"), None)
    step = {name: statistics.mean(step_seconds(read_events(p.events))) for name, p in phases.items()}
    invariants = {name: check(p, STALENESS) for name, p in phases.items()}
    invariants["chaos"]["no_process_left"] = not left or f"left: {left}"
    row = {
        "benchmark": "chaos",
        "servers": options.servers,
        "steps": options.steps,
        "seed": options.seed,
        "staleness": STALENESS,
        "faults_injected": dict(Counter(f.kind for f in injected)),
        "faults_survived": sum(f.recovered is not None for f in injected),
        "faults_total": len(injected),
        "steps_lost": (chaos.killed_at or 0) - (chaos.resumed_from or 0),
        "recovery_s": seconds_after(server, "recovered"),
        "back_in_rotation_s": seconds_after(server, "in_rotation"),
        "trainer_resume_s": round(trainer.recovered - trainer.started, 2) if trainer and trainer.recovered else None,
        "server_deaths": fleet.deaths,
        "server_restarts": fleet.restarts,
        "step_s": {name: round(seconds, 3) for name, seconds in step.items()},
        "wall_s": {name: round(seconds, 1) for name, seconds in walls.items()},
        "invariants_held": all(v is True for checks in invariants.values() for v in checks.values()),
        "invariants": invariants,
        "faults": [f.record() for f in injected],
    }
    if "baseline" in step:
        row["step_time_cost"] = round(step["chaos"] / step["baseline"] - 1, 3)
        row["wall_time_cost"] = round(walls["chaos"] / walls["baseline"] - 1, 3)
    return row


def chaos_run(options) -> dict:
    """Start the fleet and its proxies, run the phases, stop everything; the report (see `report`)."""
    sys.path.insert(0, ROOT)
    from tests.processes import wait_gone
    from trl_scale.fleet import FleetSpec, ServeLauncher, ServerFleet
    from trl_scale.toy import build_tiny_model

    out = Path(options.out or tempfile.mkdtemp(prefix="trl-scale-chaos-"))
    options.marker = f"chaos-{os.getpid()}-{time.time_ns()}"
    model = build_tiny_model(out / "model", family="llama")
    server_args = ["--step-delay", str(options.step_delay)]
    spec = FleetSpec(options.servers, model, server_args, {MARK: options.marker}, max_restarts=50, ready_timeout=300)
    fleet = ServerFleet(spec, ServeLauncher(spec))
    faults = schedule(
        options.seed, options.steps, options.servers, options.faults, options.save_steps,
        stop_seconds=options.timeout + 3, spell_seconds=options.spell,
    )  # fmt: skip
    phases, walls = {}, {}
    fleet.start()
    proxies = [FaultProxy(url) for url in fleet.urls]
    try:
        for name, injected in ([] if options.no_baseline else [("baseline", [])]) + [("chaos", faults)]:
            phases[name] = Phase(name, out / name, model, proxies, fleet, options, injected)
            walls[name] = phases[name].run()
        recoveries(phases["chaos"])  # its probes waited for while the servers run
        settle = time.monotonic() + 30  # a server answering a probe may not be counted restarted yet (1 s polls)
        while fleet.restarts + len(fleet.failed) < fleet.deaths and time.monotonic() < settle:
            time.sleep(0.2)
    finally:
        fleet.close()
        for proxy in proxies:
            proxy.close()
    left = wait_gone(options.marker, 60)
    return report(options, phases, walls, fleet, left)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", nargs="?", default="harness", choices=["harness", "trainer"])
    parser.add_argument(
        "--short", action="store_true", help="the CI version: 3 servers, 100 steps, 5 faults, shorter spells"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--servers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--faults", type=int, default=12)
    parser.add_argument("--save-steps", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=4.0, help="request (generation) and weight-sync timeout")
    parser.add_argument("--spell", type=float, default=6.0, help="seconds a server answers 500, or slowly")
    parser.add_argument("--slow-seconds", type=float, default=2.0, help="added to each completion while slow")
    parser.add_argument("--step-delay", type=float, default=0.05, help="the servers' --step-delay")
    parser.add_argument("--phase-timeout", type=float, default=1800.0)
    parser.add_argument("--no-baseline", action="store_true", help="no fault-free run (no step-time cost)")
    parser.add_argument("--out", default=None)
    # the trainer role's
    parser.add_argument("--model")
    parser.add_argument("--urls")
    parser.add_argument("--output-dir")
    parser.add_argument("--events")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--request-timeout", type=float, default=4.0)
    options = parser.parse_args(argv)
    if options.short:
        options.servers, options.steps, options.faults, options.save_steps = 3, 100, 5, 20
        options.timeout, options.spell = 3.0, 4.0
    return options


def main(argv=None) -> int:
    options = parse(argv)
    if options.role == "trainer":
        run_trainer(options)
        return 0
    row = chaos_run(options)
    print(json.dumps(row))
    return 0 if row["invariants_held"] else 1


if __name__ == "__main__":
    sys.exit(main())
