"""The two parts, one way apart: importing submission.py pulls in nothing of the library; the
library imports submission.py once and shares it with `import submission`, or, where a harness
runs the library's entry file as its `submission` module, loads the leaderboard file under a
name of its own. Each case in a fresh interpreter (module state is process-wide)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "the leaderboard file alone": (
        "import sys, submission\n"
        "assert not any(name.startswith('nvfp4_group_gemm') for name in sys.modules), sorted(sys.modules)\n"
    ),
    "one module for both": (
        "import submission, nvfp4_group_gemm.leaderboard as lb\n"
        "assert lb.submission is submission\n"
        "import nvfp4_group_gemm.runtime as rt\n"
        "assert rt.submission is submission and rt.validate_inputs.__module__ == 'nvfp4_group_gemm.runtime'\n"
    ),
    "the library first": (
        "import nvfp4_group_gemm, sys\n"
        "import submission\n"
        "assert nvfp4_group_gemm.leaderboard.submission is submission is sys.modules['submission']\n"
    ),
    "a harness's own submission module": (
        "import sys, types\n"
        "sys.modules['submission'] = types.ModuleType('submission')  # the entry file, mid-import\n"
        "import nvfp4_group_gemm.leaderboard as lb\n"
        "assert lb.submission.__name__ == 'nvfp4_group_gemm._submission'\n"
        "assert lb.submission is not sys.modules['submission'] and hasattr(lb.submission, 'PersistentGemmSm100')\n"
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_imports_one_way(name):
    done = subprocess.run([sys.executable, "-c", CASES[name]], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
