"""What a trl-scale trainer checks and rewrites while TRL's constructor runs: the arguments as TRL would bind them,
config fields set around it, bad input refused early with the fix, and the configs' docstrings."""

from __future__ import annotations

import functools
import inspect
import os
from contextlib import contextmanager

from ..model_paths import check_model_path


def config_docstring(method: str, *sections) -> str:
    """A trl-scale config's docstring, TRL's style: the header, TRL's own docstring of the config (its fields, so
    `help(GRPOConfig)` documents them as TRL does), then each trl-scale field mixin's section."""
    import trl

    header = (
        f"\n    Configuration class for [`trl_scale.{method}Trainer`]: every field of [`trl.{method}Config`], "
        "unchanged, plus trl-scale's (at the end).\n"
    )
    trl_doc = getattr(trl, f"{method}Config").__doc__ or ""
    return header + trl_doc + "\n    > trl-scale\n" + "".join(section.FIELDS_DOC for section in sections)


@contextmanager
def overridden(config, **values):
    """Set `config` fields while TRL's constructor reads them, and restore them afterwards, even on error."""
    if config is None:
        yield
        return
    saved = {name: getattr(config, name) for name in values}
    for name, value in values.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def trl_base_class(trainer) -> type:
    """The TRL trainer class a trl-scale trainer extends (the first of TRL's in its MRO)."""
    return next(c for c in type(trainer).__mro__ if c.__module__.startswith("trl."))


def trl_arguments(trainer, args: tuple, kwargs: dict) -> dict:
    """A trl-scale trainer's constructor arguments by name, bound to the signature of the TRL trainer it extends
    (positional or keyword, TRL's defaults applied), so every call TRL accepts is accepted and passed on unchanged."""
    bound = inspect.signature(trl_base_class(trainer).__init__).bind(trainer, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(arguments)))  # self
    return arguments


def check_output_dir(config) -> None:
    """Fail at construction, not at the first checkpoint an hour in, when `output_dir` cannot be written."""
    if config is None or not getattr(config, "output_dir", None):
        return
    path = config.output_dir
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".trl-scale-write-check-{os.getpid()}")
        with open(probe, "w") as handle:
            handle.write("ok")
        os.remove(probe)
    except OSError as error:
        raise ValueError(
            f"output_dir={path!r} is not writable ({type(error).__name__}: {error}). Fix: set output_dir to a "
            "directory this process can create and write (checkpoints, the model and its card go there)."
        ) from error


def check_model_arguments(arguments: dict) -> None:
    """The model, reference and reward-model paths of a trainer's arguments, each checked where it names a local
    directory that does not exist (:func:`..model_paths.check_model_path`)."""
    for name in ("model", "ref_model", "value_model"):
        check_model_path(arguments.get(name), name)
    rewards = arguments.get("reward_funcs")
    for index, reward in enumerate(rewards if isinstance(rewards, list) else [rewards]):
        check_model_path(reward, "reward_funcs" if not isinstance(rewards, list) else f"reward_funcs[{index}]")


def check_train_dataset(dataset, required: tuple[str, ...], trainer_name: str) -> None:
    """Fail at construction when the training data cannot work: no rows, or a column the trainer reads is missing."""
    if dataset is None:
        return
    try:
        size = len(dataset)
    except TypeError:  # an IterableDataset: no length to check
        size = None
    if size == 0:
        raise ValueError(
            f"train_dataset is empty: {trainer_name} has nothing to train on. Fix: pass a dataset with rows"
        )
    columns = getattr(dataset, "column_names", None)
    if columns is None or isinstance(columns, dict):  # unknown (streaming) or a DatasetDict passed by mistake
        if isinstance(columns, dict):
            raise ValueError(
                f"train_dataset is a DatasetDict with splits {sorted(columns)}; pass one split, e.g. dataset['train']"
            )
        return
    missing = [name for name in required if name not in columns]
    if missing:
        raise ValueError(
            f"train_dataset has no column {missing[0]!r}, which {trainer_name} reads (columns: {columns}). Fix: "
            f"rename yours with dataset.rename_column(OLD, {missing[0]!r})"
        )


def check_tool_prompts(arguments: dict) -> None:
    """Tools (TRL's `tools=`) are offered through the chat template, so TRL needs conversational prompts; plain text
    failed at the first step in TRL (`'str' object has no attribute 'get'`)."""
    if not arguments.get("tools"):
        return
    dataset = arguments.get("train_dataset")
    columns = getattr(dataset, "column_names", None)
    if not isinstance(columns, list) or "prompt" not in columns or not len(dataset):
        return
    prompt = dataset[0]["prompt"]
    if isinstance(prompt, str):
        raise ValueError(
            f"tools= needs conversational prompts (lists of messages): TRL offers the tools through the chat "
            f"template, and train_dataset's prompts are text (row 0: {prompt[:60]!r}). Fix: dataset.map(lambda row: "
            "{'prompt': [{'role': 'user', 'content': row['prompt']}]})"
        )


