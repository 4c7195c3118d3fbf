"""The server's JSON log handler writes to the stderr of the moment, not the one it was set up with."""
import io
import json
import logging
import sys

import pytest

from holoserve.server.logs import setup_logging

NAMES = ("holoserve", "uvicorn", "uvicorn.error", "uvicorn.access")


@pytest.fixture
def restore_loggers():
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate, lg.disabled) for lg in map(logging.getLogger, NAMES)]
    yield
    for lg, handlers, level, propagate, disabled in saved:
        lg.handlers[:], lg.level, lg.propagate, lg.disabled = handlers, level, propagate, disabled


def test_records_follow_a_stderr_swapped_in_after_setup(monkeypatch, restore_loggers):
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    setup_logging("info")
    first.close()  # the stream the handler was created under is gone, as a test runner's capture can be
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    logging.getLogger("holoserve").info("ready", extra={"port": 8080})
    record = json.loads(later.getvalue().strip().splitlines()[-1])
    assert (record["msg"], record["port"], record["level"]) == ("ready", 8080, "info")
