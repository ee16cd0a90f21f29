"""User mistakes become a message and exit code 2, never a traceback."""

from __future__ import annotations

import functools

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
        try:
            return func(*args, **kwargs)
        except PlugtronError as exc:
            raise UserError(str(exc)) from None

    return wrapper
