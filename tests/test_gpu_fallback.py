"""The fallback chain and the first-use self-check on a real sm_90 GPU (the H200): a test-only
backend whose first link is the real automatic choice with one corrupted output element is
demoted by the self-check, with one line on stderr, and every call returns the exact result;
the next link (the real automatic choice) is checked at its own first use and kept."""

import pytest
import torch

from nvfp4_group_gemm import core as submission
from nvfp4_group_gemm import runtime
from reference import generate_input, ref_kernel

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 (Hopper) GPU",
)

SIZES = {"m": (40, 129, 0, 200), "n": (128, 384, 256, 256), "k": (256, 512, 256, 768), "g": 4}


def _expected(data):
    clone = ([(a, b, c.clone()) for a, b, c in data[0]], data[1], data[2], data[3])
    return [c.clone() for c in ref_kernel(clone)]


@pytest.fixture
def self_check_on(monkeypatch):
    """The self-check on whatever NVFP4_SELF_CHECK says (the runtime's caches, demotions and
    checks are reset around every test by conftest)."""
    monkeypatch.setattr(submission, "SELF_CHECK", True)


def _corrupting_backend():
    from nvfp4_group_gemm import hopper

    class CorruptingBackend(hopper.backend.Sm90Backend):
        """The default chain behind a first link that runs the automatic choice, then adds
        1 to C[0][1, 2] (a kernel with one wrong output)."""

        def kernel_chain(self, problem_sizes):
            chain = super().kernel_chain(problem_sizes)
            first = chain[0]
            corrupted = submission.KernelChoice("sm90", "corrupted_" + first.name, first.config, per_group_count=True)
            return [corrupted, *chain]

        def launch_args(self, plan, binding, stream):
            launches = super().launch_args(plan, binding, stream)
            if not plan.choice.name.startswith("corrupted_"):
                return launches
            c0 = self.outputs[0]

            def corrupt():
                c0[1, 2, 0] += 1.0

            return [*launches, (corrupt, ())]

    return CorruptingBackend(kernel="swap_ab")


def test_self_check_demotes_a_wrong_kernel_on_the_gpu(self_check_on, monkeypatch, capfd):
    backend = _corrupting_backend()
    monkeypatch.setattr(runtime, "_BACKEND_BY_DEVICE", {torch.cuda.current_device(): backend})
    data = generate_input(**SIZES, seed=11)
    backend.outputs = [c for _, _, c in data[0]]
    want = _expected(data)
    out = runtime.custom_kernel(data)
    torch.cuda.synchronize()
    assert all(torch.equal(o, w) for o, w in zip(out, want)), "the oracle's result is returned"
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("nvfp4_group_gemm:")]
    assert len(lines) == 1, lines
    assert "sm90 kernel corrupted_swap_ab" in lines[0]
    assert "self-check: 1 of" in lines[0] and "(first: group 0 [1, 2])" in lines[0]
    assert lines[0].endswith("next: swap_ab")
    # The next call runs the real automatic choice, checked at its own first use, and kept
    data[0][0][2].zero_()
    out = runtime.custom_kernel(data)
    torch.cuda.synchronize()
    assert all(torch.equal(o, w) for o, w in zip(out, want))
    (binding,) = runtime.RUNTIME.bindings.entries.values()
    assert binding.plan.choice.name == "swap_ab" and binding.plan.kernel_key in submission.SELF_CHECKED
    assert [line for line in capfd.readouterr().err.splitlines() if line.startswith("nvfp4_group_gemm:")] == []
    # Later calls: the kept kernel, exact, no oracle run
    for _ in range(3):
        out = runtime.custom_kernel(data)
    torch.cuda.synchronize()
    assert all(torch.equal(o, w) for o, w in zip(out, want))


def test_a_launch_error_falls_back_on_the_gpu(self_check_on, monkeypatch, capfd):
    """A launch that fails synchronously (context still usable) moves down to the next link."""
    from nvfp4_group_gemm import hopper

    class FailingLaunchBackend(hopper.backend.Sm90Backend):
        def launch_args(self, plan, binding, stream):
            if plan.choice.name == "swap_ab":
                def refuse():
                    raise RuntimeError("kernel launch failed: CUresult 1 (injected)")
                return [(refuse, ())]
            return super().launch_args(plan, binding, stream)

    monkeypatch.setattr(runtime, "_BACKEND_BY_DEVICE", {torch.cuda.current_device(): FailingLaunchBackend()})
    data = generate_input(**SIZES, seed=12)
    want = _expected(data)
    out = runtime.custom_kernel(data)
    torch.cuda.synchronize()
    assert all(torch.equal(o, w) for o, w in zip(out, want))
    (line,) = [line for line in capfd.readouterr().err.splitlines() if line.startswith("nvfp4_group_gemm:")]
    assert "sm90 kernel swap_ab" in line and "launch failed" in line and line.endswith("next: in_gemm_decode")
    (binding,) = runtime.RUNTIME.bindings.entries.values()
    assert binding.plan.choice.name == "in_gemm_decode"


def test_the_default_chain_passes_its_self_check(self_check_on, monkeypatch, capfd):
    monkeypatch.setattr(runtime, "_BACKEND_BY_DEVICE", {})
    data = generate_input(**SIZES, seed=13)
    want = _expected(data)
    out = runtime.custom_kernel(data)
    torch.cuda.synchronize()
    assert all(torch.equal(o, w) for o, w in zip(out, want))
    assert submission.DEMOTED == {} and len(submission.SELF_CHECKED) == 1
    assert [line for line in capfd.readouterr().err.splitlines() if line.startswith("nvfp4_group_gemm:")] == []
