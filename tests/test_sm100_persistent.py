"""The persistent sm_100a kernel (PersistentGemmSm100), checked without a B200.

Each token-tile configuration is compiled for sm_100a with DSL 4.3.5 (the cubin and PTX are
kept; the JIT load that follows fails without libcuda, as expected on a CPU) and read three
ways:
  * resources: registers, local frame and stack from the cubin; shared memory as traced,
    against the host-side stage formula of PersistentGemmConfig;
  * SASS (nvdisasm): per k-tile the 2-CTA block-scaled MMAs, the scale copies to TMEM and
    the TMA loads the design calls for, no local memory, no global stores but TMA stores;
  * PTX: mbarrier arrival counts, expect_tx bytes, and only 2-CTA forms of the tcgen05
    allocation, commit and MMA instructions.
The k-tile loops are not unrolled (``unroll=1``), so every instruction of one k-tile's body
appears once in the SASS: whole-kernel counts are per-k-tile counts.
"""

import collections
import re
import shutil
from pathlib import Path

import cutlass
import pytest
from cutlass import cute

import build_report
from nvfp4_group_gemm import core as submission

SM100_SMEM_LIMIT = 232_448  # 227 KB opt-in per block, compute capability 10.0
REGISTER_FILE = 65_536  # 32-bit registers per SM; one CTA per SM
K_TILE = 256
MMA_INST_K = 64  # K of one tcgen05.mma.kind::mxf4nvf4


def _nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    import nvidia  # namespace package of the pip CUDA tools

    for base in nvidia.__path__:
        for sub in ("cu13/bin/nvdisasm", "cuda_nvdisasm/bin/nvdisasm"):
            if (Path(base) / sub).is_file():
                return str(Path(base) / sub)
    pytest.fail("nvdisasm not found: install the test extra (pip package nvidia-cuda-nvdisasm)")


