"""The one error type for user mistakes, shared by every entry point."""


class UserError(ValueError):
    """Bad input from the user: the message names the field, the value and what to do.

    Entry points catch it, print the message without a traceback and exit with status 2.
    """

    exit_code = 2
