"""Run from a folder outside the repository, in an environment where the wheel is installed:
the package imports from site-packages with every backend and its version, installs no
top-level name but its own, and builds one kernel of each architecture (no GPU needed)."""

import importlib.metadata
import sys
from pathlib import Path

import nvfp4_group_gemm
import nvfp4_group_gemm.sm100
import nvfp4_group_gemm.sm100_moe
from nvfp4_group_gemm import core, hopper

location = Path(nvfp4_group_gemm.__file__).resolve()
assert "site-packages" in location.parts, f"imported from {location}, not the installed wheel"
assert "task" not in sys.modules, "the installed package imported a top-level `task`"
distribution = importlib.metadata.distribution("nvfp4-group-gemm")
assert distribution.version == nvfp4_group_gemm.__version__, (distribution.version, nvfp4_group_gemm.__version__)
top_level = sorted({Path(f).parts[0] for f in distribution.files if not Path(f).parts[0].endswith(".dist-info")})
assert top_level == ["nvfp4_group_gemm"], f"the wheel installs top-level names {top_level}"
assert hopper.compile_gemm(2, options="--gpu-arch sm_90a", config=hopper.SM90_CONFIG) is not None
assert core.compile_gemm(2, options="--gpu-arch sm_100a") is not None
print(f"nvfp4_group_gemm {nvfp4_group_gemm.__version__} from {location.parent}; top-level names installed: "
      f"{top_level}; cutlass DSL {importlib.metadata.version('nvidia-cutlass-dsl')}; sm_90a and sm_100a kernels built")
