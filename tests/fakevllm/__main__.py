"""`python -m tests.fakevllm serve MODEL --host H --port P ...` (run from the repo root)."""

import sys

from .server import main

sys.exit(main())
