"""custom_kernel calls sys.exit(3): the harness fails the case and reports the rest as not run."""
import sys


def custom_kernel(data):
    sys.exit(3)
