"""The leaderboard file's own runtime (submission.custom_kernel: plans, bindings, the fallback
chain and self-check, launches on the default stream) on a real GPU without a B200: on an
H100/H200 the library's Hopper backend stands in for the sm_100 one (its `launcher` launches on
the default stream, as submission.Backend asks), so everything of submission.py but the sm_100a
kernels runs here as the harness runs it on a B200."""

import ast
from pathlib import Path

import pytest
import torch

from nvfp4_group_gemm import core as submission
from reference import check_implementation, generate_input, ref_kernel

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 (Hopper) GPU",
)


@pytest.fixture
def hopper_in_the_leaderboard_runtime(monkeypatch):
    from nvfp4_group_gemm import hopper

    backend = hopper.make_backend()
    assert isinstance(backend, submission.Backend)
    monkeypatch.setattr(submission, "_BACKEND_BY_DEVICE", {torch.cuda.current_device(): backend})
    monkeypatch.setattr(submission, "SELF_CHECK", True)
    return backend


def read_cases(name: str) -> list[dict]:
    """The shipped case file's cases as generate_input's arguments (`m: [..]; n: [..]; k: [..];
    g: 2; seed: 1111` per line)."""
    cases = []
    for line in (Path(__file__).parent / "cases" / name).read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            fields = dict(part.split(":", 1) for part in line.split(";"))
            case = {key.strip(): ast.literal_eval(value.strip()) for key, value in fields.items()}
            cases.append({key: tuple(v) if isinstance(v, list) else v for key, v in case.items()})
    return cases


def _expected(data):
    clone = ([(a, b, c.clone()) for a, b, c in data[0]], data[1], data[2], data[3])
    return [c.clone() for c in ref_kernel(clone)]


@pytest.mark.parametrize("cases", ["tests.txt", "benchmarks.txt"])
def test_the_official_cases_are_exact_through_the_leaderboard_runtime(hopper_in_the_leaderboard_runtime, cases, capsys):
    for case in read_cases(cases):
        data = generate_input(**case)
        expected = _expected(data)
        for _ in range(2):  # the first call binds and self-checks, the second is a hit
            for _, _, c in data[0]:
                c.fill_(float("nan"))
            outputs = submission.custom_kernel(data)
            torch.cuda.synchronize()
            ok, message = check_implementation(data, outputs)
            assert ok, (case, message)
            assert all(torch.equal(got, want) for got, want in zip(outputs, expected)), case
    assert capsys.readouterr().err == ""  # no demotion, no skipped check
    assert submission.SELF_CHECKED and not submission.DEMOTED


def test_a_wrong_first_link_is_demoted_by_the_leaderboard_self_check(hopper_in_the_leaderboard_runtime, monkeypatch,
                                                                      capsys):
    backend = hopper_in_the_leaderboard_runtime
    real_launcher = type(backend).launcher

    def corrupting_launcher(self, plan, binding):
        """The real launch, then one wrong element of group 0's C."""
        launch = real_launcher(self, plan, binding)

        def corrupted():
            launch()
            outputs[0][1, 2, 0] += 1.0

        return corrupted

    data = generate_input(m=(40, 129), n=(128, 384), k=(256, 512), g=2, seed=5)
    outputs = [c for _, _, c in data[0]]
    monkeypatch.setattr(type(backend), "launcher", corrupting_launcher)
    result = submission.custom_kernel(data)  # checked, demoted, the oracle's result returned
    assert all(torch.equal(got, want) for got, want in zip(result, _expected(data)))
    monkeypatch.setattr(type(backend), "launcher", real_launcher)
    for c in outputs:
        c.fill_(float("nan"))
    result = submission.custom_kernel(data)  # the next link, checked at its own first use
    assert all(torch.equal(got, want) for got, want in zip(result, _expected(data)))
    line = capsys.readouterr().err.strip()
    assert "self-check:" in line and "demoted for this process" in line and "\n" not in line
    assert len(submission.DEMOTED) == 1
