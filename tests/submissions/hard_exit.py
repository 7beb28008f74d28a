"""os._exit(7) in custom_kernel: the process ends without cleanup (as a native crash does)."""
import os


def custom_kernel(data):
    os._exit(7)
