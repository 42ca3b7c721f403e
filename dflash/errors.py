"""The one error type for user mistakes and bad input, shared by every command.

A `DflashError` message is one line that names the problem and the fix. Library code raises
it (or a subclass); every console entry point catches it, prints ``<command>: error: <message>``
on stderr and exits with `exit_code`. Internal invariants use `assert`, never this class.
This module imports nothing heavy: preflight (no torch) and the trainer both use it.
"""

from __future__ import annotations


class DflashError(ValueError):
    """Bad input or a state the user must fix; the message is one line. Subclasses set exit_code."""

    exit_code = 1

    def one_line(self) -> str:
        return " ".join(str(self).split())


class UsageError(DflashError):
    """A command line that cannot work as given (exit 2, like click's usage errors)."""

    exit_code = 2


def run_cli(command, prog: str, argv: list[str] | None = None) -> None:
    """Run a click command as a console entry point: every user error is one line, never a traceback.

    DflashError -> `prog: error: message`, its exit_code; click usage errors -> exit 2;
    Ctrl-C outside the trainer's own handling -> exit 130.
    """
    import sys

    import click

    try:
        code = command.main(args=argv, prog_name=prog, standalone_mode=False)
    except click.exceptions.Exit as e:  # --help, --version
        sys.exit(e.exit_code)
    except (click.Abort, KeyboardInterrupt):
        click.echo(f"{prog}: aborted", err=True)
        sys.exit(130)
    except click.exceptions.NoArgsIsHelpError as e:  # a group called without its subcommand
        names = e.ctx.command.list_commands(e.ctx) if isinstance(e.ctx.command, click.Group) else []
        click.echo(f"{prog}: error: missing command" + (f"; give one of {', '.join(names)}" if names else "")
                   + f" (see {prog} --help)", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        click.echo(f"{prog}: error: {' '.join(e.format_message().split())}", err=True)
        sys.exit(e.exit_code)
    except DflashError as e:
        click.echo(f"{prog}: error: {e.one_line()}", err=True)
        sys.exit(e.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


def _click_error(e: DflashError):
    import click

    err = click.ClickException(e.one_line())
    err.exit_code = e.exit_code
    return err


def _command_classes():
    """click Command/Group classes whose commands turn a DflashError into a one-line click error (same exit code),
    so a command behaves the same under run_cli, click's standalone mode and click's test runner."""
    import click

    class Command(click.Command):
        def invoke(self, ctx):
            try:
                return super().invoke(ctx)
            except DflashError as e:
                raise _click_error(e) from None

    class Group(click.Group):
        command_class = Command

        def invoke(self, ctx):
            try:
                return super().invoke(ctx)
            except DflashError as e:
                raise _click_error(e) from None

    return Command, Group


Command, Group = _command_classes()
