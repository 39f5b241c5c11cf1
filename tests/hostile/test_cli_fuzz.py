"""Hypothesis fuzz of the command line (issue #13): any argument ends in a clean exit code and a one-line message.

Runs the CLI in-process (typer's runner) for speed; the subprocess tests in test_cli_hostile.py
cover what a real terminal sees.
"""

from __future__ import annotations

from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from sparkqueue import Message, Namespace  # noqa: E402
from sparkqueue.cli.app import app  # noqa: E402

WORDS = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["nan", "inf", "-inf", "1e308", "-1", "0", str(2**64), "", "q", "$Default", "../x", "\x1b[31m"]),
)
COMMANDS = st.sampled_from(
    [
        ["create", "queue"],
        ["create", "topic"],
        ["peek"],
        ["receive"],
        ["show"],
        ["purge"],
        ["resubmit"],
        ["rule", "create", "t", "s"],
        ["rule", "list"],
        ["delete", "queue"],
    ]
)
FLAGS = st.sampled_from(
    ["--count", "--wait", "--lock-duration", "--ttl", "--duplicate-window", "--sql", "--from-sequence", "--batch", "--json"]
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("clifuzz") / "ns"
    with Namespace(path) as ns:
        ns.create_queue("q")
        ns.create_topic("t")
        ns.create_subscription("t", "s")
        ns.get_queue_sender("q").send_messages([Message("a"), Message("\x1b]8;;x\x1b\\b")])
    return str(path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=COMMANDS, words=st.lists(WORDS, max_size=3), flag=FLAGS, value=WORDS)
def test_any_arguments_end_cleanly(root: str, command: list[str], words: list[str], flag: str, value: str) -> None:
    args = ["--root", root, *command, *words, flag, *([] if flag == "--json" else [value])]
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 1, 2), (args, result.exit_code, result.output)
    # A clean error is a message, never an escaped exception or a traceback.
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, repr(result.exception))
    assert "Traceback" not in result.output
    with Namespace(Path(root)) as ns:  # nothing the fuzz did broke the namespace
        ns.list_queues()
