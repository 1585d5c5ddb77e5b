"""Every test runs offline (models and tokenizers are built in code, never downloaded), and tests
of object storage run against a real S3-protocol server on 127.0.0.1."""

import os

import pytest

from tests.s3server import S3Server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


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
