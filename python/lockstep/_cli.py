"""The ``lockstep`` command installed with the Python package: ``lockstep launch``, ``bench``,
``env``, ``config`` and ``selftest``, the same command as the Rust binary (the extension runs it
in this process). Also ``python -m lockstep``."""

import sys


def main() -> None:
    """Console-script entry point: run the command with ``sys.argv`` and exit with its status."""
    from lockstep import _native

    # Python's buffered output first: the command writes to the file descriptors directly.
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(_native.cli_main(["lockstep", *sys.argv[1:]]))
