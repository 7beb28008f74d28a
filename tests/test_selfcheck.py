"""selfcheck.py on a CPU: its one-line refusals, the kernels it runs per backend, its random
group sets and its table. Its GPU run is `python eval.py selfcheck` on the H200 (README)."""

import json
import random
import sys

import pytest
import torch

import selfcheck
from nvfp4_group_gemm import core as submission


@pytest.mark.parametrize("argv, message", [
    ([], "eval.py selfcheck: needs a CUDA GPU (sm_100 B200 or sm_90 H100/H200); none is visible here"),
    (["--random", "-1"], "eval.py selfcheck: --random must be >= 0, --repeats >= 1 and --timeout > 0"),
    (["--kernels", "per_tile,persistnt"], "eval.py selfcheck: --kernels: unknown persistnt; allowed: persistent_t128,"),
    (["--bogus"], "eval.py selfcheck: unrecognized arguments: --bogus"),
])
def test_refusals_are_one_line_and_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert selfcheck.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message)


def test_eval_dispatches_selfcheck(monkeypatch, capsys):
    import eval as harness

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert harness.main(["selfcheck"]) == 2
    assert "eval.py selfcheck: needs a CUDA GPU" in capsys.readouterr().err


def test_sm100_kernels_are_every_link_the_automatic_choice_can_pick():
    backend = submission.Sm100Backend("persistent")
    names = [c.name for c in selfcheck.kernels_for(backend, [(128, 256, 512, 1)])]
    assert names == ["persistent_t128", "persistent_t256", "per_tile", "scaled_mm"]
    # N % 8 != 0: the persistent kernel cannot run these sizes
    assert [c.name for c in selfcheck.kernels_for(backend, [(128, 100, 512, 1)])] == ["per_tile", "scaled_mm"]
    assert set(selfcheck.KERNEL_NAMES) >= set(submission.SM100_CHOICES)


def test_random_group_sets_hold_every_code_and_general_scales():
    rng = random.Random(3)
    codes, scales = set(), set()
    for _ in range(4):
        abc, sfs, _sfs_reordered, sizes = selfcheck.random_group_set(rng, 8, device="cpu")
        assert any(m for m, *_ in sizes) and all(n % 8 == 0 and k % 256 == 0 for _, n, k, _ in sizes)
        for (a, b, c), (sfa, _sfb) in zip(abc, sfs):
            raw = a.view(torch.uint8)
            codes |= set((raw & 15).flatten().tolist()) | set((raw >> 4).flatten().tolist())
            scales |= set(sfa.view(torch.uint8).flatten().tolist())
            assert bool(c.isnan().all())  # every output starts as NaN: an unwritten one fails
    assert codes == set(range(16))
    assert 0 in scales and max(scales) == 0x46 and len(scales) > 60  # zero, subnormals, normals


def test_table_lists_every_kernel_with_its_figures():
    rows = [{"kernel": "swap_ab", "status": "pass"}, {"kernel": "swap_ab", "status": "MISMATCH"},
            {"kernel": "exact_decode", "status": "pass"}]
    timings = [{"case": "benchmark 0", "kernel": "swap_ab", "us": 100.0},
               {"case": "benchmark 1", "kernel": "swap_ab", "us": 25.0},
               {"case": "benchmark 0", "kernel": "exact_decode", "error": "boom"}]
    lines = selfcheck.format_table(rows, timings).splitlines()
    assert lines[0].split() == ["kernel", "passed", "benchmark", "0", "benchmark", "1", "geomean"]
    assert lines[2].split() == ["swap_ab", "1", "/", "2", "100.00", "25.00", "50.00"]
    assert lines[3].split() == ["exact_decode", "1", "/", "1", "-", "-", "-"]


CHILD = """
import json, os, sys, time
args = sys.argv[1:]
name = args[args.index("--kernels") + 1]
out = args[args.index("--json") + 1]
print(f"  test 0       {name:<16} ...", flush=True)
behaviour = os.environ["FAKE_CHILD"].split(",")[["good", "hangs", "crashes"].index(name) if name in ("good", "hangs", "crashes") else 0]
if behaviour == "hang":
    time.sleep(60)
if behaviour == "crash":
    os._exit(139)
print(f"  test 0       {name:<16} pass", flush=True)
row = {"case": "test 0", "kind": "test", "kernel": name, "status": "pass"}
json.dump({"rows": [row], "timings": [], "demoted": {}}, open(out, "w"))
"""


