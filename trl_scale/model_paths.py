"""Model references checked before transformers reads them: a local path that does not exist would otherwise be
taken for a Hub id and fail with "Repo id must use alphanumeric chars" (or a network error), blaming the Hub."""

from __future__ import annotations

import os
import re

# A Hub id: `name` or `org/name`, letters, digits, `-`, `_`, `.` (huggingface_hub's validate_repo_id).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def check_model_path(value, field: str) -> None:
    """Raise when ``value`` (a string or path naming a model) is meant as a local path that does not exist: it
    starts like a path (``/``, ``./``, ``../``, ``~``), has more than one ``/``, or cannot be a Hub id. Other strings
    (``gpt2``, ``org/name``) go to transformers as Hub ids; models and other objects are not checked."""
    if not isinstance(value, (str, os.PathLike)):
        return
    text = os.fspath(value)
    if text.startswith("toy:") or os.path.exists(os.path.expanduser(text)):
        return
    if text.startswith(("/", ".", "~")) or "\\" in text or not _HUB_ID.match(text):
        resolved = os.path.abspath(os.path.expanduser(text))
        raise ValueError(
            f"{field}={text!r}: no such directory ({resolved} does not exist), and it is not a Hub model id. Fix: "
            "pass the directory the model was saved to with save_pretrained (check the path and the working "
            "directory), or a Hub id such as 'org/name'"
        )
