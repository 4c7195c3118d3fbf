"""The Docker engine and the test image, once for every container test (tests/helpers/containers.py)."""
from __future__ import annotations

import pytest

from tests.helpers.containers import Docker, build_image, find_docker


@pytest.fixture(scope="session")
def docker() -> Docker:
    return find_docker()


@pytest.fixture(scope="session")
def image(docker: Docker) -> dict:
    return build_image(docker)
