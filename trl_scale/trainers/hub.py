"""Model cards and Hub pushes, TRL's, with trl-scale's tag and features."""

from __future__ import annotations

import os

from .feature import Feature

TRL_SCALE_TAG = "trl-scale"


_CARD_KWARGS = ("language", "license", "finetuned_from", "tasks", "dataset_tags", "dataset", "dataset_args")


def _hub_error(trl, action: str, error: Exception) -> RuntimeError:
    return RuntimeError(
        f"{action} failed ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). Nothing "
        f"is lost: the model and checkpoints stay in output_dir={trl.args.output_dir!r}. Fix: log in "
        "(`hf auth login`) or set HF_TOKEN with write access, check hub_model_id, then call "
        "the trainer's push_to_hub() again"
    )


class ModelCard(Feature):
    """TRL's model card with trl-scale's tags (the method, the features used) and transformers' card kwargs
    (`language`, `license`, `finetuned_from`, ...), so `push_to_hub(license=...)` works as with any Trainer; Hub
    failures name what is kept and the fix."""

    name = "model_card"

    def init_hf_repo(self, run, proceed, token: str | None = None, private: bool | None = None):
        # transformers' signature: `push_to_hub(private=...)` on a run configured with push_to_hub=False calls it so
        try:
            return proceed(token=token, private=private)
        except Exception as error:  # before any training: say why, and how to fix it
            raise _hub_error(run.trl, "creating the Hub repo for push_to_hub=True", error) from error

    def push_to_hub(self, run, proceed, *args, **kwargs):
        try:
            return proceed(*args, **kwargs)
        except Exception as error:
            # The push can fail before its own save (creating the repo): save here, so the message below holds.
            run.trl.save_model(run.trl.args.output_dir)
            raise _hub_error(run.trl, "push_to_hub", error) from error

    def create_model_card(
        self,
        run,
        proceed,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        **kwargs,
    ) -> None:
        unknown = set(kwargs) - set(_CARD_KWARGS)
        if unknown:
            raise TypeError(f"create_model_card got unexpected arguments {sorted(unknown)}; known: {_CARD_KWARGS}")
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        features = run.trl.card_features()
        tags += [TRL_SCALE_TAG, *features]
        dataset_name = dataset_name or kwargs.get("dataset")
        proceed(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not run.trl.is_world_process_zero():
            return

        from huggingface_hub import ModelCard

        path = os.path.join(run.trl.args.output_dir, "README.md")
        if not os.path.exists(path):
            return
        card = ModelCard.load(path)
        if kwargs.get("language"):
            card.data.language = kwargs["language"]
        if kwargs.get("license"):
            card.data.license = kwargs["license"]
        if kwargs.get("finetuned_from"):
            card.data.base_model = kwargs["finetuned_from"]
        if kwargs.get("tasks"):
            card.data.pipeline_tag = kwargs["tasks"] if isinstance(kwargs["tasks"], str) else kwargs["tasks"][0]
        if kwargs.get("dataset_tags"):
            card.data.datasets = kwargs["dataset_tags"]
        card.text += (
            "\n## trl-scale\n\nTrained with [trl-scale](https://github.com/trl-scale/trl-scale), TRL's trainers made "
            f"to scale. Features used: {', '.join(features) or 'none'}.\n"
        )
        card.save(path)
