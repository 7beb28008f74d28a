"""Builds ``submission.py``, the leaderboard file, from the package: the core module
(``nvfp4_group_gemm/core.py``: the sm_100a kernels, validation, the fallback chain and its
self-check, the caches, ``custom_kernel``) behind a header that names its source. The bot
receives one self-contained file; the package keeps the one copy of its logic.

    python -m nvfp4_group_gemm.bundle            # write submission.py in the current folder
    python -m nvfp4_group_gemm.bundle --check    # exit 1 if submission.py differs from the bundle
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

CORE = Path(__file__).resolve().with_name("core.py")
HEADER = (
    "# GPU MODE nvfp4_group_gemm leaderboard file: nvfp4_group_gemm/core.py, bundled by\n"
    "# `python -m nvfp4_group_gemm.bundle`. Edit that module and bundle again; the tests fail\n"
    "# while this file differs from the bundle.\n"
)


def bundled_text() -> str:
    """The leaderboard file's text: the header, then the core module as it is."""
    return HEADER + CORE.read_text(encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nvfp4_group_gemm.bundle", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="submission.py", help="the file to write or check (default submission.py)")
    parser.add_argument("--check", action="store_true", help="only compare: exit 1 if the file differs from the bundle")
    args = parser.parse_args(argv)
    out = Path(args.out)
    text = bundled_text()
    if args.check:
        if not out.is_file() or out.read_text(encoding="utf-8") != text:
            print(f"bundle: {out} differs from nvfp4_group_gemm/core.py bundled; run "
                  "`python -m nvfp4_group_gemm.bundle`", file=sys.stderr)
            return 1
        print(f"bundle: {out} is the bundle of nvfp4_group_gemm/core.py")
        return 0
    out.write_text(text, encoding="utf-8")
    print(f"bundle: wrote {out} ({len(text.encode())} bytes) from nvfp4_group_gemm/core.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
