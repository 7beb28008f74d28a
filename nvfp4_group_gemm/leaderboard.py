"""The leaderboard file, ``submission.py`` beside this package: its sm_100a kernels and the
host core every runtime of this project shares (validation, the fallback chain and its
self-check, the caches' type, the prepared launches, the host computations).

Imported once per process and shared: the module that ``import submission`` gives where that
is this file, else (a harness running the library's entry file as its ``submission``) the
same file loaded under its own name."""

import importlib.util
import sys
from pathlib import Path

PATH = Path(__file__).resolve().parent.parent / "submission.py"
_OWN_NAME = "nvfp4_group_gemm._submission"


def _is_leaderboard_file(module) -> bool:
    path = getattr(module, "__file__", None)
    return path is not None and Path(path).resolve() == PATH


def _load():
    for name in ("submission", _OWN_NAME):
        module = sys.modules.get(name)
        if module is not None and _is_leaderboard_file(module):
            return module
    name = "submission" if "submission" not in sys.modules else _OWN_NAME
    spec = importlib.util.spec_from_file_location(name, PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


submission = _load()
