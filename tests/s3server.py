"""A real S3-protocol server on 127.0.0.1 for the tests: moto's server mode, in a subprocess.

This is how s3fs tests itself. The server speaks the S3 HTTP protocol; ckptd talks to it through
s3fs exactly as it would talk to AWS, with the endpoint and credentials in ``storage_options``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import boto3

# Distinctive, so tests can check that credentials never appear in status, errors or logs.
ACCESS_KEY = "ckptdtestkeyAKIA0000"
SECRET_KEY = "ckptd-test-secret-do-not-print-0000"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """One moto server process. ``stop()`` and ``start()`` again keep nothing: moto is in memory."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None

    def start(self) -> S3Server:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:  # the server has no way to announce readiness but answering
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                return self
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start on port {self.port}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=30)
            self._proc = None

    def options(self, endpoint: str | None = None) -> dict:
        """storage_options for s3fs."""
        return {
            "endpoint_url": endpoint or self.endpoint,
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "client_kwargs": {"region_name": "us-east-1"},
        }

    def client(self):
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def new_bucket(self) -> str:
        name = f"ckptd-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name
