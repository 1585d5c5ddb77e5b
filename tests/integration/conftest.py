from __future__ import annotations

import itertools
import os

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
