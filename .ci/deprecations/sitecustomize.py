"""CI only (.ci/run puts this folder on PYTHONPATH for one step): every DeprecationWarning
whose file is one of the project's is written to the file named by NVFP4_DEPRECATIONS_LOG, in
this process and in every Python process it starts (the environment carries the setting:
eval.py compile builds in a child process). The step fails when that file is not empty.

A warning is the project's when the file it is reported against (the frame its `stacklevel`
names: the code that used the deprecated API) lies under NVFP4_PROJECT_ROOT, outside its
virtual environments and build/. Warnings of the DSL's, torch's or numpy's own code are left
alone. Every DeprecationWarning is shown ("always"), as Python shows them in __main__ only by
default.
"""

import os
import warnings
from pathlib import Path

_LOG = os.environ.get("NVFP4_DEPRECATIONS_LOG")
_ROOT = os.environ.get("NVFP4_PROJECT_ROOT")


def _is_project_file(filename: str, root: Path) -> bool:
    """A file of the project's sources: an existing file under `root` (code made at run time,
    `<string>`, is nobody's file), outside build/ and the virtual environments."""
    if not filename or filename.startswith("<"):
        return False
    try:
        path = Path(filename).resolve()
        if not path.is_file() or not path.is_relative_to(root):
            return False
    except (OSError, ValueError):
        return False
    inside = path.relative_to(root).parts
    return not inside or not (inside[0] in ("build", ".venv") or inside[0].startswith(".venv"))


if _LOG and _ROOT:
    _root = Path(_ROOT).resolve()
    _show = warnings.showwarning

    def _record(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, DeprecationWarning) and _is_project_file(filename, _root):
            with open(_LOG, "a", encoding="utf-8") as log:
                text = " ".join(str(message).split())
                log.write(f"{Path(filename).resolve().relative_to(_root)}:{lineno}: "
                          f"{category.__name__}: {text}\n")
        _show(message, category, filename, lineno, file, line)

    warnings.showwarning = _record
    warnings.simplefilter("always", DeprecationWarning)
