"""Fixtures shared by several test files; factories and constants live in ``tests/support/``."""
import pytest

from services.cache_pool.pool import CachePool
from services.cache_pool.server import PoolIdentity, start_pool_server
from services.planner.inputs import load_plan_inputs
from services.planner.report import run_plan
from support.deployment import Deployment
from support.interrupt import stop_on_signals, stop_with_parent
from support.planner_inputs import CASE_STUDY


def pytest_configure(config):
    stop_on_signals()  # SIGTERM unwinds like Ctrl-C: every fixture's teardown stops what it started
    stop_with_parent()  # and a stopped `make test` sends pytest one


@pytest.fixture
def pool_server():
    """Starts in-process cache pool servers on port 0 (``server.port`` is the port each got) and stops
    them at the test's end. Arguments: the pool (an empty 1 MiB one by default), its name and cluster,
    then ``start_pool_server``'s options."""
    servers = []

    def start(pool: CachePool | None = None, name: str = "pool-t", cluster: str = "local", **options):
        server = start_pool_server(CachePool(1 << 20) if pool is None else pool, PoolIdentity(name, cluster),
                                   "127.0.0.1", 0, **options)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(0)


@pytest.fixture(scope="module")
def case():
    """The paper's case study (tests/data/case_study.yaml): its planner inputs and their plan."""
    inputs = load_plan_inputs(CASE_STUDY)
    return inputs, run_plan(inputs)


@pytest.fixture(scope="module")
def start_deployment(tmp_path_factory):
    """Starts a deployment of separate processes from a config dict, in a fresh directory named after
    ``name``; every deployment started this way stops at the module's end."""
    deployments = []

    def start(config: dict, name: str) -> Deployment:
        deployment = Deployment(config, tmp_path_factory.mktemp(name)).start()
        deployments.append(deployment)
        return deployment

    yield start
    for deployment in reversed(deployments):
        deployment.stop()
