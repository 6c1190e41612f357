"""Ulysses sequence parallelism in the packed scoring engine (DeepSpeed's ALST), on 2 CPU processes (gloo): the
same batch scored sharded over the 2 ranks equals one process's TRL padded forward — per-token log-probs and
entropies, the loss, and the gradients after data-parallel averaging — for batches with unequal lengths, several
sequences per packed row, a sequence longer than half the token budget and an odd total length, per model family;
each mutation the issue names goes red; and the refusals name their fix."""

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoConfig

from trl_scale.scoring.sequence_parallel import check_sequence_parallel, core_attention_for
from trl_scale.toy import build_tiny_model, tiny_config

from .helpers import ROOT, cpu_args, free_port, saved_state, subprocess_env

TOLERANCE = 1e-5


FAMILY_CASES = [("llama", None), ("llama", 30), ("qwen2", 30), ("qwen3", None), ("mistral", 30), ("gemma2", 30)]
MUTATIONS = ["shift", "twice", "rank0"]
SHAPES = ["other-lengths", "same-shape"]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp-models")
    return {
        family: build_tiny_model(root / family, family=family)
        for family in ("llama", "qwen2", "qwen3", "mistral", "gemma2")
    }


@pytest.fixture(scope="module")
def scoring_results(family_models, tmp_path_factory) -> dict[str, list[dict]]:
    """Every case of the 2-rank scoring worker, run in one launch (a launch costs more than a case): each case's
    name to its two ranks' results. The tests below read their own case."""
    cases = {
        f"{family}-{budget}": {"model": family_models[family], "token_budget": budget}
        for family, budget in FAMILY_CASES
    }
    for mutation in MUTATIONS:  # lengths putting the slice boundary inside a scored sequence
        cases[f"mutation-{mutation}"] = {
            "model": family_models["llama"],
            "lengths": "9,23,12,15",
            "mutation": mutation,
        }
    for shape in SHAPES:
        cases[f"refused-{shape}"] = {
            "model": family_models["llama"],
            "own_batches": True,
            "same_shape": shape == "same-shape",
        }
    out = tmp_path_factory.mktemp("sp-scoring")
    (out / "cases.json").write_text(json.dumps(cases))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port()), "-m", "tests.sequence_parallel_worker"]
    command += ["--cases", str(out / "cases.json"), "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return {name: [json.loads((out / f"{name}.{rank}").read_text()) for rank in (0, 1)] for name in cases}


@pytest.mark.slow
@pytest.mark.parametrize("family, token_budget", FAMILY_CASES)
def test_two_ranks_score_like_one_process(scoring_results, family, token_budget):
    """Lengths 9, 23, 12, 5 (49 tokens: odd); without a budget one packed row of 4 sequences, with 30 a row of the
    23-token sequence alone (over half the budget) and a row of 3. Mistral: sliding window 8; Gemma 2: sliding
    window and attention soft-capping. Both ranks hold the batch (an SP group is one data-parallel rank): each
    returns the whole batch's values, and the gradients averaged over the 2 ranks are one process's."""
    for result in scoring_results[f"{family}-{token_budget}"]:
        assert result["group"] == 2 and result["same_grad_names"] and result["scored_tokens"] == 37
        for key in ("log_probs", "entropy", "loss", "grads"):
            assert result[key] <= TOLERANCE, (family, token_budget, key, result)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_ranks_of_a_group_holding_different_batches_are_refused(scoring_results, shape):
    """Slices of two different batches are not parts of one row: scoring them would silently mix both. Refused by
    the check itself (its message, on both ranks), also for a batch of the same shape and other tokens, which no
    collective of the forward would trip over."""
    for result in scoring_results[f"refused-{shape}"]:
        assert result["refused"].startswith(
            "sequence parallelism: the ranks of a sequence-parallel group hold different batches"
        ), result


@pytest.mark.slow
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_each_mutation_breaks_the_parity(scoring_results, mutation):
    """Shard offsets shifted by one; a token at a slice boundary counted on both ranks; the gathered values taken
    from rank 0 only: each moves the log-probs, the loss and the gradients far past the tolerance. (Lengths putting
    the slice boundary inside a scored sequence.)"""
    results = scoring_results[f"mutation-{mutation}"]
    worst = {key: max(r[key] for r in results) for key in ("log_probs", "loss", "grads")}
    assert worst["log_probs"] > 1e-2 and worst["loss"] > 1e-4 and worst["grads"] > 1e-3, worst


@pytest.mark.parametrize(
    "overrides, world, sp, match",
    [
        ({}, 3, 2, "does not divide the 3 processes"),
        ({"num_heads": 4, "num_kv_heads": 2}, 3, 3, "does not divide this model's 4 attention heads"),
        ({"hidden_size": 48, "num_heads": 6, "num_kv_heads": 3}, 4, 2, "3 key/value heads"),
    ],
)
def test_refusals_name_the_fix(overrides, world, sp, match):
    with pytest.raises(ValueError, match=f"{match}.*Fix:"):
        check_sequence_parallel(tiny_config("llama", **overrides), sp, world)


@pytest.mark.parametrize("family", ["lfm2", "nemotron_h", "qwen3_next"])
def test_stateful_hybrids_are_refused(family):
    """Convolution, Mamba and linear-attention layers carry state along the sequence: a shard boundary cuts it."""
    with pytest.raises(ValueError, match="state runs along the sequence.*Fix: sp_size=1"):
        check_sequence_parallel(tiny_config(family), 2, 2)


def test_the_core_attention_per_kernel_and_an_unknown_kernel_is_refused():
    assert core_attention_for("flash_attention_2") == "flash_attention_2"  # its varlen path keeps packing exact
    assert {core_attention_for(k) for k in ("sdpa", "eager", "flex_attention")} == {"trl_scale_packed_sp"}
    with pytest.raises(ValueError, match="kernels-community/foo.*Fix: attn_implementation='sdpa'"):
        check_sequence_parallel(tiny_config("llama"), 2, 2, "kernels-community/foo")


def test_a_saved_config_is_checked_as_loaded(family_models):
    check_sequence_parallel(AutoConfig.from_pretrained(family_models["mistral"]), 2, 4, "sdpa")  # no refusal


@pytest.fixture
def four_processes(monkeypatch):
    """Configs built as in each process of a 4-process launch (sequence-parallel groups need several)."""
    from transformers import TrainingArguments

    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 4))
    monkeypatch.setattr("trl_scale.scoring.arguments.launched_processes", lambda: 4)  # the launcher's WORLD_SIZE


