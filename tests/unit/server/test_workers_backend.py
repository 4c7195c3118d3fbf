"""`serve --workers N` chooses the backend once, before the workers start: every worker serves the same one
and reports the same reason (holoserve/server/backend_choice.py)."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.helpers.serving import make_tiny_checkpoint, serve_subprocess

pytest.importorskip("openvino")


@pytest.fixture(scope="module")
def two_targets(tmp_path_factory):
    """A tiny checkpoint exported for both CPU backends, so `auto` has a real choice to make."""
    from holoserve.export.onnx_export import export_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("two-targets"), "sst2")
    export_checkpoint(ckpt, ("openvino",), polygraphy=False, progress=False, check_predictions=False)
    return ckpt


def test_every_worker_serves_the_backend_chosen_once(two_targets, monkeypatch):
    monkeypatch.delenv("HOLOSERVE_BACKEND", raising=False)
    with serve_subprocess([str(two_targets), "--workers", "2", "--threads", "1", "--no-access-log"],
                          timeout=180) as (url, proc):
        seen: dict[str, dict] = {}
        deadline = time.monotonic() + 60
        while len(seen) < 2:  # new connections land on either worker; ask until both answered
            assert time.monotonic() < deadline, f"only {len(seen)} worker(s) answered"
            r = httpx.get(url + "/v1/models", timeout=10, headers={"connection": "close"})
            if r.status_code == 200:
                seen[r.headers["x-request-id"][:12]] = r.json()["models"][0]["backend"]
        (a, b) = seen.values()
        assert a["backend"] == b["backend"]
        assert a["backend"] in ("openvino", "onnxruntime", "onnxruntime+openvino", "openvino+onnxruntime")
        assert a["selection"] == b["selection"]
        assert a["selection"].startswith("chosen once for all 2 workers before they started: "), a["selection"]
        if "routing" in a:
            assert a["routing"] == b["routing"] | {"runs": a["routing"]["runs"]}
        if "openvino" in a["backend"]:
            assert a["kernels"]["status"].split(" ")[0] == b["kernels"]["status"].split(" ")[0]
