"""Errors that are the user's to fix: a command ends on one with one line and exit status 2."""


class ConfigError(ValueError):
    """A user error in the config: the message names the key, the numbers and what to change."""
