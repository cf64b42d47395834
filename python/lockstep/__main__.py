"""``python -m lockstep``: the ``lockstep`` command (see ``lockstep._cli``)."""

from lockstep._cli import main

if __name__ == "__main__":
    main()