def test_parallelism_config_becomes_sequence_parallel_size_and_conflicts_are_refused(tmp_path, four_processes):
    """accelerate's parallelism_config.sp_size becomes sequence_parallel_size, which TRL's own checks (refusing it
    for GRPO and RLOO) and accelerate's own ALST never see; what contradicts it is refused naming the fix."""
    from accelerate.utils import ParallelismConfig

    import trl_scale

    sp2 = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    for config_class in (trl_scale.GRPOConfig, trl_scale.PPOConfig, trl_scale.DPOConfig):
        extra = {"num_generations": 4} if config_class is trl_scale.GRPOConfig else {}
        config = config_class(**cpu_args(tmp_path, **extra), parallelism_config=sp2)
        assert config.sequence_parallel_size == 2 and config.parallelism_config is None
    with pytest.raises(ValueError, match="padding_free=False.*Fix: padding_free=None"):
        trl_scale.DPOConfig(**cpu_args(tmp_path), sequence_parallel_size=2, padding_free=False)
    with pytest.raises(ValueError, match="disagree. Fix"):
        trl_scale.DPOConfig(**cpu_args(tmp_path), sequence_parallel_size=4, parallelism_config=sp2)


def test_the_accelerate_yaml_parallelism_section_is_read_and_kept_from_accelerate(
    tmp_path, monkeypatch, four_processes
):
    """`accelerate launch` exports the YAML's `parallelism_config` as variables, from which accelerate would build
    its own (and run its own ALST on prompt rows): trl-scale reads sp_size from them and switches that off."""
    import trl_scale

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    config = trl_scale.GRPOConfig(**cpu_args(tmp_path, num_generations=4))
    assert config.sequence_parallel_size == 2 and config.parallelism_config is None
    assert os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "false"


