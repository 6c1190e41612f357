"""Rank-aware logging: trl-scale's warnings and infos print once per run, on the main process, not once per rank.

`get_logger(__name__)` gives the module's standard logger (`trl_scale.<module>`, as before: handlers, levels and
pytest's caplog apply) behind an adapter that drops records on other ranks; `all_ranks=True` keeps a record on every
rank (a rank-specific fault). Errors are raised, not logged, so nothing a rank must say is lost. Importing this costs
nothing: no torch or transformers (the CLI's `--help` and `check-servers` stay light).
"""

from __future__ import annotations

import logging

from .ranks import is_main_process


class _MainProcessLogger(logging.LoggerAdapter):
    def log(self, level, msg, *args, all_ranks: bool = False, **kwargs):
        if all_ranks or is_main_process():
            self.logger.log(level, msg, *args, **kwargs)

    # LoggerAdapter's level methods call `self.log`; `process` would only add `extra`.
    def process(self, msg, kwargs):
        return msg, kwargs


def get_logger(name: str) -> logging.LoggerAdapter:
    return _MainProcessLogger(logging.getLogger(name), {})
