"""Compile keys derived from the call (core.compile_key), never typed at it: a build is a
module-level function whose every argument, the DSL options and the traced switches make the
key; a lambda or a closure, which could bake in what the key does not hold, is refused."""

import pytest

from nvfp4_group_gemm import core


def counted_build(num_groups, config):
    BUILDS.append((num_groups, config))
    return (lambda *args: None), (num_groups,)


BUILDS: list = []


@pytest.fixture
def fake_compile(monkeypatch):
    compiled = []
    monkeypatch.setattr(core.cute, "compile", lambda fn, *args, **kwargs: compiled.append((args, kwargs)) or object())
    monkeypatch.setattr(core, "_COMPILED", {})
    BUILDS.clear()
    return compiled


def test_one_build_per_key_and_a_key_per_argument_option_and_switch(fake_compile, monkeypatch):
    first = core.compile_once(counted_build, 2, "a")
    assert core.compile_once(counted_build, 2, "a") is first and len(BUILDS) == 1  # a hit builds nothing
    core.compile_once(counted_build, 3, "a")
    core.compile_once(counted_build, 2, "b")
    core.compile_once(counted_build, 2, "a", options="--gpu-arch sm_90a")
    monkeypatch.setattr(core, "SM100_CHAIN_CALLS", not core.SM100_CHAIN_CALLS)
    core.compile_once(counted_build, 2, "a")
    assert BUILDS == [(2, "a"), (3, "a"), (2, "b"), (2, "a"), (2, "a")]
    assert fake_compile[3][1] == {"options": "--gpu-arch sm_90a"} and fake_compile[0][1] == {}
    key = core.compile_key(counted_build, (2, "a"), None)
    assert key[:4] == (__name__, "counted_build", (2, "a"), None)
    assert key[4] == (("SM100_CHAIN_CALLS", core.SM100_CHAIN_CALLS),)


def test_a_lambda_or_a_closure_is_refused(fake_compile):
    with pytest.raises(TypeError, match=r"compile_once: build .*<lambda> must be a module-level function"):
        core.compile_once(lambda: (None, ()))
    hidden = 7

    def closure():
        return None, (hidden,)

    with pytest.raises(TypeError, match=r"closure must be a module-level function"):
        core.compile_once(closure)
    assert fake_compile == []


def test_every_backend_builds_through_keyed_module_level_builds(fake_compile, monkeypatch):
    """Each compile function of each backend reaches compile_once with a module-level build and
    its arguments: two calls with different arguments make two keys."""
    from nvfp4_group_gemm import sm100, sm100_moe
    from nvfp4_group_gemm.hopper import config, kernel, moe, swap_ab

    seen = []
    real = core.compile_once

    def record(build, *args, options=None, context=None):
        seen.append(core.compile_key(build, args, options))
        assert build.__closure__ is None and build.__name__ != "<lambda>"
        return real  # no build

    monkeypatch.setattr(core, "compile_once", record)
    persistent = core.PERSISTENT_CONFIGS[128]
    calls = [
        lambda g: core.compile_init_tensormaps(g), lambda g: core.compile_gemm(g),
        lambda g: core.compile_persistent_init(core.PERSISTENT_CONFIGS[128 * g]),
        lambda g: core.compile_persistent_gemm(core.PERSISTENT_CONFIGS[128 * g]),
        lambda g: sm100.compile_per_tile_init(g), lambda g: sm100.compile_per_tile_gemm(g),
        lambda g: sm100.compile_persistent_init(core.PERSISTENT_CONFIGS[128 * g]),
        lambda g: sm100.compile_persistent_gemm(core.PERSISTENT_CONFIGS[128 * g]),
        lambda g: sm100_moe.compile_moe_tables(core.PERSISTENT_CONFIGS[128 * g]),
        lambda g: sm100_moe.compile_moe_gemm(core.PERSISTENT_CONFIGS[128 * g]),
        lambda g: kernel.compile_gemm(g), lambda g: swap_ab.compile_swap_ab_gemm(g),
        lambda g: swap_ab.compile_decode_activations(g), lambda g: moe.compile_moe_gemm(g),
        lambda g: moe.compile_moe_decode(g, scale_layout="blocked"),
    ]
    for call in calls:
        call(1)
        call(2)
    assert len(set(seen)) == len(seen) == 2 * len(calls)
    assert persistent in {arg for key in seen for arg in key[2]} and config.SWAP_AB_CONFIG in {
        arg for key in seen for arg in key[2]}
