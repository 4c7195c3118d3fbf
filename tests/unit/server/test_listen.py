"""`holoserve serve` checks that it can listen on --host:--port before it loads the model, and says how to
fix it where it cannot (holoserve.server.connections.check_listen)."""
from __future__ import annotations

import socket

import pytest

from holoserve.cli import main


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if serve gets as far as reading the checkpoint."""
    import holoserve.core.artifact as artifact

    def refuse(*args, **kwargs):
        raise AssertionError("serve read the checkpoint before it checked the address")

    monkeypatch.setattr(artifact, "load_artifact", refuse)


def test_a_taken_port_fails_before_the_model_loads(sst2, no_model_load, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(sst2), "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot listen on 127.0.0.1:{port}: address already in use" in err, err
    assert "another --port (HOLOSERVE_PORT)" in err and "Traceback" not in err


@pytest.mark.parametrize("host, says", [("nohost.invalid", "is not an address"),
                                        ("192.0.2.1", "is not an address of this machine")])
def test_a_host_that_is_not_this_machines_fails_with_the_fix(sst2, no_model_load, capsys, host, says):
    assert main(["serve", str(sst2), "--host", host, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot listen on {host}:0: " in err and says in err and "0.0.0.0" in err, err
