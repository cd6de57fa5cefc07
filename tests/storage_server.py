"""A real local S3 for the storage tests: moto's server in its own process, on 127.0.0.1, on a free port.

    from storage_server import s3_server, s3_url      # noqa: F401 (pytest finds the fixtures by name)

    def test_x(s3_url):                  # "s3://ddpkit-test/run", the bucket empty, the env pointing at it
        ...

The server starts once per test session (about a second) and is reset between tests (moto's
``/moto-api/reset``), so each test sees an empty store. Its process can be paused and resumed
(SIGSTOP/SIGCONT) to play a store that stops answering for a while. Credentials are fake;
``AWS_ENDPOINT_URL`` points the S3 client at the server, as it does for any S3-compatible store.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest

BUCKET = "ddpkit-test"
_SERVE = (
    "import sys, threading\n"
    "from moto.server import ThreadedMotoServer\n"
    "server = ThreadedMotoServer('127.0.0.1', 0, verbose=False)\n"
    "server.start()\n"
    "print(server.get_host_and_port()[1], flush=True)\n"
    "sys.stdin.read()\n"  # until the test session closes the pipe
)


class S3Server:
    """moto's S3 in a child process; ``endpoint`` is its ``http://127.0.0.1:PORT``."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        port = self.proc.stdout.readline().strip()
        if not port:
            raise RuntimeError("moto's server did not start (is moto[server] installed? pip install -e '.[test]')")
        self.endpoint = f"http://127.0.0.1:{int(port)}"

    def env(self) -> dict[str, str]:
        """The variables an S3 client (boto, s3fs) reads: this endpoint and fake credentials."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def reset(self) -> None:
        """Forget every bucket and object, then create the empty test bucket."""
        self.resume()
        urllib.request.urlopen(
            urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST"), timeout=10
        ).read()
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/{BUCKET}", method="PUT"), timeout=10).read()

    def pause(self) -> None:
        """The store stops answering (connections hang) until :meth:`resume`."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://ddpkit-test/run`` on a freshly reset server, with the environment pointing at it."""
    s3_server.reset()
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return f"s3://{BUCKET}/run"
