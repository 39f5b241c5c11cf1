"""Azurite, the Azure Storage emulator, for tests on a real object store: installed, started and stopped by fixtures.

Azurite comes from the npm registry; it is installed once under `.azurite/` in the repository
(ignored by git) and started on a free loopback port per test session. Each test gets a fresh
container, created with azure-storage-blob.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkqueue import Namespace

REPO = Path(__file__).resolve().parent.parent
INSTALL_DIR = REPO / ".azurite"
ACCOUNT = "devstoreaccount1"
# The emulator's fixed, publicly documented development key (not a secret).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURITE_VERSION = "3"


def azurite_binary() -> Path:
    """The azurite-blob executable, installed from npm into .azurite/ when absent."""
    binary = INSTALL_DIR / "node_modules" / ".bin" / "azurite-blob"
    INSTALL_DIR.mkdir(exist_ok=True)
    with open(INSTALL_DIR / ".install-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers install once, one at a time
        if not binary.exists():
            npm = shutil.which("npm")
            if npm is None:
                raise RuntimeError("npm is needed to install Azurite for the object-store tests")
            package = f"azurite@{AZURITE_VERSION}"
            cmd = [npm, "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(INSTALL_DIR), package]
            subprocess.run(cmd, check=True, timeout=600)
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Azurite:
    """A running Azurite blob service on loopback."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                str(azurite_binary()),
                "--silent",
                "--skipApiVersionCheck",
                "--loose",
                "--location",
                str(workdir),
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                str(self.port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        atexit.register(self.stop)  # also when the test run is interrupted
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"azurite exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError("azurite did not start within 60 s")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    def storage_options(self, key: str = KEY) -> dict[str, str]:
        """delta-rs / obstore options reaching this emulator."""
        return {
            "account_name": ACCOUNT,
            "account_key": key,
            "azure_storage_endpoint": self.endpoint,
            "allow_http": "true",
        }

    def create_container(self) -> str:
        """A fresh container; its name."""
        from azure.storage.blob import BlobServiceClient

        name = f"t{uuid.uuid4().hex[:20]}"
        conn = f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint={self.endpoint};"
        BlobServiceClient.from_connection_string(conn).create_container(name)
        return name

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)


@dataclass(frozen=True)
class Store:
    """A namespace location for tests that run on a local disk and on an object store alike."""

    kind: str
    root: str
    storage_options: dict[str, str] | None

    def open(self, **kwargs: Any) -> Namespace:
        return Namespace(self.root, storage_options=self.storage_options, **kwargs)
