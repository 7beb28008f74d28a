"""A segmentation fault in custom_kernel (a read of address 0, as a bad pointer in a kernel's
host code): the process ends by SIGSEGV."""
import ctypes


def custom_kernel(data):
    ctypes.string_at(0)