def _compile_kept(compile_fn, dump_dir: Path):
    """Run `compile_fn(options)` for sm_100a keeping cubin and PTX in `dump_dir`."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    options = f"--gpu-arch sm_100a --keep-cubin --keep-ptx --dump-dir {dump_dir}"
    with build_report.captured_native_stderr():
        try:
            compile_fn(options)
        except Exception:  # noqa: BLE001, S110 - the JIT load fails without libcuda; judged by the cubin
            pass
    cubins, ptxs = sorted(dump_dir.glob("*.cubin")), sorted(dump_dir.glob("*.ptx"))
    assert len(cubins) == 1 and len(ptxs) == 1, f"no single cubin/PTX in {dump_dir}"
    return cubins[0], ptxs[0]


Build = collections.namedtuple("Build", "config kernel cubin ptx sass")


@pytest.fixture(scope="module", params=sorted(submission.PERSISTENT_CONFIGS))
def persistent_build(request, tmp_path_factory):
    config = submission.PERSISTENT_CONFIGS[request.param]
    kernel = submission.PersistentGemmSm100(config)
    fake = submission.fake_ptr
    cubin, ptx = _compile_kept(
        lambda options: cute.compile(
            kernel, fake(cutlass.Int32), fake(cutlass.Int64),
            cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1), options=options,
        ),
        tmp_path_factory.mktemp(f"persistent_t{request.param}"),
    )
    sass = _run_nvdisasm(cubin)
    return Build(config, kernel, build_report.read_cubin(cubin.read_bytes()), ptx.read_text(errors="replace"), sass)


def _run_nvdisasm(cubin: Path) -> str:
    import subprocess

    return subprocess.run([_nvdisasm(), "-c", str(cubin)], check=True, capture_output=True, text=True).stdout


# An instruction line of nvdisasm: /*0a30*/  @!P0 UTCOMMA.2CTA.4X gdesc[UR4], ... ;
_SASS_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")


def sass_opcodes(sass: str) -> collections.Counter:
    """Full opcodes (with modifiers) of every instruction, counted."""
    return collections.Counter(m.group(1) for m in map(_SASS_INSTRUCTION.match, sass.splitlines()) if m)


def _count(opcodes: collections.Counter, prefix: str) -> int:
    return sum(n for op, n in opcodes.items() if op == prefix or op.startswith(prefix + "."))


def _only_kernel(cubin):
    (function,) = [f for name, f in cubin.functions.items() if "kernel" in name]
    return function


# ----------------------------------------------------------------------------- resources
def test_resources_within_the_launch_and_the_stage_formula(persistent_build):
    config, kernel, cubin = persistent_build.config, persistent_build.kernel, persistent_build.cubin
    function = _only_kernel(cubin)
    assert cubin.sm_version == 100
    assert function.frame_bytes == 0, "local memory in use: spills possible"
    assert function.min_stack_bytes == 0 and function.max_stack_bytes in (0, None)
    assert 0 < function.registers <= 255
    assert function.registers * kernel.threads_per_cta <= REGISTER_FILE
    assert kernel.threads_per_cta == 192  # 4 epilogue warps, 1 MMA warp, 1 TMA warp

    # What the trace computed from the DSL's layouts equals the host-side formula
    assert (kernel.num_ab_stage, kernel.num_c_stage) == (config.num_ab_stage, config.num_c_stage)
    assert config.num_ab_stage >= 5
    dynamic_smem = kernel.shared_storage.size_in_bytes()
    assert dynamic_smem == config.smem_bytes
    assert dynamic_smem + function.static_smem_bytes <= SM100_SMEM_LIMIT
    # One stage lands A, B and both scale tiles in each CTA of the pair
    assert kernel.num_tma_load_bytes == 2 * config.ab_stage_bytes
    tokens = config.tokens_per_tile
    assert config.ab_stage_bytes == 128 * 128 + tokens // 2 * 128 + 128 * 16 + max(tokens, 128) * 16


def test_init_kernel_builds_without_local_memory(tmp_path):
    config = submission.PERSISTENT_CONFIGS[128]
    kernel = submission.PersistentGemmSm100(config)
    fake = submission.fake_ptr
    cubin_path, ptx_path = _compile_kept(
        lambda options: cute.compile(
            kernel.init_tensormaps, fake(cutlass.Int64), fake(cutlass.Int32), fake(cutlass.Int64),
            cutlass.Int32(1), options=options,
        ),
        tmp_path,
    )
    function = _only_kernel(build_report.read_cubin(cubin_path.read_bytes()))
    assert function.frame_bytes == 0 and 0 < function.registers <= 255
    ptx = ptx_path.read_text(errors="replace")
    # Five descriptors per group: each gets its global address patched and is released to the
    # tensormap proxy that the GEMM's TMA reads it through; no acquire on the writer's side
    # (it would order only the writing thread's own accesses: the GEMM's warps acquire)
    slots = submission.PERSISTENT_NUM_TENSORMAPS
    assert ptx.count("tensormap.replace.tile.global_address") == slots
    assert len(re.findall(r"tensormap\.cp_fenceproxy\.global\.shared::cta\.tensormap::generic\.release\.gpu", ptx)) == slots
    assert "fence.proxy.tensormap::generic.acquire" not in ptx
    assert "tcgen05" not in ptx


# ----------------------------------------------------------------------------- SASS
def test_sass_per_k_tile(persistent_build):
    config, opcodes = persistent_build.config, sass_opcodes(persistent_build.sass)
    tokens = config.tokens_per_tile
    # 256-deep K tile / 64 per instruction, all 2-CTA block-scaled (the 4X scale vector)
    assert _count(opcodes, "UTCOMMA") == K_TILE // MMA_INST_K
    assert opcodes["UTCOMMA.2CTA.4X"] == K_TILE // MMA_INST_K
    # Scale copies to TMEM, one 32x128-bit (x4 warps) copy per 128 rows per MMA k-block:
    # SFA 128 rows per CTA, SFB the tokens' rows rounded up to the 128-row atom
    scale_copies = (K_TILE // MMA_INST_K) * (1 + max(tokens, 128) // 128)
    assert _count(opcodes, "UTCCP") == scale_copies
    assert opcodes["UTCCP.T.S.2CTA.4x32dp128bit"] == scale_copies
    # Descriptor prefetches, each after its acquire: the first tile's and each new group's A,
    # B, SFA, SFB (TMA warp) and C (the storing epilogue warp)
    assert opcodes["UTMACCTL.PF"] == 2 * submission.PERSISTENT_NUM_TENSORMAPS
    # Each acquire: the descriptor's cached copies invalidated (constant cache, TMA unit)
    assert opcodes["CCTL.E.C.LDCU.IV.DEEP"] == opcodes["UTMACCTL.IV"] == 2 * submission.PERSISTENT_NUM_TENSORMAPS
    # Tile-table rows come in 16-byte loads
    assert opcodes["LDG.E.128"] >= 1
    # TMA loads per stage: A, B (2-CTA), SFA, and SFB multicast to both CTAs of the pair
    loads = {op: n for op, n in opcodes.items() if op.startswith("UTMALDG")}
    assert sum(loads.values()) == 4, loads
    assert all(op.endswith(".2CTA") for op in loads), loads
    assert sum(n for op, n in loads.items() if "MULTICAST" in op) == 1, loads


def test_sass_epilogue_stores_by_tma_only(persistent_build):
    config, opcodes = persistent_build.config, sass_opcodes(persistent_build.sass)
    assert not [op for op in opcodes if op.startswith(("LDL", "STL"))], "local memory in use"
    assert not [op for op in opcodes if op.startswith("STG")], "global stores outside TMA"
    # Each 128 x 32 subtile of C^T leaves shared memory in two TMA boxes
    subtiles = config.tokens_per_tile // 32
    assert _count(opcodes, "UTMASTG") == 2 * subtiles
    # TMEM -> registers and the transposing shared-memory store, per subtile
    assert _count(opcodes, "LDTM") == 2 * subtiles
    assert opcodes["STSM.16.MT88.4"] == 4 * subtiles


def test_per_tile_kernel_full_tiles_store_256_bits(tmp_path):
    cubin, _ = _compile_kept(lambda options: submission.compile_gemm(2, options), tmp_path)
    opcodes = sass_opcodes(_run_nvdisasm(cubin))
    # Each thread's 128 contiguous fp16 of a full tile (N % 16 == 0): 8 x 256-bit
    assert opcodes["STG.E.ENL2.256"] == 8
    assert not [op for op in opcodes if op.startswith(("LDL", "STL"))]


# ----------------------------------------------------------------------------- PTX
def _register_values(ptx: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"mov\.[bu]32\s+(%r\d+),\s*(\d+);", ptx)}


def _operand_value(operand: str, registers: dict[str, int]) -> int:
    operand = operand.strip()
    return int(operand) if operand.isdigit() else registers[operand]


def test_ptx_barrier_counts_and_transaction_bytes(persistent_build):
    config, ptx = persistent_build.config, persistent_build.ptx
    registers = _register_values(ptx)
    init_counts = collections.Counter(
        _operand_value(m.group(1), registers)
        for m in re.finditer(r"mbarrier\.init\.shared\.b64\s+\[[^\]]+\],\s*([^;]+);", ptx)
    )
    ab, acc = config.num_ab_stage, config.num_acc_stage
    epilogue_warps_of_the_pair = 4 * 2
    assert init_counts == {
        # ab full (1 producer arrival + bytes) and ab empty (1 commit) per stage, acc full
        # (1 commit) per accumulator, and the TMEM dealloc handshake (the peer's 32 threads)
        1: 2 * ab + acc,
        epilogue_warps_of_the_pair: acc,
        32: 1,
    }
    expect_tx = [
        _operand_value(m.group(1), registers)
        for m in re.finditer(r"mbarrier\.arrive\.expect_tx[\w.:]*\s+_,\s*\[[^\]]+\],\s*([^;]+);", ptx)
    ]
    assert expect_tx and set(expect_tx) == {2 * config.ab_stage_bytes}
    # All mbarrier inits become visible to the pair through one cluster barrier
    assert ptx.count("barrier.cluster.wait") == 1


def test_ptx_tcgen05_in_two_cta_forms(persistent_build):
    ptx = persistent_build.ptx
    for op in ("tcgen05.alloc", "tcgen05.dealloc", "tcgen05.relinquish_alloc_permit", "tcgen05.commit",
               "tcgen05.mma", "tcgen05.cp"):
        forms = re.findall(re.escape(op) + r"[\w.:]*", ptx)
        assert forms, op
        assert all(".cta_group::2" in form for form in forms), (op, set(forms))
    mmas = set(re.findall(r"tcgen05\.mma[\w.:]*", ptx))
    assert mmas == {"tcgen05.mma.cta_group::2.kind::mxf4nvf4.block_scale.scale_vec::4X"}
    # Commits reach both CTAs of the pair
    assert all("multicast::cluster" in c for c in re.findall(r"tcgen05\.commit[\w.:]*", ptx))


def test_ptx_consumers_acquire_each_descriptor_before_use(persistent_build):
    ptx = persistent_build.ptx
    acquire = "fence.proxy.tensormap::generic.acquire.gpu"
    # A, B, SFA, SFB in the TMA warp and C in the storing epilogue warp, each twice: for the
    # first tile before the first pipeline wait, and at each group change
    assert ptx.count(acquire) == 2 * submission.PERSISTENT_NUM_TENSORMAPS
    assert ptx.count("prefetch.tensormap") == ptx.count(acquire)
    # Each prefetch follows its acquire, on the same address: the same register, or (DSL 4.8)
    # the register's base and offset (`add.s64 %rdX, %rdB, 128` then `[%rdB+128]`)
    pairs = re.findall(r"fence\.proxy\.tensormap::generic\.acquire\.gpu \[(%rd\d+)\], 128;(?:\s*// [a-z ]+)*\s*"
                       r"prefetch\.tensormap\s+\[(%rd\d+)(?:\+(\d+))?\];", ptx)
    offsets = {dst: (src, int(imm)) for dst, src, imm in re.findall(r"add\.s64\s+(%rd\d+), (%rd\d+), (\d+);", ptx)}
    same_address = [offsets.get(acquired, (acquired, 0)) == (prefetched, int(offset or 0))
                    or (acquired == prefetched and not offset) for acquired, prefetched, offset in pairs]
    assert len(pairs) == 2 * submission.PERSISTENT_NUM_TENSORMAPS and all(same_address), pairs
    # The first acquires come before the first mbarrier wait of any role
    first_wait = min(ptx.find(op) for op in ("mbarrier.try_wait", "mbarrier.test_wait") if op in ptx)
    assert ptx.find(acquire) < first_wait


def test_per_tile_kernel_acquires_its_descriptors(tmp_path):
    cubin, ptx_path = _compile_kept(lambda options: submission.compile_gemm(2, options), tmp_path)
    # SASS: per descriptor an invalidation of its cached copies, then the prefetch, on one address
    sass = _run_nvdisasm(cubin)
    ops = re.findall(r"(CCTL\.E\.C\.LDCU\.IV\.DEEP|UTMACCTL\.IV|UTMACCTL\.PF) \[(UR\d+)\]", sass)
    assert [op for op, _ in ops] == ["CCTL.E.C.LDCU.IV.DEEP", "UTMACCTL.IV", "UTMACCTL.PF"] * submission.num_tensormaps
    assert all(len({reg for _, reg in ops[i:i + 3]}) == 1 for i in range(0, len(ops), 3))
    ptx = ptx_path.read_text(errors="replace")
    # warp 0's A, B, SFA, SFB before its first TMA load
    acquire = "fence.proxy.tensormap::generic.acquire.gpu"
    assert ptx.count(acquire) == submission.num_tensormaps
    assert ptx.count("prefetch.tensormap") == submission.num_tensormaps
    assert ptx.find(acquire) < ptx.find("cp.async.bulk.tensor")


def test_per_tile_init_kernel_releases_without_acquiring(tmp_path):
    _, ptx_path = _compile_kept(lambda options: submission.compile_init_tensormaps(2, options), tmp_path)
    ptx = ptx_path.read_text(errors="replace")
    assert ptx.count("tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu") == submission.num_tensormaps
    assert "fence.proxy.tensormap::generic.acquire" not in ptx


def test_ptx_only_named_role_barriers(persistent_build):
    """No CTA-wide barrier inside a role branch: only the epilogue's (id 1, 4 warps) and the
    TMEM-address handoff (id 2, epilogue + MMA warps)."""
    barriers = set(re.findall(r"\bbar(?:rier)?\.(?:sync|arrive)(?:\.aligned)?\s+(\d+)(?:,\s*(\d+))?;", persistent_build.ptx))
    assert barriers == {("1", "128"), ("2", "160")}


def test_compile_targets_list_every_persistent_configuration():
    names = [name for name, arch, _ in submission.compile_targets()]
    for tokens in submission.PERSISTENT_CONFIGS:
        assert f"sm100_persistent_gemm_t{tokens}" in names
        assert f"sm100_persistent_init_t{tokens}" in names


def test_ptx_every_tile_row_load_is_guarded_by_the_tile_count(persistent_build):
    """The kernel guards its own tile walk: every load of a tile row (the first of each role
    included, 16 bytes) sits behind a branch on `index >= num_tiles`, num_tiles being the
    kernel's last parameter, so a pair with no tile reads nothing and tears down as usual."""
    lines = persistent_build.ptx.replace("\0", "").splitlines()
    params = [(int(m.group(2)), m.group(1)) for line in lines
              if (m := re.search(r"ld\.param\.u32\s+(%r\d+),\s*\[\w+_param_(\d+)\]", line))]
    num_tiles = max(params)[1]
    guards = {m.group(1) for line in lines
              if (m := re.search(rf"setp\.ge\.s32\s+(%p\d+),\s*%r\d+,\s*{re.escape(num_tiles)};", line))}
    loads = [i for i, line in enumerate(lines) if "ld.global.v4.u32" in line]
    assert len(loads) == 6  # three roles: the first row and the next row each
    for index in loads:
        branch = next(line for line in reversed(lines[:index]) if re.search(r"\bbra\b", line))
        predicate = re.search(r"@(%p\d+)\s+bra", branch)
        assert predicate and predicate.group(1) in guards, (index, branch)