def test_each_kernel_in_its_own_process_survives_a_hang_and_a_crash(monkeypatch, tmp_path, capsys):
    """The parent runs one child per kernel: a child that hangs past --timeout is killed and
    reported with the case it was running, one that crashes is reported with its exit code,
    and the other kernels' results still come back."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    monkeypatch.setenv("FAKE_CHILD", "pass,hang,crash")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(selfcheck, "machine", lambda: {"device": "fake", "sms": 1, "torch": "t", "dsl": "d"})
    monkeypatch.setattr(selfcheck, "kernel_names", lambda capability: ["good", "hangs", "crashes"])
    monkeypatch.setattr(selfcheck, "child_command",
                        lambda args, name, child_json: [sys.executable, str(script), "--kernels", name, "--json",
                                                        str(child_json)])
    report = tmp_path / "report.json"
    assert selfcheck.main(["--timeout", "2", "--json", str(report)]) == 1
    out = capsys.readouterr().out
    assert "  test 0       good             pass" in out
    assert "hangs            HANG: not done after 2 s (killed); last line: 'test 0       hangs'" in out
    assert "crashes          CRASH: the process ended with code 139" in out
    rows = json.loads(report.read_text())["rows"]
    assert [(r["kernel"], r["status"]) for r in rows] == [("good", "pass"), ("hangs", "HANG"), ("crashes", "CRASH")]
    assert "1 passed, 2 failed" in out


def test_the_runtime_follows_the_architecture():
    """sm_100: submission.py's runtime (the leaderboard file); sm_90: the library's."""
    assert selfcheck.runtime_module((10, 0)) is submission
    assert selfcheck.runtime_module((10, 3)) is submission
    assert selfcheck.runtime_module((9, 0)).__name__ == "nvfp4_group_gemm.runtime"
    assert selfcheck.runtime_of(submission.Sm100Backend("persistent")) is submission


def test_selfcheck_reads_the_case_files_without_eval(monkeypatch):
    """The shipped tests and benchmarks come from case_files (eval.py imports selfcheck, not
    the other way round)."""
    monkeypatch.delitem(sys.modules, "eval", raising=False)
    args = selfcheck.parse_args(["--random", "0"])
    found = selfcheck.cases(args, (10, 0))
    assert [kind for kind, _, _ in found] == ["test"] * 10 + ["benchmark"] * 4
    assert found[10][2] == {"m": (80, 176, 128, 72, 64, 248, 96, 160), "n": (4096,) * 8,
                            "k": (7168,) * 8, "g": 8, "seed": 1111}
    assert "eval" not in sys.modules


def test_a_forced_sm100_kernel_runs_through_the_leaderboard_files_binding(monkeypatch):
    """run_forced on sm_100 binds with submission.py's own runtime (its launch on the default
    stream, prepared once) and hands back that launch for the timing loop."""
    import helpers

    fakes, _run = helpers.sm100_runtime(monkeypatch)
    backend = submission._BACKEND_BY_DEVICE[None]
    data = helpers.official_inputs([(40, 128, 256, 1), (72, 64, 512, 1)])
    fakes.data = data
    outputs, launch = selfcheck.run_forced(backend, submission.SM100_CHOICES["per_tile"], data)
    assert fakes.ran == ["per_tile_gemm"]
    helpers.assert_exact(outputs, data)
    launch()
    assert fakes.ran == ["per_tile_gemm"] * 2
    outputs, launch = selfcheck.run_forced(backend, submission.SM100_CHOICES["scaled_mm"], data)
    assert launch is None and fakes.scaled_mm_runs == 1


def test_table_shows_chained_and_unchained_sm100_timings():
    """An sm_100 kernel timed both ways: its line holds the chained µs, then its unchained µs
    and what chaining saved per call; a kernel timed once (no `chained` key) keeps one line."""
    rows = [{"kernel": "per_tile", "status": "pass"}, {"kernel": "scaled_mm", "status": "pass"}]
    timings = [{"case": "benchmark 0", "kernel": "per_tile", "us": 30.0, "chained": True},
               {"case": "benchmark 0", "kernel": "per_tile", "us": 31.5, "chained": False},
               {"case": "benchmark 1", "kernel": "per_tile", "us": 10.0, "chained": True},
               {"case": "benchmark 1", "kernel": "per_tile", "us": 11.0, "chained": False},
               {"case": "benchmark 0", "kernel": "scaled_mm", "us": 90.0},
               {"case": "benchmark 1", "kernel": "scaled_mm", "us": 40.0}]
    lines = selfcheck.format_table(rows, timings).splitlines()
    assert lines[2].split() == ["per_tile", "1", "/", "1", "30.00", "10.00", "17.32"]
    assert lines[3].split() == ["unchained", "31.50", "11.00", "18.61"]
    assert lines[4].split() == ["chaining", "saves", "1.50", "1.00"]
    assert lines[5].split() == ["scaled_mm", "1", "/", "1", "90.00", "40.00", "60.00"]
    assert len(lines) == 6


def test_sm100_kernels_are_timed_chained_and_unchained(monkeypatch):
    sm100 = submission.Sm100Backend("persistent")

    class Hopper:
        name = "sm90"

    choices = submission.SM100_CHOICES
    assert selfcheck.chain_settings(sm100, choices["persistent_t128"]) == (True, False)
    assert selfcheck.chain_settings(sm100, choices["per_tile"]) == (True, False)
    assert selfcheck.chain_settings(sm100, choices["scaled_mm"]) == (None,)
    assert selfcheck.chain_settings(sm100, None) == (None,)  # custom_kernel: as the process runs it
    assert selfcheck.chain_settings(Hopper(), choices["per_tile"]) == (None,)
    # NVFP4_SM100_CHAIN_CALLS=0: chaining is off for the whole process, timed unchained only
    monkeypatch.setattr(submission, "SM100_CHAIN_CALLS", False)
    assert selfcheck.chain_settings(sm100, choices["per_tile"]) == (False,)


def test_an_unchained_timing_builds_unchained_launches(monkeypatch):
    """_time_row with chain=False builds its launches (compiles keyed on the switch) with
    SM100_CHAIN_CALLS off, restores it after, and says so in its row."""
    import helpers

    fakes, _run = helpers.sm100_runtime(monkeypatch)
    monkeypatch.setattr(submission, "SM100_CHAIN_CALLS", True)  # the default (the fakes' fixture turns it off)
    seen = []
    fake_gemm = submission.compile_gemm
    monkeypatch.setattr(submission, "compile_gemm",
                        lambda *args: seen.append(submission.SM100_CHAIN_CALLS) or fake_gemm(*args))
    backend = submission._BACKEND_BY_DEVICE[None]
    sizes = [(40, 128, 256, 1), (72, 64, 512, 1)]

    def time_kernel(run_one, count, repeats):
        for index in range(count):
            run_one(index)
            run_one(index)
        return 12.5

    monkeypatch.setattr(selfcheck, "time_kernel", time_kernel)

    def generate_input(seed, **_):
        fakes.data = helpers.official_inputs(sizes, seed=seed)
        return fakes.data

    for chain in (False, True):
        seen.clear()
        row = selfcheck._time_row(backend, submission.SM100_CHOICES["per_tile"], {"seed": 1}, "benchmark 0",
                                  "per_tile", 1, generate_input, chain)
        assert row == {"case": "benchmark 0", "kernel": "per_tile", "chained": chain, "us": 12.5}
        assert seen and set(seen) == {chain}
        assert submission.SM100_CHAIN_CALLS is True


# ----------------------------------------------------------------------------- chained-call patterns
def _pattern_fakes(monkeypatch):
    """The leaderboard runtime on CPU fakes (each launch computes the input set of its own
    call), small pattern sizes on the CPU, and the patterns' synchronizations counted."""
    import helpers

    fakes, _run = helpers.sm100_runtime(monkeypatch)
    monkeypatch.setattr(submission, "SM100_CHAIN_CALLS", True)
    syncs = []
    monkeypatch.setattr(selfcheck, "synchronize", lambda: syncs.append(len(fakes.ran)))
    monkeypatch.setattr(selfcheck, "PATTERN_SIZES", (
        ("small", {"m": (40, 72), "n": (128, 64), "k": (256, 512), "g": 2, "seed": 5, "device": "cpu"}),))
    real_forced = selfcheck.run_forced

    def forced(backend, choice, data):
        fakes.data = data
        outputs, launch = real_forced(backend, choice, data)

        def launch_this_set():
            fakes.data = data
            launch()

        return outputs, launch_this_set

    monkeypatch.setattr(selfcheck, "run_forced", forced)
    return fakes, submission._BACKEND_BY_DEVICE[None], syncs


