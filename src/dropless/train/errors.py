"""The one error ``dropless train`` and ``dropless generate`` report to the user as a one-line message."""


class TrainError(Exception):
    """A problem with the user's input (data, checkpoint, preset, memory) that no traceback explains
    better than its message; the command line prints it and exits with status 2."""
