"""Shared fixtures: a fresh namespace per test, in pytest's tmp_path, backed by real Delta tables."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from azurite import ACCOUNT, KEY, Azurite, Store
from hypothesis import settings

from sparkqueue import Namespace

# Fuzz tests draw fresh random examples on a developer's machine (new inputs every run) and a fixed
# sequence of examples in CI (CI=true), so a landing run fails only on a change, never on a new draw.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked slow unless SPARKQUEUE_SLOW=1 or `-m` selects them (see the marker in pyproject.toml)."""
    if os.environ.get("SPARKQUEUE_SLOW") == "1" or "slow" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="slow: set SPARKQUEUE_SLOW=1 to run")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture
def root(tmp_path: Path) -> str:
    """Root directory of a fresh namespace."""
    return str(tmp_path / "ns")


@pytest.fixture
def ns(root: str) -> Iterator[Namespace]:
    """A fresh standard-tier namespace."""
    with Namespace(root) as namespace:
        yield namespace


@pytest.fixture
def premium_ns(tmp_path: Path) -> Iterator[Namespace]:
    """A fresh premium-tier namespace."""
    with Namespace(tmp_path / "premium", tier="premium") as namespace:
        yield namespace


# ---- object store (Azurite) ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One Azurite blob service for the session (installed from npm on first use)."""

    server = Azurite(tmp_path_factory.mktemp("azurite"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["local", "azure"])
def store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    """A fresh namespace location: a local directory, then an Azurite container.

    For Azure the store's usual environment variables are set too, so child processes that open
    `Namespace(root)` with no storage options reach the same container.
    """
    if request.param == "local":
        return Store("local", str(tmp_path / "ns"), None)
    server = request.getfixturevalue("azurite")

    for name, value in {
        "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
        "AZURE_STORAGE_ACCOUNT_KEY": KEY,
        "AZURE_STORAGE_ENDPOINT": server.endpoint,
        "AZURE_ALLOW_HTTP": "true",
    }.items():
        monkeypatch.setenv(name, value)
    return Store("azure", f"az://{server.create_container()}/ns", server.storage_options())