def test_patterns_check_every_output_of_back_to_back_calls(monkeypatch, capsys):
    fakes, backend, syncs = _pattern_fakes(monkeypatch)
    rows = selfcheck.chained_pattern_rows(backend, submission.SM100_CHOICES["per_tile"], "per_tile", True)
    assert [(row["case"], row["status"], row["chained"]) for row in rows] == [
        ("small same c", "pass", True), ("small alternating", "pass", True)]
    # per pattern: 4 prefixes, each with one synchronization before its calls and one after
    assert len(syncs) == 2 * 2 * selfcheck.PATTERN_CALLS
    # every launch of a prefix between its two synchronizations: 1 + 2 + 3 + 4 per pattern
    assert [after - before for before, after in zip(syncs[0::2], syncs[1::2])] == [1, 2, 3, 4] * 2
    assert all(chained for _, chained in fakes.ran_chained)
    assert "every output exact" in capsys.readouterr().out


def test_a_race_between_chained_calls_is_named_by_kernel_pattern_and_call(monkeypatch, capsys):
    """A kernel whose chained calls let the previous call's writes land after its own (what a
    missing wait would do): every prefix of two or more calls on one c disagrees, and the row
    names the kernel, the pattern and the call; the same kernel unchained passes."""
    fakes, backend, _syncs = _pattern_fakes(monkeypatch)
    previous = {"data": None}
    counting_sync = selfcheck.synchronize

    def synchronize():
        previous["data"] = None  # everything before is done
        counting_sync()

    monkeypatch.setattr(selfcheck, "synchronize", synchronize)
    exact = submission.exact_decode_group_gemm

    def racing(data, outputs):
        exact(data, outputs)
        last, previous["data"] = previous["data"], data
        chained = fakes.ran_chained[-1][1]
        if chained and last is not None and last[0][0][2] is data[0][0][2]:  # the same c, not yet synchronized
            exact(last, outputs)  # the previous call's late writes land last

    fakes.compute["per_tile_gemm"] = racing
    chained = selfcheck.chained_pattern_rows(backend, submission.SM100_CHOICES["per_tile"], "per_tile", True)
    same_c, alternating = chained
    assert same_c["status"] == "MISMATCH" and same_c["failures"][0].startswith("call 2 of 2: ")
    assert len(same_c["failures"]) == selfcheck.PATTERN_CALLS - 1  # the prefixes of 2, 3 and 4 calls
    assert alternating["status"] == "pass"  # consecutive calls there write different c's
    out = capsys.readouterr().out
    assert "small same c" in out and "per_tile chained" in out and "MISMATCH" in out
    unchained = selfcheck.chained_pattern_rows(backend, submission.SM100_CHOICES["per_tile"], "per_tile", False)
    assert [row["status"] for row in unchained] == ["pass", "pass"]


