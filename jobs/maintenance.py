"""Maintenance job: compact, clean, checkpoint and vacuum every entity table of a namespace, once or on an interval.

Run: python -m jobs.maintenance [--config conf/sparkqueue.toml] [--root ./sparkqueue-data] [--interval 300]
    [--vacuum-retention-hours 1]

The namespace comes from --root, else from the configuration file's [namespace] section.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from datetime import timedelta
from pathlib import Path

from rich.console import Console
from rich.table import Table

if __package__ in (None, ""):  # run as a file: make `jobs` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jobs import common
from sparkqueue import Namespace
from sparkqueue.cli.render import console as make_console

log = logging.getLogger("jobs.maintenance")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_config_arg(p)
    p.add_argument("--root", help="namespace root, a local directory or object-store URI (default: namespace.root)")
    p.add_argument("--interval", type=float, default=0, help="seconds between runs; 0 runs once")
    p.add_argument("--runs", type=int, default=0, help="stop after this many runs (0: forever when --interval is set)")
    p.add_argument("--vacuum-retention-hours", type=float, default=1.0, help="keep unreferenced files this long")
    p.add_argument("--no-vacuum", action="store_true", help="skip vacuum")
    p.add_argument("-v", "--verbose", action="store_true", help="the library's log and full stack traces")
    return p.parse_args(argv)


def run_once(ns: Namespace, retention: timedelta, vacuum: bool, console: Console) -> None:
    """One maintenance pass over the namespace, reported as a table."""
    with console.status("maintaining entity tables"):
        reports = ns.run_maintenance(vacuum_retention=retention, vacuum=vacuum)
    t = Table(title=f"maintenance of {ns.root}")
    columns = ("entity", "files before", "files after", "compacted", "rows dropped", "skipped", "vacuumed", "checkpoint")
    for col in (*columns, "unavailable partitions"):
        t.add_column(col, justify="right")
    for name, r in reports.items():
        t.add_row(
            name,
            str(r.files_before),
            str(r.files_after),
            str(r.files_compacted),
            str(r.rows_dropped),
            str(r.compactions_skipped),
            str(r.vacuumed_files),
            str(r.checkpointed_version),
            ", ".join(map(str, sorted(r.unavailable_partitions))) or "-",
            style="red" if r.error or r.unavailable_partitions else None,
        )
    console.print(t)
    for name, r in reports.items():  # what went wrong, below the table (rich would cut it to a column's width)
        if r.error:
            console.print(f"{name}: maintenance failed: {r.error}", markup=False, highlight=False)
        for p, why in sorted(r.unavailable_partitions.items()):
            console.print(f"{name}: partition {p} left alone: {why}", markup=False, highlight=False)


def main(argv: list[str] | None = None) -> int:
    """Run maintenance once, or every --interval seconds."""
    args = parse_args(argv)
    common.setup_logging(args.verbose)
    console = make_console()
    with common.expected_failures(args.verbose):
        if args.interval < 0 or args.runs < 0:
            raise ValueError(f"--interval and --runs must not be negative, got {args.interval} and {args.runs}")
        if args.runs > 1 and args.interval == 0:
            raise ValueError(f"--runs {args.runs} needs --interval SECONDS between the runs")
        overrides = {"namespace.root": args.root} if args.root else {}
        cfg = common.load_config(args.config, overrides)
        retention = timedelta(hours=args.vacuum_retention_hours)
        runs = 0
        with common.namespace(cfg, create=False) as ns:  # a mistyped root is an error, not a new namespace
            while True:
                run_once(ns, retention, not args.no_vacuum, console)
                runs += 1
                if args.interval <= 0 or (args.runs and runs >= args.runs):
                    return 0
                time.sleep(args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
