"""Everything with I/O (processes, sockets, files, signals): config, launch, the instance
lifecycle, the supervisor loop, the proxy and the CLI. The version lives in `vsup.__version__`."""
