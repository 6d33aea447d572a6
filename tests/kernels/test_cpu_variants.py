"""The CPU kernels built ahead of time (kernels/cpu/build.py) and the variant the loader picks
(kernels/cpu/loader.py): every library is built for every x86 level at install time, the best
level this CPU runs is loaded, a level it cannot run is never loaded, a missing build or a
failing compiler says so instead of falling back quietly."""

from __future__ import annotations

import os

import pytest

from kvpilot.engine.cpu.info import CpuInfo, detect_cpu
from kvpilot.kernels.cpu import build, loader

AVX2_EPYC = {"sse4_1", "sse4_2", "ssse3", "popcnt", "cx16", "lahf_lm", "avx", "avx2", "bmi1", "bmi2", "f16c",
             "fma", "abm", "movbe", "xsave"}
SKYLAKE_X = AVX2_EPYC | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ZEN4 = SKYLAKE_X | {"avx512_bf16", "avx512_vnni", "avx512vbmi"}
SAPPHIRE_RAPIDS = ZEN4 | {"avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}


def test_the_install_built_every_library_for_every_level():
    manifest = loader.manifest()
    assert set(manifest["variants"]) == {v.name for v in build.variants()}
    assert manifest["libraries"] == sorted(build.LIBRARIES)
    for variant in manifest["variants"]:
        for library in build.LIBRARIES:
            path = build.library_path(loader.LIB_DIR, variant, library)
            assert path.stat().st_size > 0, f"{path} missing"


@pytest.fixture
def x86_manifest(monkeypatch):
    """The loader reads an x86 install's manifest (every level of build.X86_VARIANTS), so the choice
    among levels is checked whatever machine built the kernels here."""
    built = {"machine": "x86_64", "libraries": sorted(build.LIBRARIES),
             "variants": {v.name: {"cflags": list(v.cflags), "cpu_flags": list(v.cpu_flags)}
                          for v in build.X86_VARIANTS}}
    monkeypatch.setattr(loader, "manifest", lambda lib_dir=loader.LIB_DIR: built)
    return built


@pytest.mark.parametrize("flags, best", [
    (set(), "generic"),
    (AVX2_EPYC - {"fma"}, "generic"),  # AVX2 without FMA runs no x86-64-v3 code
    (AVX2_EPYC, "x86-64-v3"),
    (SKYLAKE_X, "avx512"),
    (ZEN4, "avx512_bf16"),
    (SAPPHIRE_RAPIDS, "amx"),
])
def test_the_best_level_a_cpu_runs_is_chosen(x86_manifest, flags, best):
    assert loader.variants_runnable(frozenset(flags))[-1] == best


def test_this_cpu_loads_its_best_level_and_each_level_it_runs_has_its_instructions():
    flags = detect_cpu().flags
    runnable = loader.variants_runnable()
    assert loader.selected_variant() == runnable[-1]
    for variant in runnable:
        avx2 = variant != "generic"
        assert loader.load("gguf", variant).kvp_gguf_simd() == avx2
        assert loader.load("attention", variant).kvp_prefill_simd() == avx2
        assert loader.load("attention_bf16", variant).kvp_prefill_simd() == avx2
        avx512 = variant in ("avx512", "avx512_bf16", "amx")
        assert loader.load("attention", variant).kvp_elementwise_simd() == avx512
        assert loader.load("attention_bf16", variant).kvp_elementwise_simd() == avx512
        bf16 = variant in ("avx512_bf16", "amx")
        assert loader.load("bf16_gemm", variant).kvp_bf16_gemm_simd() == bf16
        assert set(loader.manifest()["variants"][variant]["cpu_flags"]) <= flags


def test_a_level_the_cpu_cannot_run_is_never_loaded(x86_manifest, monkeypatch):
    monkeypatch.setattr(loader, "detect_cpu", lambda: CpuInfo("an AVX2 EPYC", frozenset(AVX2_EPYC)))
    opened = []
    monkeypatch.setattr(loader, "_open", lambda path: opened.append(path))
    for variant in ("avx512", "avx512_bf16", "amx"):
        with pytest.raises(ValueError, match=f"cannot run the {variant} kernels.*avx512"):
            loader.load("attention", variant)
    assert opened == []
    assert loader.variants_runnable(frozenset(AVX2_EPYC)) == ["generic", "x86-64-v3"]


def test_without_a_build_loading_says_how_to_build(monkeypatch, tmp_path):
    monkeypatch.setattr(loader, "LIB_DIR", tmp_path)
    loader.manifest.cache_clear()
    try:
        with pytest.raises(loader.KernelsNotBuilt, match="pip install -e"):
            loader.manifest(tmp_path)
    finally:
        loader.manifest.cache_clear()


def test_a_compiler_error_fails_the_build_with_the_compilers_message(monkeypatch, tmp_path):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'attention.c:1: error: something the compiler says' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(build.BuildError, match="(?s)failed to build.*something the compiler says"):
        build.build_all(tmp_path / "out", only=("generic",), jobs=1)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(build.BuildError, match="needs a C compiler"):
        build.build_all(tmp_path / "out", only=("generic",))


def test_the_shipped_sources_build_the_generic_level(tmp_path):
    manifest = build.build_all(tmp_path, only=("generic",), jobs=os.cpu_count())
    assert set(manifest["variants"]) == {"generic"} and manifest["compile_s"]
    for library in build.LIBRARIES:
        assert build.library_path(tmp_path, "generic", library).stat().st_size > 0


def test_the_selected_build_is_checked_once_and_a_named_variant_every_time(monkeypatch):
    lib = loader.load("attention")  # the kernels' wrappers call this on every kernel call
    checks = []
    monkeypatch.setattr(loader, "runnable", lambda variant, flags: checks.append(variant) or True)
    assert loader.load("attention") is lib and checks == []
    variant = loader.selected_variant()
    assert loader.load("attention", variant) is lib and checks == [variant]
