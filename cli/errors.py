"""User mistakes become a message and exit code 2, never a traceback."""

from __future__ import annotations

import functools
import sys

import click
from plugtron.core.errors import PlugtronError


class UserError(click.ClickException):
    exit_code = 2

    def format_message(self) -> str:
        return self.message


def user_errors(func):
    """Turn the core's ``PlugtronError`` into a clean exit 2."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        from .launch import JobStopped, RankFailure

        try:
            return func(*args, **kwargs)
        except PlugtronError as exc:
            raise UserError(str(exc)) from None
        except JobStopped as exc:  # a clean stop: one line, the documented code (README)
            click.echo(str(exc))
            sys.exit(exc.code)
        except RankFailure as exc:
            click.echo(f"Error: {exc}", err=True)
            sys.exit(1)

    return wrapper
