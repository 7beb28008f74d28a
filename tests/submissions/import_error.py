"""The submission does not import (a missing module): reported once, not once per case."""
import nvfp4_module_that_does_not_exist  # noqa: F401


def custom_kernel(data):
    raise AssertionError("not imported")
