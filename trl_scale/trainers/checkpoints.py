"""Checkpoints that survive a failed save, and exact resume inside a rollout window."""

from __future__ import annotations

import os

from .feature import Feature
from .feature_state import STATE_NAME, saved_ranks


def check_stream_group_size(state: dict, num_generations: int, path: str) -> None:
    """A streaming checkpoint's read-ahead prompt groups are cut at the run's `num_generations`. Resumed with
    another, they would be trained as groups of the new size: rows of different prompts normalised as one group,
    some rows trained twice. Refused, naming both sizes and the ways out."""
    saved = state.get("group_size")
    if saved is None and state.get("rows"):  # a checkpoint of an earlier trl-scale: its groups' own size
        saved = len(state["rows"][0])
    if saved is None or saved == num_generations:
        return
    raise ValueError(
        f"{path} holds {len(state.get('rows', []))} prompt group(s) a streaming run read ahead with "
        f"num_generations={saved}; this run has num_generations={num_generations}, and would train them as groups "
        f"of {num_generations} (rows of different prompts normalised together). The checkpoint is intact. Fix: "
        f"resume with num_generations={saved}, or delete {path} to resume without them (the run then reads its data "
        "from the checkpoint's step, as a synchronous resume does)"
    )


def check_same_processes(checkpoint: str, saved: int, num_processes: int, name: str = STATE_NAME) -> None:
    """A checkpoint saved inside a rollout window holds one rollout per process. Resumed on another number of
    processes, some ranks would have a rollout and others would generate, and TRL's cross-rank gathers would not
    match (a hang or wrong numbers): refuse it on every rank (each reads the same folder), naming the fixes."""
    if saved and saved != num_processes:
        raise ValueError(
            f"{checkpoint} was saved inside a rollout window by {saved} process(es), with each one's rollout "
            f"({name.format(rank='N')}); this run has {num_processes}. Nothing was trained, and the checkpoint is "
            f"intact. Fix: resume with {saved} process(es) for an exact continuation, or delete the "
            f"{name.format(rank='*')} files in it to start a new rollout there (as TRL resumes; not exact), or resume "
            "from a checkpoint saved at a window boundary"
        )


class SafeCheckpoint(Feature):
    """A checkpoint save that fails (disk full, quota, a dropped network mount) removes its partial folder, so that
    `resume_from_checkpoint=True` picks the last complete checkpoint instead of a broken one, and says so."""

    name = "safe_checkpoint"

    def save_checkpoint(self, run, proceed, model, trial):
        import shutil

        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

        run_dir = run.trl.output_dir(trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{run.trl.state.global_step}")
        existed = os.path.isdir(folder)
        try:
            return proceed(model, trial)
        except OSError as error:
            if not existed and run.trl.args.should_save:
                shutil.rmtree(folder, ignore_errors=True)
            last = get_last_checkpoint(run_dir) if os.path.isdir(run_dir) else None
            raise OSError(
                error.errno,
                f"saving {folder} failed ({error.strerror or error}); the partial checkpoint was removed, and the "
                f"last complete one is {last or 'none'}. Fix: free space under {run_dir}, then train again with "
                "resume_from_checkpoint=True",
            ) from error


class RolloutResume(Feature):
    """Checkpoints carry the rollout being trained on; a resume inside the window trains on it."""

    name = "rollout_resume"

    def state_dict(self, run) -> dict | None:
        """The rollout being trained on (every data-parallel rank its own): a checkpoint inside a generation window
        (`steps_per_generation` x `num_iterations` > 1, or PPO's epochs x mini-batches) then resumes on the same
        rollout, where TRL would sample a new one and diverge from the uninterrupted run."""
        if run.trl.buffered_inputs is None:
            return None
        window = dict(run.plan.generation_window)
        return {"step": run.trl.buffer_step, "inputs": run.trl.buffered_inputs, "window": window}

    def load_state_dict(self, run, state: dict, path: str) -> None:
        from accelerate.utils import send_to_device

        checkpoint = os.path.dirname(path)
        check_same_processes(checkpoint, saved_ranks(checkpoint), run.trl.accelerator.num_processes)
        saved, now = state.get("window"), dict(run.plan.generation_window)
        if saved is not None and saved != now:  # TRL indexes the buffer by step modulo its own window
            differ = ", ".join(f"{name}={saved[name]} (now {now[name]})" for name in saved if saved[name] != now[name])
            raise ValueError(
                f"{checkpoint} was saved inside a rollout window of {differ}: the rollout it carries is cut for that "
                "window, and this run would read it by another. Fix: resume with the saved values, or from a "
                "checkpoint saved at a window's end (global_step a multiple of steps_per_generation)"
            )
        run.trl.restore_buffered_inputs(state["step"], send_to_device(state["inputs"], run.trl.accelerator.device))
