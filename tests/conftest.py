"""Fixtures shared by several test modules, registered here once: a module that imported a fixture
by name would shadow it with the test's parameter of the same name (ruff F811)."""

pytest_plugins = [
    "tests.fakevllm.fixtures",      # fake_vllm
    "tests.topology_fixtures",      # corpus
    "tests.supervisor_fixtures",    # vsup
    "tests.vllm_fixtures",          # vllm_install
]


def pytest_configure(config) -> None:
    """A vsup a test starts without log.dir writes its logs to $XDG_STATE_HOME/vsup/logs: one
    folder for this run (removed at its end), not the home's state folder every run would share."""
    import os
    import tempfile

    if not hasattr(config, "workerinput"):  # (the controller of an xdist run makes it; workers inherit it)
        os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="vsup-test-state-")


def pytest_unconfigure(config) -> None:
    import os
    import shutil

    state = os.environ.get("XDG_STATE_HOME", "")
    if not hasattr(config, "workerinput") and os.path.basename(state).startswith("vsup-test-state-"):
        shutil.rmtree(state, ignore_errors=True)
