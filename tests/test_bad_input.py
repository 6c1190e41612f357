"""Bad input gets a clear error that names the field (or function) and the fix, early, and loses nothing already
done. One test per row of README's "Bad input" table."""

import math
import os
import re

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

import trl_scale
from trl_scale.toy import counting_prompts
from trl_scale.trainers.reward_checks import RewardFunctionError

from .helpers import cpu_args, paired, step_logs, token_parity_reward


def _grpo(model_path, out, reward_funcs=token_parity_reward, dataset=None, **overrides):
    settings = dict(num_generations=4, max_completion_length=6, max_steps=2)
    settings.update(overrides)
    return trl_scale.GRPOTrainer(
        model=model_path,
        reward_funcs=reward_funcs,
        args=trl_scale.GRPOConfig(**cpu_args(out, **settings)),
        train_dataset=counting_prompts(32, seed=0) if dataset is None else dataset,
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )


def _fails_on_call(after: int, result):
    """A reward function that works for `after` calls, then returns `result` (or raises it, for an exception)."""
    calls = []

    def flaky_reward(completions, **kwargs):
        calls.append(1)
        if len(calls) <= after:
            return [0.5] * len(completions)
        if isinstance(result, Exception):
            raise result
        return result(completions)

    return flaky_reward


@pytest.mark.parametrize(
    "result, error, match",
    [
        (KeyError("answer"), RewardFunctionError, r"reward function 'flaky_reward' raised KeyError: 'answer'"),
        (lambda c: [0.5] * (len(c) - 1), ValueError, r"'flaky_reward' returned 7 rewards for 8 completions"),
        (lambda c: [math.inf] * len(c), ValueError, r"'flaky_reward' returned inf for completion 0.*finite"),
        (lambda c: ["0.5"] * len(c), ValueError, r"'flaky_reward' returned '0.5' \(str\) for completion 0"),
        (lambda c: 0.5, ValueError, r"'flaky_reward' returned float; return a list"),
    ],
    ids=["raises", "wrong-length", "inf", "not-a-number", "not-a-list"],
)
def test_bad_reward_stops_the_step_naming_the_function_and_keeps_the_checkpoint(
    result, error, match, tiny_llama, tmp_path
):
    trainer = _grpo(tiny_llama, tmp_path, _fails_on_call(1, result), save_strategy="steps", save_steps=1)
    with pytest.raises(error, match=match):
        trainer.train()
    checkpoint = tmp_path / "checkpoint-1"  # step 1 finished and was saved; step 2's reward failed
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "trainer_state.json").exists()
    AutoModelForCausalLM.from_pretrained(checkpoint)


