"""`python -m vsup` is the `vsup` command."""

from vsup.supervisor.cli import main

if __name__ == "__main__":
    main()
