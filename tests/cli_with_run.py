"""`vsup` with its /run replaced: `python tests/cli_with_run.py RUN ARGS...` is `vsup ARGS...` that
takes RUN for /run, so the installed unit's socket is RUN/vsup/control.sock and a runtime directory
systemd made is a folder of RUN. Tests of the control socket's search use it instead of writing
the machine's real /run/vsup (a root-owned folder RUN stands for /run)."""

import sys
from pathlib import Path

from vsup.supervisor import control, trust

if __name__ == "__main__":
    run = Path(sys.argv.pop(1))
    trust.RUN = run
    control.SYSTEMD_DEFAULT = run / "vsup" / "control.sock"
    from vsup.cli.main import main

    main()
