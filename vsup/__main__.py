"""`python -m vsup` is the `vsup` command."""

from vsup.cli.main import main

if __name__ == "__main__":
    main()
