"""Errors that are the user's to fix. The library raises them; a command (maxlm/cli.py) ends on
one with one line on stderr and exit status 2, no traceback."""


class UserError(ValueError):
    """Bad input the user can correct: the message names what is wrong and what to change."""


class ConfigError(UserError):
    """A user error in the config: the message names the key, the numbers and what to change."""