def test_the_generation_batch_counts_sequence_parallel_groups_as_data_parallel_ranks(tmp_path, four_processes):
    """4 processes with sp_size=2 are 2 data-parallel ranks: TRL's generation batch (per_device_train_batch_size x
    ranks x steps_per_generation) is sized over the groups, by each of TRL's three rules; a size that does not
    divide the processes, colocated vLLM (each rank's engine would sample its own) and a reference or critic on a
    Ray group (it would take each row sp_size times) are refused naming the fix."""
    import trl_scale

    def grpo(**fields):
        return trl_scale.GRPOConfig(**cpu_args(tmp_path, num_generations=4, **fields))

    plain = grpo(gradient_accumulation_steps=2)
    assert (plain.generation_batch_size, plain.steps_per_generation) == (8 * 4 * 2, 2)
    sharded = grpo(gradient_accumulation_steps=2, sequence_parallel_size=2)
    assert (sharded.generation_batch_size, sharded.steps_per_generation) == (8 * 2 * 2, 2)
    assert grpo(sequence_parallel_size=2, steps_per_generation=3).generation_batch_size == 8 * 2 * 3
    assert grpo(sequence_parallel_size=2, generation_batch_size=48).steps_per_generation == 3
    rloo = trl_scale.RLOOConfig(**cpu_args(tmp_path, num_generations=4), sequence_parallel_size=4)
    assert rloo.generation_batch_size == 8 and rloo.steps_per_generation == 1
    with pytest.raises(ValueError, match="must be divisible by the global batch size.*sequence-parallel groups"):
        grpo(sequence_parallel_size=2, generation_batch_size=40)
    with pytest.raises(ValueError, match="does not divide the 4 processes.*Fix"):
        grpo(sequence_parallel_size=3)
    server = dict(use_vllm=True, vllm_mode="server", vllm_server_base_urls=["http://127.0.0.1:1"])
    assert grpo(sequence_parallel_size=2, async_rollout_staleness=1, **server).async_rollout_mode == "streaming"
    with pytest.raises(ValueError, match="vllm_mode='colocate'.*Fix: vllm_mode='server'"):
        grpo(sequence_parallel_size=2, use_vllm=True, vllm_mode="colocate")
    placement = {"num_workers": 1, "num_cpus_per_worker": 0.5}
    with pytest.raises(ValueError, match="reference_placement.*sp_size times. Fix: keep those roles in the trainer"):
        grpo(sequence_parallel_size=2, backend="ray", reference_placement=placement)
    with pytest.raises(ValueError, match="critic_placement.*Fix"):
        trl_scale.PPOConfig(**cpu_args(tmp_path), sequence_parallel_size=2, backend="ray", critic_placement=placement)


