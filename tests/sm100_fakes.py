"""CPU stand-ins for the sm_100 kernels, shared by the runtime tests that drive the real
sm_100 backend on a CPU: official input sets, the exact expected result, and FakeKernels (each
compiled 'kernel' writes the exact result, or a wrong one, or raises, as told)."""

import torch

import reference
import submission


def official_inputs(sizes, seed=7):
    """CPU input set from the reference generator (plain and reordered scales agree)."""
    m, n, k = (tuple(s[i] for s in sizes) for i in range(3))
    return reference.generate_input(m=m, n=n, k=k, g=len(sizes), seed=seed, device="cpu")


def expected(data):
    """The reference's own exact decode (plain scales), on fresh tensors."""
    clone = (
        [(a, b, c.clone()) for a, b, c in data[0]], data[1], data[2], data[3],
    )
    return [c.clone() for c in reference.ref_kernel(clone)]


def assert_exact(outputs, data):
    for got, want in zip(outputs, expected(data)):
        assert torch.equal(got, want)


class FakeKernels:
    """Stand-ins for the sm_100 compilers: each compiled 'kernel' writes the exact result of
    the input set being run (or a wrong one), or raises, as told."""

    def __init__(self):
        self.data = None
        self.compiled, self.ran = [], []
        self.compile_fails, self.launch_fails, self.wrong = set(), set(), set()
        self.scaled_mm_runs = 0

    def compiler(self, name):
        def compile_fn(*_args):
            self.compiled.append(name)
            if name in self.compile_fails:
                raise RuntimeError(f"{name}: boom at compile")
            if name.endswith("init"):
                return lambda *args: None

            def kernel(*_args):
                self.ran.append(name)
                if name in self.launch_fails:
                    raise RuntimeError(f"kernel launch failed: CUresult 1 ({name})")
                outputs = [c for _, _, c in self.data[0]]
                submission.exact_decode_group_gemm(self.data, outputs)
                if name in self.wrong:
                    outputs[0][1, 2, 0] += 1.0

            return kernel

        return compile_fn

    def scaled_mm(self, data, outputs):
        # torch._scaled_mm takes no float4 on a CPU: the exact decode stands in for it
        self.scaled_mm_runs += 1
        return submission.exact_decode_group_gemm(data, outputs)


def sm100_runtime(monkeypatch):
    """A test module's fixture (`sm100_runtime = pytest.fixture(sm100_fakes.sm100_runtime)`):
    custom_kernel on CPU tensors through the real sm_100 backend and runtime, its compilers
    replaced by FakeKernels, its oracle the exact decode. Yields (fakes, run(data))."""
    fakes = FakeKernels()
    monkeypatch.setattr(submission, "compile_persistent_init", fakes.compiler("persistent_init"))
    monkeypatch.setattr(submission, "compile_persistent_gemm", fakes.compiler("persistent_gemm"))
    monkeypatch.setattr(submission, "compile_init_tensormaps", fakes.compiler("per_tile_init"))
    monkeypatch.setattr(submission, "compile_gemm", fakes.compiler("per_tile_gemm"))
    monkeypatch.setattr(submission, "make_launcher", lambda fn, *args: lambda: fn(*args))
    monkeypatch.setitem(submission.HOST_COMPUTATIONS, "scaled_mm", fakes.scaled_mm)
    # the CPU stands in for the B200: sm_100's chain with the exact decode as its oracle
    backend = submission.Sm100Backend("persistent")
    monkeypatch.setattr(type(backend), "oracle", submission.KernelChoice("sm100", "exact_decode", host=True))
    # the caches, demotions and checks start empty (conftest resets them around every test)
    monkeypatch.setattr(submission, "_BACKEND_BY_DEVICE", {None: backend})
    monkeypatch.setattr(submission, "SELF_CHECK", True)
    real_validate = submission.validate_inputs

    def validate_except_device(data):
        try:
            return real_validate(data)
        except ValueError as exc:
            if "must be on a CUDA device" not in str(exc):
                raise
            return tuple(tuple(int(v) for v in p) for p in data[3])

    monkeypatch.setattr(submission, "validate_inputs", validate_except_device)
    monkeypatch.setattr(submission, "_same_device_and_aligned", lambda data: True)
    monkeypatch.setattr(submission, "_current_raw_stream", None)
    monkeypatch.setattr(submission, "_stream_for_current", lambda: "stream-0")

    def run(data):
        fakes.data = data
        return submission.custom_kernel(data)

    return fakes, run


