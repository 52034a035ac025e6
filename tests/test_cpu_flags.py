"""Which instruction set the kernels may use: /proc/cpuinfo, checked against a CPUID probe."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from radixlm.model import native_build

HOST_AVX512 = frozenset({"sse2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"})


@pytest.fixture(autouse=True)
def _fresh_flags() -> Iterator[None]:
    native_build.cpu_flags.cache_clear()
    yield
    native_build.cpu_flags.cache_clear()


def test_the_probe_removes_what_an_emulated_cpu_lacks() -> None:
    """qemu-user shows the host's /proc/cpuinfo (AVX-512 here) to a guest CPU without AVX-512:
    the probe's answer wins, so the avx512 build is never chosen there."""
    narrowed = native_build._within(HOST_AVX512, native_build.AVX2.needs)
    assert not any(f.startswith("avx512") for f in narrowed)
    assert {"avx2", "fma", "sse2"} <= narrowed


def test_the_probe_can_remove_avx2_too() -> None:
    assert native_build._within(HOST_AVX512, frozenset()) == {"sse2", "avx"}


def test_a_probe_that_agrees_changes_nothing() -> None:
    probed = native_build.AVX512.needs | native_build.AVX2.needs | {"avx512_bf16"}
    assert native_build._within(HOST_AVX512, probed) == HOST_AVX512


def test_the_variant_follows_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_build, "_probed_flags", lambda: native_build.AVX2.needs)
    monkeypatch.delenv("RADIXLM_ISA", raising=False)
    assert "avx512" not in [v.name for v in native_build.executable_variants()]
    if native_build.X86 and "avx2" in native_build.cpu_flags():
        assert native_build.chosen_variant() is native_build.AVX2
