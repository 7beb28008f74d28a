"""Every sm_100a kernel builds under the pinned DSL on a machine without a GPU.

For each target submission.compile_targets() lists (the per-tile kernel and its descriptor
init kernel, the persistent kernel and its init kernel per token-tile configuration) and
G in {1, 2, 8}: the build did not fail, the cubin is an sm_100 ELF, the PTX targets sm_100a,
there is no local memory (so 0 spill bytes), shared memory fits the sm_100 opt-in limit,
the dynamic shared memory read from the launch in the compiled host code matches the
kernel's configuration, and each GEMM contains the block-scaled tcgen05 MMA. The builds run
once (build_report's build process) and are shared by the tests through a module-scoped
fixture.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

import build_report
from nvfp4_group_gemm import core as submission

GROUP_COUNTS = (1, 2, 8)
SM100_SMEM_LIMIT = 232_448  # 227 KB opt-in per block, compute capability 10.0
TARGETS = [name for name, _arch, _compile in submission.compile_targets()]
GEMM_TARGETS = [name for name in TARGETS if "gemm" in name]
INIT_TARGETS = [name for name in TARGETS if "init" in name]


@pytest.fixture(scope="module")
def sm100_builds(tmp_path_factory):
    dump_root = tmp_path_factory.mktemp("sm100_build")
    reports = build_report.build_all(GROUP_COUNTS, dump_root, modules=("submission",))
    return {(r.target, r.num_groups): r for r in reports}


def test_pinned_dsl():
    assert submission.DSL_VERSION == "4.3.5"


def test_targets_cover_both_kernels():
    assert {"sm100_init_tensormaps", "sm100_gemm"} <= set(TARGETS)
    assert GEMM_TARGETS and INIT_TARGETS and set(GEMM_TARGETS) | set(INIT_TARGETS) == set(TARGETS)
    assert all(arch == "sm_100a" for _name, arch, _compile in submission.compile_targets())


def test_every_kernel_and_group_count_was_built(sm100_builds):
    assert set(sm100_builds) == {(name, g) for name in TARGETS for g in GROUP_COUNTS}
    for report in sm100_builds.values():
        assert not report.failed, f"{report.target} G={report.num_groups}: {report.error}"
        assert report.arch == "sm_100a"
        assert report.sm_version == 100, report.cubin_path
        assert report.ptx_target == "sm_100a"
        assert Path(report.cubin_path).stat().st_size > 0


@pytest.mark.parametrize("num_groups", GROUP_COUNTS)
@pytest.mark.parametrize("target", TARGETS)
def test_resources_within_limits(sm100_builds, target, num_groups):
    report = sm100_builds[(target, num_groups)]
    assert 0 < report.registers <= 255
    assert report.frame_bytes == 0, "local memory in use: spills possible"
    assert report.spill_bytes_max == 0
    assert report.stack_bytes == 0
    assert report.smem_limit_bytes == SM100_SMEM_LIMIT
    assert report.dynamic_smem_source == "launch config in the compiled host code"
    assert report.dynamic_smem_bytes is not None and report.dynamic_smem_bytes > 0
    assert report.smem_bytes <= SM100_SMEM_LIMIT
    assert report.threads is not None and report.threads % 32 == 0
    assert build_report.problems(report) == []


@pytest.mark.parametrize("num_groups", GROUP_COUNTS)
@pytest.mark.parametrize("target", GEMM_TARGETS)
def test_gemm_uses_block_scaled_tcgen05_mma(sm100_builds, target, num_groups):
    report = sm100_builds[(target, num_groups)]
    assert report.mma and all(
        "tcgen05.mma" in m and "kind::mxf4nvf4" in m and "block_scale" in m for m in report.mma
    ), report.mma


@pytest.mark.parametrize("target", INIT_TARGETS)
def test_init_kernels_have_no_mma(sm100_builds, target):
    assert sm100_builds[(target, 1)].mma == []


def test_gemm_shared_memory_matches_the_config(sm100_builds):
    # num_ab_stage x (A 128x256 fp4 + B 128x256 fp4 + SFA 128x16 fp8 + SFB 128x16 fp8) must fit
    # in the dynamic shared memory the DSL reserved for the GEMM (plus barriers, < 1 KiB).
    tile_m, tile_n, tile_k = submission.mma_tiler_mnk
    per_stage = (tile_m + tile_n) * tile_k // 2 + (tile_m + tile_n) * tile_k // submission.sf_vec_size
    dynamic = sm100_builds[("sm100_gemm", 1)].dynamic_smem_bytes
    stages = submission.num_ab_stage
    assert stages * per_stage <= dynamic < stages * per_stage + 1024


@pytest.mark.parametrize("tokens", sorted(getattr(submission, "PERSISTENT_CONFIGS", {})))
def test_persistent_gemm_launch_reserves_the_configured_shared_memory(sm100_builds, tokens):
    # The launch's dynamic shared memory (read from the compiled host code) is what the
    # host-side stage formula of the configuration says
    config = submission.PERSISTENT_CONFIGS[tokens]
    for num_groups in GROUP_COUNTS:
        report = sm100_builds[(f"sm100_persistent_gemm_t{tokens}", num_groups)]
        assert report.dynamic_smem_bytes == config.smem_bytes


def test_tensormap_staging_buffer_is_128_byte_aligned(sm100_builds):
    # The init kernel's smem descriptor buffer: 4 x 128 B, 128-byte aligned (DSL >= 4.6 rejects
    # less); its dynamic shared memory is exactly that buffer.
    report = sm100_builds[("sm100_init_tensormaps", 1)]
    assert report.dynamic_smem_bytes == 4 * 128
    ptx = Path(report.ptx_path).read_bytes().decode(errors="replace")
    assert ".shared .align 1024 .b8 __dynamic_shmem__0[]" in ptx


def test_read_cubin_rejects_non_elf():
    with pytest.raises(ValueError, match="ELF"):
        build_report.read_cubin(b"not a cubin at all")


@pytest.mark.skipif(shutil.which("cuobjdump") is None, reason="cuobjdump not on PATH (cross-check only)")
def test_cubin_reader_agrees_with_cuobjdump(sm100_builds):
    for report in sm100_builds.values():
        out = subprocess.run(
            ["cuobjdump", "-res-usage", report.cubin_path], capture_output=True, text=True, check=True
        ).stdout
        assert f"REG:{report.registers} " in out
        assert f"STACK:{report.stack_bytes} " in out
        assert f"SHARED:{report.static_smem_bytes} " in out
        assert f"LOCAL:{report.frame_bytes} " in out
