"""The embedded default, started once for every module in this folder: `prfaas up` on
deploy/local.yaml (the router, prefill-0 for the PrfaaS cluster, decode-0 for the local PD cluster,
SmolLM2), on free ports, with an API key from the environment (``PRFAAS_API_KEYS``, as an operator
sets it) and JSON logs at debug level (the request-id trace reads them). The modules here only send
requests to it, or put a router of their own in front of its workers (``Deployment.start_router``).

Its teardown is a test of its own: SIGTERM to `prfaas up` must end it with status 0 and leave no
process of any service behind."""
from __future__ import annotations

import pytest

from support.deployment import Deployment, wait_until
from support.embedded import API_KEY, embedded_default_on_free_ports
from support.procs import group_alive


@pytest.fixture(scope="package")
def embedded(tmp_path_factory):
    deployment = Deployment(embedded_default_on_free_ports(), tmp_path_factory.mktemp("embedded"), launcher="up",
                            env={"PRFAAS_API_KEYS": API_KEY}).start()
    try:
        yield deployment
    finally:
        pids = deployment.service_pids()
        deployment.stop()
    up = deployment.child("up").process
    assert up.returncode == 0, f"`prfaas up` exited with {up.returncode} on SIGTERM:\n{deployment.logs()}"
    assert set(pids) == {"prefill-0", "decode-0", "router"}
    assert wait_until(lambda: not any(group_alive(pid) for pid in pids.values()), timeout_s=10), \
        "a service's process group outlived `prfaas up`"
