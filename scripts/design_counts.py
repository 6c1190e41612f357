"""The redesign's counts, read from the source (and, with --step, from one traced training step).

    python scripts/design_counts.py [--step]

- probes: `getattr(X, ...)` / `hasattr(X, ...)` whose object is rooted at `trainer` or `self` (a setting or a
  collaborator asked for by duck typing);
- config reads with a default: `getattr(ARGS, "field", default)` where ARGS is `args`, `config`, `self.args` or
  `trainer.args` (a field read as if it might not exist);
- `last_*` reads: loads of a `.last_<name>` attribute that a hook left for another (`last_hidden_state`, a model
  output, is not one);
- trainer attributes assigned outside the constructor: `trainer.X = ...` and `setattr(trainer, ...)`;
- files the step visits (--step): the `trl_scale` files whose code runs during one GRPO training step of the demo's
  configuration, traced with `sys.setprofile`.
The last line printed is one JSON object.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_scale"
ARGS_NAMES = {"args", "config"}
NOT_A_MAILBOX = {"last_hidden_state"}


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_args(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ARGS_NAMES
    return isinstance(node, ast.Attribute) and node.attr == "args" and _root(node) in {"self", "trainer"}


def _count_file(tree: ast.AST, counts: dict[str, int]) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            name, first = node.func.id, node.args[0]
            if name == "getattr" and len(node.args) == 3 and _is_args(first):
                counts["config_reads_with_default"] += 1
            elif name in ("getattr", "hasattr") and _root(first) in {"trainer", "self"}:
                counts["probes"] += 1
            if name == "setattr" and _root(first) == "trainer":
                counts["trainer_attributes_assigned"] += 1
            field = node.args[1] if len(node.args) > 1 else None
            if name == "getattr" and isinstance(field, ast.Constant) and str(field.value).startswith("last_"):
                counts["last_reads"] += 1  # read by name: getattr(generation, "last_version_spans", None)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("last_") and node.attr not in NOT_A_MAILBOX:
            if isinstance(node.ctx, ast.Load):
                counts["last_reads"] += 1
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    if target.value.id == "trainer":
                        counts["trainer_attributes_assigned"] += 1


def static_counts() -> dict[str, int]:
    counts = dict.fromkeys(("probes", "config_reads_with_default", "last_reads", "trainer_attributes_assigned"), 0)
    for path in sorted(PACKAGE.rglob("*.py")):
        _count_file(ast.parse(path.read_text()), counts)
    return counts


def step_files() -> list[str]:
    """The trl_scale files whose code runs in one training step (the second: the first also sets things up) of the
    demo's GRPO configuration, on a tiny model."""
    import tempfile

    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer, TrainerCallback

    from trl_scale import GRPOConfig, GRPOTrainer
    from trl_scale.toy import build_tiny_model, counting_prompts, counting_reward
    from trl_scale.toy.demo import demo_config

    seen: set[str] = set()
    package = str(PACKAGE)

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            seen.add(frame.f_code.co_filename)

    class Trace(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                sys.setprofile(profile)

        def on_step_end(self, args, state, control, **kwargs):
            sys.setprofile(None)

    with tempfile.TemporaryDirectory() as out:
        model = build_tiny_model(f"{out}/model", family="llama")
        config = GRPOConfig(**demo_config(out, max_steps=2, batch_size=8, num_generations=4), disable_tqdm=True)
        trainer = GRPOTrainer(
            model,
            counting_reward,
            config,
            counting_prompts(64, seed=0),
            processing_class=AutoTokenizer.from_pretrained(model),
        )
        trainer.add_callback(Trace())
        trainer.train()
    return sorted(str(Path(path).relative_to(ROOT)) for path in seen)


def main() -> None:
    counts = static_counts()
    if "--step" in sys.argv:
        files = step_files()
        print("\n".join(files))
        counts["files_the_step_visits"] = len(files)
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