def image_columns(*datasets) -> list[str]:
    """The image columns TRL reads ("image", "images") found in these datasets (or dicts of eval datasets)."""
    found = set()
    for dataset in datasets:
        for part in dataset.values() if isinstance(dataset, dict) else [dataset]:
            found |= set(getattr(part, "column_names", None) or []) & {"image", "images"}
    return sorted(found)


def names_vision_language(arguments: dict) -> bool:
    """Whether the trainer's arguments name a vision-language policy: its processing class is a processor, or (none
    given: TRL loads the model's) its config has a vision tower."""
    from transformers import ProcessorMixin

    if arguments.get("processing_class") is not None:
        return isinstance(arguments["processing_class"], ProcessorMixin)
    config = policy_config(arguments)
    return config is not None and getattr(config, "vision_config", None) is not None


def policy_config(arguments: dict):
    """The policy's config (the model object's, or read from its path), or None where it cannot be read (TRL's
    constructor then says what is wrong with the model)."""
    from transformers import AutoConfig

    model = arguments.get("model")
    try:
        return model.config if hasattr(model, "config") else AutoConfig.from_pretrained(model)
    except (OSError, ValueError, TypeError):
        return None


def check_image_inputs(arguments: dict, columns: list[str], vision_language: bool | None) -> None:
    """Datasets with image columns, checked before TRL's constructor (each failed deep in TRL's step before): a
    text-only policy (`vision_language`, as the plan found it), rows whose image is missing (None), and pan-and-scan
    crops TRL's scoring cannot take."""
    if not columns:
        return
    if not vision_language:
        raise ValueError(
            f"this dataset has image columns {columns}, but the policy is text-only (its processing class is a "
            "tokenizer, or its config has no vision tower): TRL would hand the images to the tokenizer (KeyError: "
            "'pixel_values' at the first step). Fix: drop the image columns (dataset.remove_columns(...)), or "
            "train a vision-language model with its processor as processing_class"
        )
    for name in ("train_dataset", "eval_dataset"):
        for part, label in _named_parts(arguments.get(name), name):
            for column in set(columns) & set(getattr(part, "column_names", None) or []):
                missing = _missing_images(part, column)
                if missing:
                    raise ValueError(
                        f"{label}'s column {column!r} has {missing} row(s) without an image (None): TRL cannot "
                        "build their prompts (a TypeError in its step). Fix: drop them "
                        f"(dataset.filter(lambda row: row[{column!r}] is not None)), or give each row its image"
                    )
    image_processor = getattr(arguments.get("processing_class"), "image_processor", None)
    if getattr(image_processor, "do_pan_and_scan", False):
        raise ValueError(
            "the processor's image processor has do_pan_and_scan=True: it cuts images into crops whose count "
            "(num_crops) TRL's scoring does not take (a TypeError at the first step). Fix: "
            "processor.image_processor.do_pan_and_scan = False"
        )


def _named_parts(dataset, name: str):
    if isinstance(dataset, dict):
        return [(part, f"{name}[{key!r}]") for key, part in dataset.items()]
    return [(dataset, name)] if dataset is not None else []


def _missing_images(dataset, column: str) -> int:
    """Rows of an Arrow-backed dataset whose image (or list of images) is None, counted from the Arrow column (no
    image decoded; `datasets` cannot store None inside a list of images); 0 for other datasets."""
    data = getattr(dataset, "data", None)
    return data.column(column).null_count if hasattr(data, "column") else 0


def with_signature_of(trl_init):
    """Give a trl-scale constructor the signature of the TRL constructor it accepts (see `trl_arguments`), so
    `inspect.signature`, IDEs and `help()` show TRL's parameters."""

    def decorate(init):
        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)

        __init__.__signature__ = inspect.signature(trl_init)
        return __init__

    return decorate


def remote_reward_funcs(reward_funcs, args):
    """Replace each reward model in `reward_funcs` (path or object) by a function served by the reward group (the
    caller asks only with backend='ray'); callables stay in the trainer's process."""
    if reward_funcs is None:
        return reward_funcs
    from torch import nn

    from ..distributed.roles import start_reward_model

    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    return [start_reward_model(f, args) if isinstance(f, (str, nn.Module)) else f for f in funcs]
