"""Every pytest plugin of the child, registered once, in this order (pyproject's addopts: `-p stackcheck.child.plugins`)."""

pytest_plugins = (
    "stackcheck.child.signals",  # SIGTERM and SIGHUP as Ctrl-C; the run ends with its command
    "stackcheck.child.axes",  # a contract test's pairwise cells
    "stackcheck.child.setup",  # options, the run's state, xdist workers' GPUs and cores; the recorder
    "stackcheck.child.lanes",  # lanes, architectures, the shared fixtures
    "stackcheck.child.verdicts",  # the ledger's verdict of every family test
    "stackcheck.child.bench",  # the benchmarks (-m benchmark)
    "stackcheck.child.gc_freeze",  # the garbage collection between tests
    "stackcheck.child.schedule",  # the order xdist hands tests out in
    "stackcheck.child.progress",  # the live progress line of a long run, in a terminal
    "stackcheck.child.repro",  # the parameters of the one test `repro` collects
)
