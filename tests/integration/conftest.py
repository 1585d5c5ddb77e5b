from __future__ import annotations

import itertools
import os
import shutil

import pytest
import ray

import ckptd

_runs = itertools.count()


def start_ray(runtime_env: dict | None = None) -> None:
    """A real local Ray instance whose workers can import the tests package."""
    # Ray's worker processes inherit this environment: let them import tests.integration.helpers.
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env=runtime_env)


@pytest.fixture(scope="session")
def _ray_session():
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local(_ray_session):
    """A real local Ray instance, shared by the test modules that need no special runtime
    environment (starting one costs seconds); a module that needs another one shuts it down."""
    if not ray.is_initialized():
        start_ray()
    yield


@pytest.fixture
def run_name(request) -> str:
    return f"t{next(_runs)}-{os.getpid()}"


@pytest.fixture
def make_monitor(ray_local, tmp_path, run_name):
    """Start a monitor on a fresh root; kill it after the test."""
    handles = []

    def make(root: str | None = None, storage_options: dict | None = None, run: str | None = None, **options):
        handle = ckptd.start_monitor(root or str(tmp_path / "ckpt"), run=run or run_name,
                                     storage_options=storage_options, **options)
        handles.append(handle)
        return handle

    yield make
    for h in handles:
        ray.kill(h, no_restart=True)


@pytest.fixture(scope="module")
def shared_monitor(ray_local, tmp_path_factory, request):
    """One monitor for a module's tests (an actor costs seconds to start on a loaded machine),
    started with the module's ``SHARED_MONITOR_OPTIONS``; each test saves steps of its own under
    it (``env``). Killed, and its root removed (pytest keeps its last runs' directories), after."""
    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    base = tmp_path_factory.mktemp(name)
    root = str(base / "ckpt")
    monitor = ckptd.start_monitor(root, run=f"{name}-{os.getpid()}",
                                  **getattr(request.module, "SHARED_MONITOR_OPTIONS", {}))
    yield root, monitor
    ray.kill(monitor, no_restart=True)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def shared_run(shared_monitor) -> str:
    """The run name of the module's shared monitor, for what finds it by run (a subscriber, a
    coordinator in another process)."""
    return ray.get(shared_monitor[1].worker_config.remote())["run"]


@pytest.fixture
def env(shared_monitor):
    """A test's own block of steps on its module's shared monitor (see ``helpers.Env``)."""
    from .helpers import Env

    return Env.next_block(*shared_monitor)