def test_a_checked_reward_function_called_directly_counts_positional_completions():
    """Users (and the Ray reward wrapper's callers) call reward functions directly as `f(prompts, completions)`:
    the check counts the completions given positionally, not zero."""
    from trl_scale.trainers.reward_checks import checked_reward_func

    def two(prompts, completions, **kwargs):
        return [0.5, 0.5]

    checked = checked_reward_func(two, "two")
    assert checked(["p", "q"], ["a", "b"]) == [0.5, 0.5]
    with pytest.raises(ValueError, match="returned 2 rewards for 3 completions"):
        checked(["p", "q", "r"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="returned 2 rewards for 3 completions"):
        checked(prompts=["p"] * 3, completions=["a", "b", "c"])


def test_none_and_nan_rewards_keep_trls_meaning(tiny_llama, tmp_path):
    """None (and NaN, which TRL reads the same way) marks "this function does not apply": GRPO trains, as in TRL."""

    def partial_reward(completions, **kwargs):
        return [None if i % 2 else 0.5 for i in range(len(completions))]

    def nan_reward(completions, **kwargs):
        return [math.nan if i % 2 == 0 else 1.0 for i in range(len(completions))]

    trainer = _grpo(tiny_llama, tmp_path, [partial_reward, nan_reward, token_parity_reward])
    trainer.train()
    assert len(step_logs(trainer)) == 2
    assert trainer.reward_func_names == ["partial_reward", "nan_reward", "token_parity_reward"]


@pytest.mark.parametrize("missing", [None, math.nan], ids=["none", "nan"])
def test_rewards_all_missing_are_said_once_with_the_fix(missing, tiny_llama, tmp_path, caplog):
    """Every reward None (or NaN): TRL trains with zero advantages and says nothing useful; trl-scale says so once,
    naming the functions and the fix, and still trains as TRL does."""
    import logging

    def never_applies(completions, **kwargs):
        return [missing] * len(completions)

    trainer = _grpo(tiny_llama, tmp_path, [never_applies])
    with caplog.at_level(logging.WARNING, logger="trl_scale"):
        trainer.train()
    assert len(step_logs(trainer)) == 2
    said = [r.getMessage() for r in caplog.records if "nothing to learn from" in r.getMessage()]
    assert len(said) == 1 and "never_applies" in said[0] and "Fix:" in said[0]


def test_async_and_callable_object_rewards_keep_their_names_and_kind(tiny_llama, tmp_path):
    class LengthReward:
        def __call__(self, completions, **kwargs):
            return [len(c) / 100 for c in completions]

    async def async_reward(completions, **kwargs):
        return [0.25] * len(completions)

    trainer = _grpo(tiny_llama, tmp_path, [LengthReward(), async_reward], max_steps=1)
    assert trainer.reward_func_names == ["LengthReward", "async_reward"]
    trainer.train()
    (logs,) = step_logs(trainer, ("rewards/async_reward/mean",))
    assert logs["rewards/async_reward/mean"] == pytest.approx(0.25)


def test_token_budget_smaller_than_a_sequence_gives_that_sequence_its_own_forward(tiny_llama, tmp_path):
    small = _grpo(tiny_llama, tmp_path / "small", token_budget=2, padding_free=True, optim="sgd")
    small.train()
    padded = _grpo(tiny_llama, tmp_path / "padded", padding_free=False, optim="sgd")
    padded.train()
    keys = ("loss", "grad_norm", "reward")
    for a, b in paired(step_logs(small, keys), step_logs(padded, keys)):
        for key in keys:
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
    logged = [e for e in small.state.log_history if "padding_free/micro_batches_per_call" in e]
    assert logged and all(e["padding_free/micro_batches_per_call"] == 8 for e in logged)  # one per sequence


def test_output_dir_is_checked_before_anything_runs(tiny_llama, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(ValueError, match=r"output_dir=.*file.*not writable.*Fix"):
        _grpo(tiny_llama, blocked / "run")
    assert os.path.isfile(blocked)


def test_empty_dataset_is_refused_at_construction(tiny_llama, tmp_path):
    from datasets import Dataset

    empty = Dataset.from_dict({"prompt": []})
    with pytest.raises(ValueError, match="train_dataset is empty: GRPOTrainer has nothing to train on"):
        _grpo(tiny_llama, tmp_path, dataset=empty)
    with pytest.raises(ValueError, match="train_dataset is empty: DPOTrainer"):
        _dpo(tiny_llama, tmp_path, Dataset.from_dict({"chosen": [], "rejected": []}))


def test_missing_column_is_named_with_the_fix(tiny_llama, tmp_path):
    from datasets import Dataset

    questions = Dataset.from_dict({"question": ["one two"] * 8})
    with pytest.raises(ValueError, match=r"no column 'prompt'.*\['question'\].*rename_column\(OLD, 'prompt'\)"):
        _grpo(tiny_llama, tmp_path, dataset=questions)
    pairs = Dataset.from_dict({"prompt": ["one"] * 4, "chosen": [" two"] * 4, "better": [" cat"] * 4})
    with pytest.raises(ValueError, match=r"no column 'rejected'"):
        _dpo(tiny_llama, tmp_path, pairs)


def test_dataset_dict_instead_of_a_split_is_named(tiny_llama, tmp_path):
    from datasets import DatasetDict

    with pytest.raises(ValueError, match=r"DatasetDict with splits \['train'\].*dataset\['train'\]"):
        _grpo(tiny_llama, tmp_path, dataset=DatasetDict({"train": counting_prompts(8)}))


@pytest.mark.parametrize("column", ["chosen", "rejected"])
def test_dpo_pair_with_an_empty_answer_names_the_row(column, tiny_llama, tmp_path):
    from trl_scale.toy import preference_pairs

    pairs = preference_pairs(8, seed=0).to_list()
    pairs[5][column] = ""
    from datasets import Dataset

    with pytest.raises(ValueError, match=rf"row 5 has an empty '{column}' answer.*dataset.filter"):
        _dpo(tiny_llama, tmp_path, Dataset.from_list(pairs))


@pytest.mark.parametrize(
    "urls, match",
    [
        (["localhost:8000"], r"'localhost:8000' is not a server URL.*http://HOST:PORT"),
        (["http://"], r"'http://' is not a server URL"),
        (["http://127.0.0.1:8000", "http://127.0.0.1:8000/"], r"lists the same server twice"),
        (["http://127.0.0.1:8000", "http://localhost:8000/"], r"lists the same server twice"),
        (["http://[::1]:80", "http://LOCALHOST"], r"lists the same server twice"),
        (["http://127.0.0.2:8000", "http://localhost:8000"], r"lists the same server twice"),
        (
            ["http://127.0.0.1:8000/v1"],
            r"ends in an OpenAI API path \(/v1\).*Fix: drop the path, e\.g\. "
            r"http://127\.0\.0\.1:8000",
        ),
        (["http://127.0.0.1:port"], r"'http://127.0.0.1:port' has no valid port"),
    ],
    ids=["no-scheme", "no-host", "duplicate", "loopback-names", "default-port", "loopback-range", "v1-path", "port"],
)
def test_bad_server_urls_are_refused_in_the_config(urls, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        trl_scale.GRPOConfig(**cpu_args(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_urls=urls))


def test_lora_weight_sync_without_an_adapter_is_refused(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=r"weight_sync='lora'.*has none.*peft_config=LoraConfig"):
        _grpo(
            tiny_llama,
            tmp_path,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_urls=["http://127.0.0.1:9"],
            weight_sync="lora",
        )


def _dpo(model_path, out, dataset):
    return trl_scale.DPOTrainer(
        model=model_path,
        args=trl_scale.DPOConfig(**cpu_args(out, max_length=64, max_steps=1)),
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )


def test_disk_full_while_saving_keeps_the_last_complete_checkpoint(tiny_llama, tmp_path, monkeypatch):
    import errno

    import torch
    from transformers.trainer_utils import get_last_checkpoint

    trainer = _grpo(tiny_llama, tmp_path, save_strategy="steps", save_steps=1, max_steps=3)
    real_save = torch.save

    def save_until_full(obj, path, *args, **kwargs):
        if "checkpoint-2" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_full)
    with pytest.raises(
        OSError, match=r"checkpoint-2 failed \(No space left on device\).*last complete one is .*checkpoint-1"
    ):
        trainer.train()
    monkeypatch.setattr(torch, "save", real_save)
    assert not (tmp_path / "checkpoint-2").exists()  # no half-written checkpoint for a resume to pick up
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-1")
    resumed = _grpo(tiny_llama, tmp_path, save_strategy="steps", save_steps=1, max_steps=3)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3


def test_backend_ray_without_ray_installed_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real_find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=r"backend='ray' needs Ray.*pip install 'trl-scale\[ray\]'"):
        trl_scale.GRPOConfig(**cpu_args(tmp_path, backend="ray"))


def test_unreachable_ray_address_is_a_clear_error(tmp_path):
    import subprocess
    import sys
    import time

    from .helpers import free_port, subprocess_env

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    code = f"from trl_scale.distributed.ray_backend import init_ray; init_ray({address!r})"
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=240
    )
    assert result.returncode != 0
    assert (
        f"ray_address={address!r}: could not reach a Ray cluster" in result.stderr
        and "ray start --head" in result.stderr
    )
    assert time.monotonic() - start < 60


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--not_a_field", "1"], r"not used by the HfArgumentParser: \['--not_a_field', '1'\].*--help"),
        (["--learning_rate", "fast"], r"argument --learning_rate/--learning-rate: invalid float value: 'fast'"),
        (["--padding_free", "maybe"], r"argument --padding_free.*Truthy value expected: got maybe"),
    ],
    ids=["unknown-field", "type-error", "bad-bool"],
)
def test_cli_names_the_bad_field(argv, match, tmp_path, capsys):
    from trl_scale.cli import main

    from .helpers import ROOT

    with pytest.raises(SystemExit) as exit_info:
        main(["grpo", "--config", str(ROOT / "examples" / "grpo_tiny_cpu.yaml"), "--output_dir", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    assert __import__("re").search(match, capsys.readouterr().err)


def test_yaml_type_error_names_the_field(tmp_path, capsys):
    from trl_scale.cli import main

    config = tmp_path / "bad.yaml"
    config.write_text("model_name_or_path: toy:llama\ndataset_name: toy:counting\nmax_steps: lots\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["grpo", "--config", str(config), "--output_dir", str(tmp_path / "out")])
    assert (
        exit_info.value.code == 2 and "--max_steps/--max-steps: invalid int value: 'lots'" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "case, match",
    [
        ("yaml", r"--config is not valid YAML \(line 2, column 6\): mapping values are not allowed here. Fix"),
        ("config-check", r"error: rollout_max_inflight_per_server=0: use a positive whole number"),
        ("empty-dataset", r"dataset_name='.*' holds no rows \(its data files are empty"),
        ("header-only-csv", r"dataset_name='.*data' holds no rows \(its data files are empty, or a header only"),
        ("empty-parquet", r"dataset_name='.*train.parquet' holds no rows"),
        ("yaml-unknown-field", r"--config has unknown fields \['--not_a_field', '3'\]. Fix: check the field names"),
    ],
)
def test_cli_says_what_is_wrong_without_a_traceback(case, match, tmp_path, capsys):
    """Malformed YAML used to be a 15-frame traceback; a config's own check was blamed on the field names; an empty
    local dataset (a 0-byte file, a CSV header alone, a Parquet file of 0 rows) was a `datasets` traceback; an
    unknown YAML field got TrlParser's advice to set `fail_with_unknown_args=False`."""
    from trl_scale.cli import main

    argv = ["grpo", "--output_dir", str(tmp_path / "out"), "--model_name_or_path", "toy:llama"]
    argv += ["--reward_funcs", "tests.helpers.token_parity_reward", "--use_cpu", "true", "--bf16", "false"]
    if case == "yaml":
        (tmp_path / "bad.yaml").write_text("model_name_or_path: toy:llama\n  bad: [indent\n")
        argv += ["--config", str(tmp_path / "bad.yaml")]
    elif case == "config-check":
        argv += ["--dataset_name", "toy:counting", "--rollout_max_inflight_per_server", "0"]
    elif case == "yaml-unknown-field":
        (tmp_path / "unknown.yaml").write_text("dataset_name: toy:counting\nnot_a_field: 3\n")
        argv += ["--config", str(tmp_path / "unknown.yaml")]
    elif case == "empty-parquet":  # one file, as dataset_name may name
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "train.parquet")
        argv += ["--dataset_name", str(tmp_path / "train.parquet")]
    else:
        (tmp_path / "data").mkdir()
        name, text = ("train.csv", "prompt\n") if case == "header-only-csv" else ("train.jsonl", "")
        (tmp_path / "data" / name).write_text(text)
        argv += ["--dataset_name", str(tmp_path / "data")]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and __import__("re").search(match, err), err[-500:]
    assert ("check the field names" in err) == (case == "yaml-unknown-field") and "Traceback" not in err


class _HubWithoutToken:
    """Stands in for `huggingface_hub.HfApi` on a machine with no token: every write is refused as the Hub does."""

    def create_repo(self, repo_id, **kwargs):
        from huggingface_hub.errors import LocalTokenNotFoundError

        raise LocalTokenNotFoundError("Token is required (`token=True`), but no token found.")

    upload_folder = create_repo


def test_push_to_hub_without_a_token_fails_early_and_keeps_the_model(tiny_llama, tmp_path, monkeypatch):
    import transformers.trainer

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: _HubWithoutToken())
    # push_to_hub=True: the repo is created at construction, so a missing token stops the run before it trains.
    with pytest.raises(RuntimeError, match=r"creating the Hub repo.*LocalTokenNotFoundError.*HF_TOKEN"):
        _grpo(tiny_llama, tmp_path / "early", push_to_hub=True, hub_model_id="tiny")
    # A push after training: the error says where the model is, and it is there.
    trainer = _grpo(tiny_llama, tmp_path / "late", max_steps=1)
    trainer.train()
    with pytest.raises(RuntimeError, match=r"push_to_hub failed.*Nothing is lost.*late.*HF_TOKEN"):
        trainer.push_to_hub()
    assert (tmp_path / "late" / "model.safetensors").exists()
    AutoModelForCausalLM.from_pretrained(tmp_path / "late")


@pytest.mark.parametrize(
    "body, match",
    [
        (b"{not json", r"JSONDecodeError"),
        (b'{"choices": [{"token_ids": [1]}]}', r"malformed response: 1 choices for n=2"),
    ],
    ids=["malformed-json", "wrong-number-of-choices"],
)
def test_a_server_answering_garbage_leaves_the_rotation_with_the_reason(body, match):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from trl_scale.rollout import RolloutClient, RolloutError

    class Garbage(BaseHTTPRequestHandler):
        def _send(self, payload: bytes):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            self._send(json.dumps({"data": [{"id": "tiny"}]}).encode())

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = RolloutClient([f"http://127.0.0.1:{server.server_port}"], request_timeout=3, retry_after=0.5)
        with pytest.raises(RolloutError, match=rf"no rollout server answered.*{match}"):
            client.generate([[1, 2, 3]], n=2, max_tokens=2)
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_prompt_beyond_the_model_context_is_named_before_it_trains(tmp_path):
    from datasets import Dataset

    from trl_scale.toy import build_tiny_model

    short_context = build_tiny_model(tmp_path / "model", "llama", max_position_embeddings=24)
    with pytest.raises(ValueError, match=r"max_completion_length=24 leaves no room.*context of 24 tokens"):
        _grpo(short_context, tmp_path / "a", max_completion_length=24)
    long_prompt = " ".join(["one"] * 30)
    rows = [{"prompt": "one two"}, {"prompt": long_prompt}] * 4  # one prompt per step: step 2's is too long
    trainer = _grpo(
        short_context,
        tmp_path / "b",
        dataset=Dataset.from_list(rows),
        shuffle_dataset=False,
        save_strategy="steps",
        save_steps=1,
        per_device_train_batch_size=4,
    )
    with pytest.raises(ValueError, match=r"prompt 0 of this batch has 30 tokens.*context of 24 tokens.*filter"):
        trainer.train()
    assert (tmp_path / "b" / "checkpoint-1" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"rollout_max_inflight_per_server": 0}, r"rollout_max_inflight_per_server=0: use a positive whole number"),
        ({"rollout_max_inflight_per_server": -2}, r"rollout_max_inflight_per_server=-2"),
        ({"rollout_generation_timeout": 0}, r"rollout_generation_timeout=0: use a positive number of seconds"),
        ({"weight_load_timeout": "10"}, r"weight_load_timeout='10': use a positive number of seconds"),
        ({"token_budget": True}, r"token_budget=True: use a positive number of tokens"),
        ({"critic_placement": {"num_worker": 2}}, r"critic_placement has unknown keys \['num_worker'\]"),
        ({"critic_placement": {"num_workers": "2"}}, r"critic_placement.num_workers='2': use a whole number"),
        ({"reward_placement": {"num_gpus_per_worker": -1}}, r"reward_placement.num_gpus_per_worker=-1: use a number"),
        ({"loss_type": "grpo"}, r"loss_type='grpo': PPOTrainer's losses are token means.*Fix: loss_type='dapo'"),
        ({"async_rollout_staleness": 1.5}, r"async_rollout_staleness=1.5: use a whole number of weight syncs"),
        ({"async_rollout_staleness": -1}, r"async_rollout_staleness=-1: use a whole number"),
        ({"rollout_max_inflight_per_server": 8.0}, r"rollout_max_inflight_per_server=8.0: use a positive whole"),
        ({"managed_servers": True}, r"managed_servers=True: use a whole number of servers"),
        ({"managed_server_max_restarts": 2.5}, r"managed_server_max_restarts=2.5: use a whole number >= 0"),
        ({"logprob_chunk_size": True}, r"logprob_chunk_size=True: use a positive number of tokens"),
        ({"num_ppo_epochs": 1.5}, r"num_ppo_epochs=1.5: use a whole number >= 1"),
        ({"num_mini_batches": 0}, r"num_mini_batches=0: use a whole number >= 1"),
        ({"ray_call_timeout": 0}, r"ray_call_timeout=0: use a positive number of seconds"),
    ],
    ids=[
        "inflight-0",
        "inflight-negative",
        "generation-timeout",
        "load-timeout-str",
        "budget-bool",
        "placement-key",
        "workers-str",
        "gpus-negative",
        "ppo-loss-type",
        "staleness-float",
        "staleness-negative",
        "inflight-float",
        "servers-bool",
        "restarts-float",
        "chunk-bool",
        "epochs-float",
        "mini-batches-0",
        "ray-timeout-0",
    ],
)
def test_config_values_that_cannot_work_are_named_with_the_fix(fields, match, tmp_path):
    """Each used to be accepted: a run that stalled 120 s then blamed a healthy server (in-flight 0), a budget of 1
    token (True), a placement typo ignored until backend='ray', a TypeError deep in Ray's setup ('2')."""
    import trl_scale

    with pytest.raises(ValueError, match=match):
        trl_scale.PPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **fields)


