"""Errors that are the user's to fix: the CLI prints their message and exits with code 2."""


class PlugtronError(Exception):
    """A mistake in what the user asked for; the message says what was wrong and what is allowed."""


class ConfigError(PlugtronError):
    """A flag, config-file value or combination of sizes that cannot run."""


class PluginError(PlugtronError):
    """A plugin that is unknown, broken, or that leaves a contract hook unimplemented."""


class CheckpointError(PlugtronError):
    """A checkpoint that is missing, incomplete or corrupt."""
