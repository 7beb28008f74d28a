"""custom_kernel returns one list per group instead of tensors: one line, not a traceback."""


def custom_kernel(data):
    return [[0.0] for _ in data[0]]