def _command(method: str, model: str, output_dir, *extra: str) -> list[str]:
    command = ["-m", "trl_scale.cli", method, "--config", str(ROOT / "examples" / f"{method}_tiny_cpu.yaml")]
    command += ["--model_name_or_path", model, "--output_dir", str(output_dir), "--max_steps", "3"]
    command += ["--logging_steps", "1", "--disable_tqdm", "true", "--save_strategy", "steps", "--save_steps", "3"]
    if method == "dpo":
        command += ["--per_device_train_batch_size", "4"]
    elif method == "ppo":
        command += ["--per_device_train_batch_size", "4", "--max_completion_length", "6", "--learning_rate", "1e-2"]
        command += ["--reward_funcs", "tests.helpers.token_parity_reward", "--num_toy_examples", "64"]
    else:
        command += ["--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "8"]
        command += ["--reward_funcs", "tests.helpers.token_parity_reward", "--learning_rate", "1e-2", "--beta", "0.05"]
        if method == "rloo":  # gradient accumulation: a generation batch of 2 micro-batches
            command += ["--gradient_accumulation_steps", "2"]
    return command + ["--token_budget", "40", *extra]


def _logged(output_dir) -> list[dict]:
    state = json.loads((output_dir / "checkpoint-3" / "trainer_state.json").read_text())
    return [entry for entry in state["log_history"] if "loss" in entry]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """`logged(method, model)`: the steps one process logs for `_command(method, model)`, run once per module
    (several tests compare their launches with the same run)."""
    from .helpers import run_cli_in_process

    runs: dict[tuple, list[dict]] = {}

    def logged(method: str, model: str) -> list[dict]:
        if (method, model) not in runs:
            out = tmp_path_factory.mktemp(f"one-{method}")
            run_cli_in_process(_command(method, model, out))
            runs[method, model] = _logged(out)
        return runs[method, model]

    return logged


@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo", "rloo", "dpo", "ppo"])
def test_two_processes_with_sp_size_2_take_the_steps_of_one_process(family_models, one_process, tmp_path, method):
    """The issue's parity: 2 processes (gloo) with `--sequence_parallel_size 2` are one data-parallel rank, and take
    the steps of one process without it, on the same data. GRPO and RLOO with local generation (rank 0 of the
    group generates as the one process would; the other takes its completions) and the reference model's KL; DPO
    with its reference model (chosen and rejected scored together); PPO with its critic (values, value loss and
    gradients sharded too). Every scoring call is sharded over both ranks."""
    from .helpers import accelerate_launch, run_to_completion

    model, sharded = family_models["qwen2"], tmp_path / "sharded"
    output = run_to_completion(
        accelerate_launch(2) + _command(method, model, sharded, "--sequence_parallel_size", "2")
    )
    expected, got = one_process(method, model), _logged(sharded)
    assert len(expected) == len(got) == 3, output[-2000:]
    assert "training on 1 data-parallel rank(s) of 2 processes" in output
    keys = ("loss", "grad_norm", "reward", "reward_std", "kl", "entropy", "completions/mean_length")
    if method == "dpo":
        keys = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen")
    elif method == "ppo":  # the policy, the reference (KL) and the critic (values, its loss and gradients)
        keys = ("loss", "grad_norm", "critic/grad_norm", "loss/value", "val/vpred", "objective/kl", "objective/scores")
    for step, (e, g) in enumerate(zip(expected, got), start=1):
        for key in keys:
            assert g[key] == pytest.approx(e[key], rel=1e-5, abs=1e-6), (step, key, g[key], e[key])
    assert any(e["grad_norm"] > 0 for e in expected)


@pytest.mark.slow
def test_with_dynamic_sampling_sp_size_2_takes_the_steps_of_one_process(family_models, tmp_path):
    """GRPO with dynamic sampling: the top-up rounds (new prompts from the seeded per-rank order, generation, rewards)
    run as one data-parallel rank's, so 2 processes with sp_size=2 take one process's steps and drop as many groups."""
    from .helpers import accelerate_launch, run_cli_in_process, run_to_completion

    model = family_models["qwen2"]

    def command(out, *extra):
        base = _command("grpo", model, out, "--dynamic_sampling", "true", *extra)
        base[base.index("tests.helpers.token_parity_reward")] = "tests.helpers.half_flat_reward"
        return base

    one, sharded = tmp_path / "one", tmp_path / "sharded"
    run_cli_in_process(command(one))
    run_to_completion(accelerate_launch(2) + command(sharded, "--sequence_parallel_size", "2"))
    expected, got = _logged(one), _logged(sharded)
    assert len(expected) == len(got) == 3
    for step, (e, g) in enumerate(zip(expected, got), start=1):
        for key in ("loss", "grad_norm", "reward", "kl", "dynamic_sampling/groups_dropped"):
            assert g[key] == pytest.approx(e[key], rel=1e-5, abs=1e-6), (step, key, g[key], e[key])
    assert sum(e["dynamic_sampling/groups_dropped"] for e in expected) > 0


@pytest.mark.slow
def test_with_a_lora_adapter_sp_size_2_takes_the_steps_of_one_process(family_models, tmp_path):
    """GRPO with a LoRA adapter (PEFT): the reference is the policy with its adapter disabled, scored through the
    same sharded engine; 2 processes with sp_size=2 take the steps of one process."""
    from .helpers import accelerate_launch, run_cli_in_process, run_to_completion

    model = family_models["llama"]
    lora = ["--use_peft", "true", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0"]
    lora += ["--lora_target_modules", "q_proj", "v_proj"]  # no dropout: its masks depend on how tokens are split
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    run_cli_in_process(_command("grpo", model, one, *lora))
    run_to_completion(accelerate_launch(2) + _command("grpo", model, sharded, *lora, "--sequence_parallel_size", "2"))
    expected, got = _logged(one), _logged(sharded)
    assert len(expected) == len(got) == 3
    for step, (e, g) in enumerate(zip(expected, got), start=1):
        for key in ("loss", "grad_norm", "kl", "entropy", "reward"):
            assert g[key] == pytest.approx(e[key], rel=1e-5, abs=1e-6), (step, key, g[key], e[key])
    assert any(e["kl"] > 0 for e in expected)  # the adapter moved the policy from its reference


@pytest.mark.slow  # the first DeepSpeed run on a machine JIT-builds its CPU communication op (80-140 s)
@pytest.mark.parametrize(
    "method, stage",
    # ZeRO-2 is a launcher variant outside CI (bash scripts/test.sh -m launchers): the suite's time (25 min)
    [("grpo", 3), ("ppo", 3), pytest.param("grpo", 2, marks=pytest.mark.launchers)],
)
def test_under_deepspeed_two_processes_with_sp_size_2_take_the_steps_of_one_process(
    family_models, one_process, method, stage, tmp_path
):
    """`accelerate launch` with DeepSpeed ZeRO-3 (2 CPU processes): the policy's parameters partitioned over both
    ranks and gathered per module while each packed row is sharded over them (PPO: its critic in its own ZeRO-3
    engine), and ZeRO-2 (gradients and optimizer state partitioned); the steps equal one process's without either.
    sp_size comes from the accelerate YAML's parallelism_config section, as in
    examples/accelerate/deepspeed_zero3_sp2.yaml. (FSDP2: accelerate runs FSDP only on GPUs; on CPU its launcher
    falls back to no distribution at all, so there is no CPU test of FSDP2 with sequence parallelism.)"""
    pytest.importorskip("deepspeed")
    from .helpers import accelerate_launch_with_config, deepspeed_launcher_config, run_to_completion

    sharded_config = tmp_path / "sharded.yaml"
    sharded_config.write_text(
        deepspeed_launcher_config(stage=stage, init_flag="false")
        + "parallelism_config:\n  parallelism_config_sp_size: 2\n  parallelism_config_sp_backend: deepspeed\n"
    )
    model, sharded = family_models["qwen2"], tmp_path / "sharded"
    output = run_to_completion(accelerate_launch_with_config(sharded_config) + _command(method, model, sharded))
    assert "training on 1 data-parallel rank(s) of 2 processes" in output
    expected, got = one_process(method, model), _logged(sharded)
    assert len(expected) == len(got) == 3
    keys = ("loss", "grad_norm", "critic/grad_norm", "loss/value") if method == "ppo" else ("loss", "grad_norm", "kl")
    for step, (e, g) in enumerate(zip(expected, got), start=1):
        for key in keys:
            assert g[key] == pytest.approx(e[key], rel=1e-5, abs=1e-6), (step, key, g[key], e[key])


def _completions_generated(server) -> int:
    import requests

    info = requests.get(f"{server.url}/server_info", params={"config_format": "json"}, timeout=10).json()
    return info["vllm_config"]["trl_scale"]["completions_generated"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ordered", "streaming"])
def test_server_rollout_under_sp_size_2_requests_each_batch_once_per_group(family_models, tmp_path, mode):
    """GRPO generating on `trl-scale serve` with asynchronous rollout (staleness 1; the ordered prefetch, or the
    stream with syncs that keep running requests), 2 processes with sp_size=2 (one data-parallel rank): rank 0 of
    the group requests, prefetches or streams every batch and hands it to rank 1, so the server generates what it
    generates for one process (3 steps x 8 completions, and the preflight's two one-token probes, of the vocabulary
    and of the tokenizer; not twice that); both
    ranks train on those rows (the engine refuses a group whose ranks hold different batches), the run learns (a
    gradient), and the processes leave (the rollout client's threads end)."""
    from .helpers import accelerate_launch, run_to_completion, start_servers

    model = family_models["qwen2"]
    servers = start_servers(model, 1)  # one per run: it counts the run's completions
    try:
        rollout = ["--use_vllm", "true", "--vllm_mode", "server", "--async_rollout_staleness", "1"]
        rollout += ["--async_rollout_mode", mode]
        sharded = tmp_path / "sharded"
        output = run_to_completion(
            accelerate_launch(2)
            + _command("grpo", model, sharded, *rollout, "--vllm_server_base_urls", servers[0].url)
            + ["--sequence_parallel_size", "2"]
        )
        assert "training on 1 data-parallel rank(s) of 2 processes" in output
        # and the mismatch probe's (rank 0 of the world only): 2 completions of each of the first batch's 2 prompts
        assert _completions_generated(servers[0]) == 3 * 8 + 2 + 2 * 2
        logged = _logged(sharded)
        assert len(logged) == 3 and any(entry["grad_norm"] > 0 for entry in logged)
    finally:
        for server in servers:
            server.stop()


@pytest.mark.slow
def test_four_processes_with_sp_size_2_take_the_steps_of_two_data_parallel_processes(family_models, tmp_path):
    """4 processes with sp_size=2 are 2 data-parallel ranks (groups {0, 1} and {2, 3}): every gather of rewards,
    scores, advantages' whitening statistics and metrics takes one copy per group, each group trains on its own
    rows (TRL's per-process slices by group), and the steps equal those of 2 processes without sequence
    parallelism. PPO with greedy rollouts (top_k=1), so the completions depend on the weights only."""
    from .helpers import accelerate_launch, run_to_completion

    model = family_models["llama"]
    greedy = ["--top_k", "1"]
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    run_to_completion(accelerate_launch(2) + _command("ppo", model, plain, *greedy))
    output = run_to_completion(
        accelerate_launch(4) + _command("ppo", model, sharded, *greedy, "--sequence_parallel_size", "2")
    )
    assert "training on 2 data-parallel rank(s) of 4 processes" in output
    expected, got = _logged(plain), _logged(sharded)
    assert len(expected) == len(got) == 3
    for step, (e, g) in enumerate(zip(expected, got), start=1):
        for key in ("loss", "grad_norm", "critic/grad_norm", "objective/scores", "objective/kl", "loss/value"):
            assert g[key] == pytest.approx(e[key], rel=1e-5, abs=1e-6), (step, key, g[key], e[key])
    assert any(e["grad_norm"] > 0 for e in expected)


@pytest.mark.parametrize("window, softcap", [(None, None), (8, None), (None, 30.0), (8, 30.0)])
def test_packed_attention_in_query_blocks_equals_the_whole_sequence_mask(monkeypatch, window, softcap):
    """A sequence longer than the sliding window, or a soft-capped layer, is attended in blocks of queries, each
    against the keys it may see (memory linear in the sequence, not [S, S]): the same as the whole sequence's mask,
    with blocks smaller than the window, between it and a sequence, and larger than every sequence."""
    import types

    import torch

    from trl_scale.scoring import sequence_parallel

    torch.manual_seed(0)
    lengths, heads, dim = [37, 5, 58], 4, 16
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    q, k, v = (torch.randn(1, heads, sum(lengths), dim, dtype=torch.float64) for _ in range(3))
    expected, start = [], 0
    for n in lengths:
        index = torch.arange(n)
        allowed = index[:, None] >= index[None, :]
        if window:
            allowed &= index[:, None] - index[None, :] < window
        scores = q[:, :, start : start + n] @ k[:, :, start : start + n].transpose(2, 3) * dim**-0.5
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        expected.append(torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v[:, :, start : start + n])
        start += n
    expected = torch.cat(expected, 2).transpose(1, 2)
    module = types.SimpleNamespace(training=False, sliding_window=None)
    for block in (5, 16, 1024):
        monkeypatch.setattr(sequence_parallel, "QUERY_BLOCK", block)
        got, _ = sequence_parallel.packed_causal_attention(
            module, q, k, v, None, position_ids=positions, sliding_window=window, softcap=softcap
        )
        # soft-capped scores go through a float32 softmax, as transformers' eager attention does
        assert (got - expected).abs().max().item() <= (1e-6 if softcap else 1e-12), (block, window, softcap)


@pytest.mark.slow
def test_a_run_under_sp_size_2_resumes_inside_a_rollout_window_exactly(family_models, tmp_path):
    """2 processes with sp_size=2, a rollout spanning 2 optimizer steps x 2 iterations, checkpoint-3 inside a window:
    the group's rollout file is written once (by its rank 0) and read by both ranks, and the resumed run takes the
    uninterrupted run's steps 4-6."""
    from .helpers import accelerate_launch, run_to_completion

    model = family_models["qwen2"]
    window = ["--steps_per_generation", "2", "--num_iterations", "2", "--sequence_parallel_size", "2"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"

    def command(out, *extra):
        base = _command("grpo", model, out, *window, *extra)
        base[base.index("--max_steps") + 1] = "6"
        return accelerate_launch(2) + base

    run_to_completion(command(full))
    assert saved_state(full / "checkpoint-3", "rollout_resume") is not None
    assert not (full / "checkpoint-3" / "trl_scale_state_rank1.pt").exists()  # one data-parallel rank
    run_to_completion(command(resumed, "--resume_from_checkpoint", str(full / "checkpoint-3")))

    def logged(out):
        state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
        return [entry for entry in state["log_history"] if "loss" in entry]

    expected, got = logged(full), logged(resumed)
    assert len(expected) == len(got) == 6
    for e, g in zip(expected[3:], got[3:]):
        for key in ("loss", "grad_norm", "kl"):
            assert g[key] == pytest.approx(e[key], rel=1e-5, abs=1e-7), (key, g[key], e[key])