@pytest.mark.parametrize("field", ["model", "reward_funcs", "value_model"])
def test_a_local_model_path_that_does_not_exist_is_named_not_taken_for_a_hub_id(field, tiny_llama, tmp_path):
    """transformers would call it a bad Hub id ("Repo id must use alphanumeric chars")."""
    import trl_scale

    missing = str(tmp_path / "no-such-checkpoint")
    models = {"model": tiny_llama, "reward_funcs": token_parity_reward, "value_model": None}
    models[field] = missing
    with pytest.raises(ValueError, match=rf"{field}='{missing}': no such directory.*Fix: pass the directory"):
        trl_scale.PPOTrainer(
            args=trl_scale.PPOConfig(**cpu_args(tmp_path / "out")), train_dataset=counting_prompts(8), **models
        )


def test_serve_names_a_model_path_that_does_not_exist(tmp_path):
    from trl_scale.model_paths import check_model_path

    with pytest.raises(ValueError, match=r"--model='\./nope/model': no such directory"):
        check_model_path("./nope/model", "--model")
    for hub_id in ("gpt2", "Qwen/Qwen3-0.6B"):  # left to transformers and the Hub
        check_model_path(hub_id, "--model")


def _url_answers(kind: str):
    from .helpers import banner_server, plain_http_server

    if kind == "404":
        return plain_http_server(404)
    if kind == "tls":  # https:// to a plain-HTTP server
        from contextlib import contextmanager

        @contextmanager
        def https_to_plain():
            with plain_http_server(200, b"{}") as url:
                yield url.replace("http://", "https://")

        return https_to_plain()
    return banner_server()  # another protocol on the port


