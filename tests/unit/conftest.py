"""The unit tier shares one interpreter with the e2e tier (`pytest tests/unit tests/e2e`): a unit test that
calls product code which sets the driver's environment (ray.network_interface sets GLOO_SOCKET_IFNAME, the
auth check sets RAY_AUTH_MODE) must not change what the e2e runs after it inherit."""
import os

import pytest


@pytest.fixture(autouse=True)
def _environment_restored():
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)
