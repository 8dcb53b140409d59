"""One error type and the exit codes every command shares.

The CLI maps a :class:`ParityError` to a one-line message on stderr and its exit code; anything
else that escapes is a bug in parity. The codes are documented in the README.
"""

EXIT_OK = 0  # parity holds (or the command did what it was asked)
EXIT_MISMATCH = 1  # parity does not hold under the --fail-on policy
EXIT_USAGE = 2  # bad input or usage: spec errors, unreadable or foreign directories
EXIT_INCOMPLETE = 3  # incomplete data: a side missing ranks or steps, a failed sweep cell
EXIT_INTERNAL = 4  # a bug in parity: one line, PARITY_DEBUG=1 for the traceback
EXIT_SIGNALED = 128  # + the signal's number: a process killed by a signal (the shell's convention)
EXIT_INTERRUPTED = 130  # Ctrl-C (EXIT_SIGNALED + SIGINT): parity's own, or a job's forwarded


class ParityError(Exception):
    """A failure the user can act on: printed as one line, mapped to an exit code."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ArtifactError(ParityError):
    """An artifact directory or file that cannot be read as parity's schema."""


class SpecError(ParityError):
    """A sweep spec that does not validate; the message names file, key and problem."""


def one_line(text) -> str:
    """``text`` with every control character (a newline, an ANSI escape) written as a visible
    ``\\xNN`` escape, for an error line printed below the CLI (``parity exec``'s "command not
    found"); the CLI prints a ParityError through report/text.py's ``safe_text``, which does
    this and more (bidi marks)."""
    return "".join(c if c.isprintable() or c == " " else
                   (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
                   for c in str(text))
