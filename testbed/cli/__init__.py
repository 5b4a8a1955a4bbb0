"""The `dualpath` command line: its commands live in this package's modules, one room per kind of work."""
from __future__ import annotations

import signal
import sys

import typer

from testbed.cli import live, calibrate, run, reproduce, sim  # noqa: F401  (each registers its commands, in --help's order)
from testbed.cli.shared import _on_signal, app


def main() -> None:
    signal.signal(signal.SIGTERM, _on_signal)
    # Ctrl-C must tear down even when started from a script in the background, where the
    # shell hands us SIGINT ignored (and Python then leaves it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from testbed.fabric.shell import CommandError

    # typer (pinned) vendors click; its usage errors would print a multi-line box
    from typer._click.exceptions import NoArgsIsHelpError, UsageError

    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as e:  # bare `dualpath`: the help
        typer.echo(e.ctx.get_help() if e.ctx else str(e))
        sys.exit(2)
    except UsageError as e:  # one line: the command and what was wrong
        cmd = (e.ctx.command_path if e.ctx else "dualpath").replace("python -m testbed.cli", "dualpath")
        typer.echo(f"{cmd}: {' '.join(e.format_message().split())} (see {cmd} --help)", err=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        typer.echo("dualpath: interrupted; torn down", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        typer.echo("dualpath: interrupted; torn down", err=True)
        sys.exit(130)
    except (CommandError, OSError, RuntimeError, TimeoutError, ValueError) as e:  # ProcessFailed too
        # Everything the run made is already torn down (context managers); say what failed.
        typer.echo(f"dualpath: error: {e}", err=True)
        sys.exit(1)
    if code == 130:  # typer turns KeyboardInterrupt (Ctrl-C, SIGTERM) into exit code 130 itself
        typer.echo("dualpath: interrupted; torn down", err=True)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
