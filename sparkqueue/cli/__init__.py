"""The `sparkqueue` command line (typer + rich); `app` is the console-script entry point, `python -m sparkqueue.cli` runs it."""

from sparkqueue.cli.app import app

__all__ = ["app"]
