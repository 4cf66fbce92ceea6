"""Filters on Ray Serve's logger, installed alike in the ingress, proxy and replicas."""

from __future__ import annotations

import logging

SERVE_LOGGER = "ray.serve"  # ray.serve._private.constants.SERVE_LOGGER_NAME


def install_log_filters(filters: tuple[logging.Filter, ...]) -> None:
    """Adds each filter to Serve's logger of this process unless one of its type is there.
    A filter on the logger (not its handlers) survives Serve reconfiguring the handlers."""
    logger = logging.getLogger(SERVE_LOGGER)
    for f in filters:
        if not any(type(g) is type(f) for g in logger.filters):
            logger.addFilter(f)
