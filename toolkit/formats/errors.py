"""The one exception type for bad user input.

A ``UserError`` carries a single line that says what is wrong and what to do. The CLI prints it
as ``error: <line>`` and exits with code 2; nothing is written half (callers raise before writing
or write atomically).
"""


class UserError(Exception):
    """Bad input from the user: one clear line, exit code 2."""

    exit_code = 2


def unknown(kind: str, name: str, available) -> UserError:
    """Registry-style error: ``Unknown task 'x'. Available: a, b, c.``"""
    return UserError(f"Unknown {kind} '{name}'. Available: {', '.join(sorted(available))}.")
