"""The plugin's logger: vLLM's logger when vLLM is importable, else the standard one."""

from __future__ import annotations

import logging

LOGGER_NAME = "vllm.hybrid_backends"


def _make_logger() -> logging.Logger:
    try:
        from vllm.logger import init_logger

        return init_logger(LOGGER_NAME)
    except Exception:
        return logging.getLogger(LOGGER_NAME)


logger = _make_logger()
