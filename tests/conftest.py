"""Every test runs offline (models and tokenizers are built in code, never downloaded), and tests
of object storage run against a real S3-protocol server on 127.0.0.1."""

import os

import pytest

from tests.s3server import S3Server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Ray's log monitor looks for new worker log files every 0.1 s while a node has fewer than this
# many: 2 % of a core per local Ray instance over a run, on a machine the suite keeps busy. At 0
# it looks every 0.5 s (Ray's LOG_NAME_UPDATE_INTERVAL_S) and still forwards worker output:
# about 1 % (measured 2026-11-27). Every Ray the tests start inherits it, here or in a subprocess.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")


#: The files that keep one worker busy longest (their tests' seconds summed, from ``--durations=0``
#: in a full run of 2026-11-29 on a loaded machine, 38 min), longest first, but one. pytest-xdist hands
#: files out in collection order, so these go first: left where their names put them, two workers
#: finished 50 s before the third, which ran the last two of them alone. A file not listed keeps its
#: place after these.
LONGEST_FILES = (
    "test_fenced_idle_monitor.py",  # 285 s
    "test_invariants_session18.py",  # 248 s
    "test_writer_process_cache.py",  # 223 s
    # 605 s, yet not among the first three: those start while every worker starts its own Ray, and
    # its script's two Ray nodes then start slowest (a raylet failed to start once under that load).
    "test_deploy.py",
    "test_demo.py",  # 234 s
    "test_invariants_session20.py",  # 188 s
    "test_invariants_session19.py",  # 178 s
    "test_invariants_session16.py",  # 170 s
    "test_docs.py",  # 159 s
    "test_invariants_session18b.py",  # 157 s
    "test_fsdp.py",  # 156 s
    "test_faults.py",  # 151 s
)


def pytest_collection_modifyitems(config, items):
    """The longest files first (``LONGEST_FILES``); the rest in collection order (a stable sort).
    Every xdist worker sorts its collection the same way, as the controller requires."""
    first = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-protocol server (moto) on 127.0.0.1, shared by the whole session."""
    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture
def s3_root(s3_server) -> tuple[str, dict]:
    """A fresh bucket: the root URL and its storage_options."""
    return f"s3://{s3_server.new_bucket()}/run", s3_server.options()