@pytest.mark.parametrize(
    "kind, match",
    [
        ("404", r"/health answered 404: no vLLM server at this URL.*Fix: use http://HOST:PORT"),
        ("tls", r"the TLS handshake failed.*speaks plain HTTP.*Fix: use http://"),
        ("protocol", r"the port answers, but not in HTTP.*BadStatusLine"),
    ],
)
def test_a_definite_answer_ends_the_wait_for_servers_at_once(kind, match, tiny_llama, tmp_path):
    """A 404 on /health, a TLS failure, another protocol: no wait heals them, so the trainer says so at once (it
    waited the whole vllm_server_timeout, 240 s by default). A refused connection is still waited through: a starting
    vLLM refuses connections while its model loads (tests/test_weight_sync.py, the client waits for servers still
    loading)."""
    import time

    from .helpers import server_grpo

    with _url_answers(kind) as url:
        began = time.monotonic()
        with pytest.raises(Exception, match=match):
            server_grpo(tiny_llama, tmp_path, [url], vllm_server_timeout=40, weight_sync="shared_dir")
        assert time.monotonic() - began < 30


@pytest.mark.parametrize(
    "kind, argv_url, match, code",
    [
        (
            "none",
            "127.0.0.1:{port}",
            r"URL entry '127\.0\.0\.1:\d+' is not a server URL\. Fix: use http://HOST:PORT",
            2,
        ),
        ("protocol", None, r"problem: .*not usable: the port answers, but not in HTTP", 1),
        ("refused", None, r"problem: .*not usable: connection refused: nothing listens there", 1),
    ],
)
def test_check_servers_accepts_and_explains_urls_as_the_trainer_does(kind, argv_url, match, code, capsys):
    """A URL without a scheme is refused with the trainer's own message (it was 'not reachable'); a port speaking
    another protocol, or nothing listening, is named as such."""
    import re

    from trl_scale.cli import main

    from .helpers import banner_server, free_port

    def run(url):
        try:
            return main(["check-servers", url])
        except SystemExit as exit_info:
            return exit_info.code

    if kind == "protocol":
        with banner_server() as url:
            status = run(url)
    else:
        url = (argv_url or "http://127.0.0.1:{port}").format(port=free_port())
        status = run(url)
    assert status == code and re.search(match, capsys.readouterr().err)


