"""`python -m sparkqueue.cli`: run the command line."""

from sparkqueue.cli.app import app

app(prog_name="sparkqueue")
