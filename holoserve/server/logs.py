"""Structured logs: one JSON object per line on stderr (access lines carry the request id)."""
from __future__ import annotations

import json
import logging
import sys
import time

_STD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _STD and not k.startswith("_") and k != "color_message":
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever sys.stderr is when each record is written: a stream swapped in after set-up
    (an embedding application, a test runner's capture) gets the records, and a closed earlier one is never used."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(level: str = "info") -> None:
    """Route holoserve's and uvicorn's loggers through one JSON handler on stderr."""
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter())
    lvl = getattr(logging, level.upper(), logging.INFO)
    for name in ("holoserve", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(lvl)
        lg.propagate = False
    # uvicorn's own access log is replaced by holoserve.access (JSON, with request ids).
    logging.getLogger("uvicorn.access").disabled = True
