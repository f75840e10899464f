"""Keep query strings (``?api_key=``) out of uvicorn's log lines.

uvicorn's access log (``"%s - "%s %s HTTP/%s" %d"``) and its WebSocket lines on
``uvicorn.error`` (``'%s - "WebSocket %s" [accepted]'``) pass the request path *with*
its query string as a log argument (``uvicorn.protocols.utils.get_path_with_query_string``).
Browser WebSockets send the API key as ``?api_key=KEY``, so a filter on uvicorn's
handlers cuts the query from every path argument before the line is formatted.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from uvicorn.config import LOGGING_CONFIG


def _without_query(arg: object) -> object:
    if isinstance(arg, str) and arg.startswith("/") and "?" in arg:
        return arg.split("?", 1)[0]
    return arg


class DropQueryString(logging.Filter):
    """A handler filter: request paths in a record's arguments lose their query string."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_without_query(a) for a in record.args)
        return True


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's default ``log_config`` with :class:`DropQueryString` on both of its handlers."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["drop_query"] = {"()": f"{__name__}.DropQueryString"}
    for handler in config["handlers"].values():
        handler.setdefault("filters", []).append("drop_query")
    return config
