"""`python -m sparkqueue`: run the command line (as `python -m sparkqueue.cli` does)."""

from sparkqueue.cli.app import app

app(prog_name="sparkqueue")
