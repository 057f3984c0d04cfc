"""Fixtures shared by several test modules, registered here once: a module that imported a fixture
by name would shadow it with the test's parameter of the same name (ruff F811)."""

pytest_plugins = [
    "tests.fakevllm.fixtures",      # fake_vllm
    "tests.topology_fixtures",      # corpus
    "tests.supervisor_fixtures",    # vsup
    "tests.vllm_fixtures",          # vllm_install
]
