"""Shared pytest set-up."""
import os

# Tests run several ranks in one process on one GPU, each rank with two streams (the
# GPU-direct side stream) whose kernels spin until the other ranks' streams make progress.
# With CUDA's default of 8 hardware queues, streams share queues, and a spinning kernel can
# hold back a launch queued behind it on another stream. Set before CUDA starts.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def emunic_host(tmp_path_factory):
    """(root, env): one GB10 host behind the emulated RoCE NIC (tests/emunic) for the whole
    session. Processes started with ``env`` run ``transport="verbs"`` through it; a test
    process that drives verbs itself sets ``env`` in its own environment (the emulated NIC
    reads its configuration once per process)."""
    import emunic
    root = tmp_path_factory.mktemp("emunic-host")
    return root, emunic.host_env(root)


@pytest.fixture
def emunic_env(emunic_host):
    return dict(emunic_host[1])
