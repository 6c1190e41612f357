"""The seam registry (`trl_scale/seams`): every TRL internal trl-scale relies on still holds in the installed TRL,
none is used without being registered, and a TRL that moved one fails naming it."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import trl

from trl_scale import seams

from .helpers import ROOT

# The TRL and transformers classes trl-scale subclasses or drives: their private names used in trl-scale are seams.
_OWNERS = {
    "trl.trainer.grpo_trainer:GRPOTrainer",
    "trl.trainer.rloo_trainer:RLOOTrainer",
    "trl.trainer.dpo_trainer:DPOTrainer",
    "trl.generation.vllm_generation:VLLMGeneration",
    "transformers.trainer:Trainer",
    "transformers.modeling_utils:PreTrainedModel",  # the models trl-scale patches and reads
    "transformers.configuration_utils:PretrainedConfig",
}
# Modules whose private module-level names trl-scale reads or writes.
_OWNER_MODULES = ("transformers.integrations.deepspeed", "trl.trainer.utils")


def test_every_seam_holds_in_the_installed_trl():
    assert seams.check() == []


def _registered_names() -> set[str]:
    names = set()
    for seam in seams.SEAMS:
        names.add(seam.attribute or seam.target.rpartition(":")[2].split(".")[-1])
    return names


def _private_names_of_trl_classes() -> set[str]:
    import importlib
    import inspect

    names = {n for m in _OWNER_MODULES for n in vars(importlib.import_module(m)) if re.match(r"_[a-z]", n)}
    for target in _OWNERS:
        cls = seams.resolve(target)
        for klass in cls.__mro__:
            if klass.__module__.split(".")[0] not in ("trl", "transformers"):
                continue
            names |= {n for n in vars(klass) if n.startswith("_") and not n.startswith("__")}
            try:
                names |= set(re.findall(r"self\.(_[a-z][a-z0-9_]*)\b", inspect.getsource(klass)))
            except (OSError, TypeError):
                pass
    return names


def private_names_used(text: str, owned: set[str]) -> set[str]:
    """The private names of TRL/transformers (`owned`) a source text uses: method overrides (`def _x`), attribute
    reads and writes (`._x`), names passed as strings to getattr/hasattr/setattr/delattr, and private names imported
    from TRL modules."""
    used = set(re.findall(r"(?:def |\.)(_[a-z][a-z0-9_]*)\b", text))
    used |= set(re.findall(r"(?:get|has|set|del)attr\([^,()]+,\s*[\"'](_[a-z][a-z0-9_]*)[\"']", text))
    used &= owned
    used |= set(re.findall(r"from trl[\w.]* import (_\w+)", text))
    return used | set(re.findall(r"trl_utils\.(_\w+)", text))


def test_trl_scale_uses_no_unregistered_private_trl_name():
    """Every private name of TRL and transformers (their trainers, models, configs, and the module-level names of
    `_OWNER_MODULES`) that trl-scale uses, however it names it (see `private_names_used`), is in the registry."""
    owned, registered = _private_names_of_trl_classes(), _registered_names()
    unregistered = {}
    for path in (ROOT / "trl_scale").rglob("*.py"):
        for name in private_names_used(path.read_text(), owned) - registered:
            unregistered.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not unregistered, f"register these in trl_scale/seams: {unregistered}"


def test_a_private_name_passed_as_a_string_is_seen():
    """Planted: TRL's `_logs` read by a string, a model's `_no_split_modules` by getattr, a transformers module's
    private global assigned: each is found (and so must be registered); a trl-scale attribute of its own is not."""
    owned = _private_names_of_trl_classes()
    planted = (
        'buffer = getattr(trainer, "_logs", None)\n'
        "layers = getattr(model, '_no_split_modules', None)\n"
        "hf_deepspeed._hf_deepspeed_config_weak_ref = saved\n"
        'setattr(model, "_trl_scale_compiled", True)\n'
    )
    assert private_names_used(planted, owned) == {"_logs", "_no_split_modules", "_hf_deepspeed_config_weak_ref"}


def test_a_seam_renamed_in_a_patched_trl_fails_naming_it(tmp_path):
    """A copy of the installed TRL with GRPOTrainer._tokenize_prompts renamed: the check names the seams on it, and
    only them (shown once here, as the upgrade procedure would meet it)."""
    source = pathlib.Path(trl.__file__).parent
    patched = tmp_path / "site" / "trl"
    shutil.copytree(source, patched, ignore=shutil.ignore_patterns("__pycache__"))
    trainer = patched / "trainer" / "grpo_trainer.py"
    text = trainer.read_text()
    assert text.count("def _tokenize_prompts(") == 1
    trainer.write_text(text.replace("def _tokenize_prompts(", "def _tokenize_prompt_batch("))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT)]))
    result = subprocess.run(
        [sys.executable, "-m", "trl_scale.seams"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path
    )
    moved = [line for line in result.stdout.splitlines() if line.startswith(("trl.", "transformers."))]
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    target = "trl.trainer.grpo_trainer:GRPOTrainer._tokenize_prompts"
    on_it = [seam for seam in seams.SEAMS if seam.target == target]  # the override, and the copy environments use
    assert len(on_it) == 2 and len(moved) == len(on_it) and all(line.startswith(target) for line in moved), moved
    assert all("gone" in line for line in moved) and any("step_checks.py ContextLength" in line for line in moved)
    print(moved[0])


def test_ppo_classifies_every_grpo_config_field():
    """PPO's list of what it applies or refuses is TRL's GRPOConfig itself: a field a TRL release adds fails here
    (and is refused when set) until it is classified in trainers/ppo_config.py."""
    from trl_scale.trainers.ppo_config import GRPO_FIELDS_PPO_APPLIES, GRPO_FIELDS_PPO_REFUSES, grpo_own_fields

    names = {f.name for f in grpo_own_fields()}
    classified = GRPO_FIELDS_PPO_APPLIES | set(GRPO_FIELDS_PPO_REFUSES)
    assert names - classified == set(), "classify these GRPO fields for PPO"
    assert classified - names == set(), "these are no longer GRPO fields"
    assert not GRPO_FIELDS_PPO_APPLIES & set(GRPO_FIELDS_PPO_REFUSES)