def test_preflight_boundaries_a_context_as_long_as_the_completions_and_a_rank_at_the_servers_limit():
    """Both boundaries, on a server report as the preflight reads one (the same checks against real vLLM:
    tests/test_real_vllm.py): completions as long as the whole context leave no token for a prompt (refused), and an
    adapter of exactly the server's --max-lora-rank loads (vLLM refuses only above it)."""
    from peft import LoraConfig

    from trl_scale.rollout.preflight import RunNeeds, ServerReport, problems_of

    report = ServerReport("http://s", reachable=True, max_model_len=256, dev_mode=True, lora_enabled=True)
    report.max_lora_rank, report.runtime_lora = 8, True
    assert any("leaves no room" in e for e in problems_of(report, RunNeeds(max_completion_length=256))[0])
    assert not problems_of(report, RunNeeds(max_completion_length=255))[0]
    lora = RunNeeds(weight_sync="lora", lora_config=LoraConfig(r=8))
    assert not problems_of(report, lora)[0]
    lora = RunNeeds(weight_sync="lora", lora_config=LoraConfig(r=9))
    assert any("rank 9, above the server's --max-lora-rank 8" in e for e in problems_of(report, lora)[0])


def _own_fields(cls, kinds):
    """The fields `cls` itself declares whose type (or `X | None`) is one of `kinds`."""
    import types
    import typing

    hints = typing.get_type_hints(cls)
    names = []
    for name in cls.__dict__.get("__annotations__", {}):
        kind = hints.get(name)
        arguments = [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(arguments) == 1:
            kind = arguments[0]
        if kind in kinds:
            names.append(name)
    return names


def _config_fields(kinds):
    from trl_scale.distributed.arguments import DistributedArguments
    from trl_scale.fleet.arguments import ManagedServerArguments
    from trl_scale.rollout.arguments import RolloutArguments
    from trl_scale.rollout.dynamic_sampling import DynamicSamplingArguments
    from trl_scale.scoring.arguments import ScoringArguments
    from trl_scale.trainers.rloo_config import RLOOCorrectionArguments

    mixins = (ScoringArguments, RolloutArguments, ManagedServerArguments, DynamicSamplingArguments)
    owners = {
        trl_scale.GRPOConfig: (*mixins, DistributedArguments),
        trl_scale.RLOOConfig: (RLOOCorrectionArguments,),
        trl_scale.PPOConfig: (trl_scale.PPOConfig,),
    }
    return [
        pytest.param(config, name, id=f"{config.__name__}.{name}")
        for config, mixins in owners.items()
        for mixin in mixins
        for name in _own_fields(mixin, kinds)
    ]


@pytest.mark.parametrize("config_cls, name", _config_fields({bool}))
def test_every_boolean_field_refuses_a_string(config_cls, name, tmp_path):
    """A string such as "false" is truthy in Python: in a boolean field it would switch the feature on."""
    with pytest.raises(ValueError, match=rf"^{name}='false': use True or False"):
        config_cls(**cpu_args(tmp_path), **{name: "false"})


@pytest.mark.parametrize("config_cls, name", _config_fields({float}))
@pytest.mark.parametrize("value", ["3", math.nan, math.inf])
def test_every_float_field_refuses_a_string_nan_and_infinity(config_cls, name, value, tmp_path):
    with pytest.raises(ValueError, match=rf"^{name}={value!r}: "):
        config_cls(**cpu_args(tmp_path), **{name: value})


def test_the_sweeps_cover_the_fields_the_issue_named():
    booleans = {name for _, name in (p.values for p in _config_fields({bool}))}
    floats = {name for _, name in (p.values for p in _config_fields({float}))}
    assert {"dynamic_sampling", "logprobs_on_sampler_support", "compile_decoder_layers", "whiten_rewards"} <= booleans
    assert {"dynamic_sampling_max_oversampling", "weight_sync_timeout", "gamma", "kl_coef"} <= floats


@pytest.mark.parametrize("config_cls", [trl_scale.GRPOConfig, trl_scale.RLOOConfig, trl_scale.PPOConfig])
@pytest.mark.parametrize(
    "fields, message",
    [
        ({"top_p": 0.0}, r"top_p=0.0: use a number in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5: use a number in \(0, 1\]"),
        ({"top_k": -2}, r"top_k=-2: use a whole number: 0 \(or -1\) keeps every token"),
        ({"min_p": 1.2}, r"min_p=1.2: use a number in \[0, 1\]"),
        ({"temperature": 0.0}, r"temperature=0.0: the trainer scores log-probs of logits / temperature"),
    ],
    ids=["top_p-0", "top_p-1.5", "top_k-negative", "min_p-above-1", "temperature-0"],
)
def test_sampling_out_of_range_is_refused_at_construction(config_cls, fields, message, tmp_path):
    """Before: accepted, then every request of the first step failed on the server's 422 (and for top_p=1.5 the
    preflight first suggested logprobs_on_sampler_support=True, already set)."""
    with pytest.raises(ValueError, match=message):
        config_cls(**cpu_args(tmp_path), **fields)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--step-delay", "-1"], r"argument --step-delay: '-1': use a finite number >= 0"),
        (["--step-delay", "nan"], r"argument --step-delay: 'nan': use a finite number >= 0"),
        (["--token-delay", "inf"], r"argument --token-delay: 'inf': use a finite number >= 0"),
        (["--world-size", "0"], r"argument --world-size: '0': use a whole number >= 1"),
        (["--weight-transfer-timeout", "0"], r"argument --weight-transfer-timeout: '0': use a finite number > 0"),
        ([], r"--model='/nonexistent/model': no such directory"),
    ],
)
def test_serve_refuses_bad_numbers_and_paths_before_it_starts(argv, message, capsys):
    """Before: `--step-delay -1` or `nan` started, answered /health, and failed every completion with a 500; a model
    path that does not exist was a traceback."""
    from trl_scale.serve import serve

    with pytest.raises(SystemExit) as exited:
        serve(["--model", "/nonexistent/model", *argv])
    assert exited.value.code == 2
    assert re.search(message, capsys.readouterr().err)