@pytest.mark.parametrize("w4a16", [False, True], ids=["fp4", "w4a16"])
def test_the_moe_pattern_checks_every_call_and_names_the_wrong_one(monkeypatch, capsys, w4a16):
    """The MoE entry's pattern (MOE_ROUTINGS back to back on one plan) checked on a CPU with the
    entry replaced: the exact decode passes every call; an entry that writes one wrong output in
    the fourth call, or rows of c under invalid offsets, or a wrong status, is a MISMATCH naming
    the call and what is wrong; the row names its kernel (moe or moe_w4a16)."""
    import nvfp4_group_gemm
    from nvfp4_group_gemm import moe

    monkeypatch.setattr(selfcheck, "synchronize", lambda: None)
    monkeypatch.setattr(nvfp4_group_gemm, "reset_runtime", lambda: None)
    calls = []

    def entry(a, sfa, b, sfb, offsets, c, status=None, alpha=None):
        calls.append(offsets)
        moe.exact_moe_call(a, sfa, b, sfb, offsets, c, status, alpha)

    monkeypatch.setattr(nvfp4_group_gemm, "moe_grouped_gemm", entry)
    [row] = selfcheck.moe_pattern_rows(None, w4a16=w4a16, device="cpu")
    assert row["status"] == "pass" and row["kernel"] == ("moe_w4a16" if w4a16 else "moe"), row
    assert len(calls) == 1 + len(selfcheck.MOE_ROUTINGS)

    def wrong_fourth(a, sfa, b, sfb, offsets, c, status=None, alpha=None):
        entry(a, sfa, b, sfb, offsets, c, status, alpha)
        if len(calls) == 5:  # the first call compiles; then the pattern's calls 1 .. 6
            c[5, 3] += 100
    monkeypatch.setattr(nvfp4_group_gemm, "moe_grouped_gemm", wrong_fourth)
    calls.clear()
    [row] = selfcheck.moe_pattern_rows(None, w4a16=w4a16, device="cpu")
    assert row["status"] == "MISMATCH" and row["failures"] == ["call 4 (valid): 1 outputs differ"], row

    def writes_under_bad_offsets(a, sfa, b, sfb, offsets, c, status=None, alpha=None):
        entry(a, sfa, b, sfb, offsets, c, status, alpha)
        if int(status) == 1:
            c.zero_()
            status.fill_(0)
    monkeypatch.setattr(nvfp4_group_gemm, "moe_grouped_gemm", writes_under_bad_offsets)
    [row] = selfcheck.moe_pattern_rows(None, w4a16=w4a16, device="cpu")
    assert row["failures"] == ["call 3 (decreasing): status 0", "call 3 (decreasing): c written with invalid offsets",
                               "call 5 (past T): status 0", "call 5 (past T): c written with invalid offsets"], row
    assert "moe routings" in capsys.readouterr().out
