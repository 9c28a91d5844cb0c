"""The distributed contract families' CPU selection, checked before anything runs (a user error is one line)."""

from stackcheck.distributed import cells


def pytest_configure(config):
    cells.every_cpu_variant()  # STACKCHECK_DIST_CPU other than 'all': pytest's usage error
