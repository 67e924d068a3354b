"""The compiled kernels' cache: a private folder, atomic builds, only trusted files loaded, any failure a fallback.

The real library is built once per session (as in test_cpu_kernels.py); every
other "build" here runs a stand-in compiler, a shell script that copies a
prepared library to the ``-o`` path, so each test takes milliseconds. The
stand-in's path is part of the library's name (the cache key includes the
compiler), so each test's cache entry is its own.
"""
from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from paged_runtime.config import default_cache_dir
from paged_runtime.kernels import cpu
from paged_runtime.layers.ops import CpuKernelOps, TorchOps, select_ops

pytestmark = pytest.mark.skipif(not cpu.load(default_cache_dir()), reason="no C compiler: the CPU kernels are off")

# pr_abi only: every other symbol is missing.
MISSING_SYMBOLS_C = "long pr_abi(int i) { return 0; }\n"
# Every symbol, but pr_abi reports struct sizes cpu.py does not have.
WRONG_ABI_C = "long pr_abi(int i) { return 1; }\n" + "".join(
    f"int {name}(void) {{ return 0; }}\n" for name in cpu._SIGNATURES if name != "pr_abi")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == cpu.__name__]


@pytest.fixture(scope="session")
def real_library() -> Path:
    """The library the session built (and loaded) in the default cache."""
    path = cpu.library_path(default_cache_dir())
    if not path.is_file():
        pytest.skip("the default cache folder is not trusted here: the session's library lives in a temp folder")
    return path


@pytest.fixture(scope="session")
def stubs(tmp_path_factory) -> dict[str, Path]:
    """Small libraries that are not the kernels: one missing symbols, one with another ABI, one not ELF."""
    folder = tmp_path_factory.mktemp("stubs")
    out = {}
    for name, source in (("missing", MISSING_SYMBOLS_C), ("abi", WRONG_ABI_C)):
        (folder / f"{name}.c").write_text(source)
        subprocess.run([cpu._compiler(), "-shared", "-fPIC", str(folder / f"{name}.c"), "-o",
                        str(folder / f"{name}.so")], check=True, capture_output=True, timeout=60)
        out[name] = folder / f"{name}.so"
    (folder / "garbage.so").write_bytes(b"not a shared library\n")
    out["garbage"] = folder / "garbage.so"
    return out


@pytest.fixture
def compile_as(tmp_path, monkeypatch):
    """compile_as(library): the next build in this test copies ``library`` (mode 0777, as a linker under
    umask 0 would leave it) instead of compiling; returns the cache folder to load from."""
    # load() is cached per folder and sets the process-wide library: both restored after the test.
    monkeypatch.setattr(cpu._Loaded, "lib", cpu._Loaded.lib)
    monkeypatch.setattr(cpu._Loaded, "isa", cpu._Loaded.isa)
    monkeypatch.setattr(cpu._Loaded, "max_rows", cpu._Loaded.max_rows)

    def use(library: Path) -> Path:
        script = tmp_path / "fake-cc"
        script.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
                          f'cp "{library}" "$out" && chmod 777 "$out"\n')
        script.chmod(0o700)
        monkeypatch.setenv("CC", str(script))
        return tmp_path / "cache"
    return use


def plant(cache: Path, library: Path, file_mode: int = 0o600, folder_mode: int = 0o700) -> Path:
    """Puts ``library`` where load(cache) looks for the kernels, as someone other than the build would."""
    target = cpu.library_path(cache)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(library, target)
    target.chmod(file_mode)
    target.parent.chmod(folder_mode)
    return target


def test_a_fresh_build_is_private_whatever_the_umask(compile_as, real_library):
    cache = compile_as(real_library)
    old_umask = os.umask(0)
    try:
        assert cpu.load(cache)
    finally:
        os.umask(old_umask)
    target = cpu.library_path(cache)
    assert mode(target.parent) == 0o700 and os.stat(target.parent).st_uid == os.geteuid()
    assert mode(target) in (0o600, 0o700) and os.stat(target).st_uid == os.geteuid()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no temporary file left behind
    assert cpu.max_rows() > 0


def test_a_cached_library_is_loaded_without_building(compile_as, real_library, caplog):
    cache = compile_as(Path("/nonexistent/not-a-library"))  # a build would fail
    plant(cache, real_library, file_mode=0o700)
    assert cpu.load(cache)
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("file_mode", [0o666, 0o620, 0o602], ids=oct)
def test_a_library_writable_by_others_is_never_loaded(compile_as, real_library, stubs, file_mode, caplog):
    # The planted file lacks the kernels' symbols: had it been loaded, load() would return False.
    cache = compile_as(real_library)
    planted = plant(cache, stubs["missing"], file_mode=file_mode)
    assert cpu.load(cache)  # built into a private temporary folder instead
    [warning] = warnings_of(caplog)
    assert "writable by group or others" in warning and str(planted.name) in warning
    assert mode(planted) == file_mode and planted.read_bytes() == stubs["missing"].read_bytes()  # left alone


def test_a_library_owned_by_another_user_is_never_loaded(compile_as, real_library, stubs, caplog):
    if os.geteuid() != 0:
        pytest.skip("only root can plant a file owned by another user")
    cache = compile_as(real_library)
    planted = plant(cache, stubs["missing"])
    os.chown(planted, 4321, 4321)
    assert cpu.load(cache)
    [warning] = warnings_of(caplog)
    assert "owned by uid 4321" in warning


def test_a_symlink_in_place_of_the_library_is_never_followed(compile_as, real_library, stubs, caplog):
    cache = compile_as(real_library)
    target = plant(cache, stubs["missing"])
    target.unlink()
    target.symlink_to(stubs["missing"])
    assert cpu.load(cache)
    [warning] = warnings_of(caplog)
    assert "not a regular file" in warning


@pytest.mark.parametrize("folder_mode", [0o777, 0o770, 0o1777], ids=oct)
def test_a_folder_writable_by_others_is_not_used(compile_as, real_library, stubs, folder_mode, caplog):
    cache = compile_as(real_library)
    planted = plant(cache, stubs["missing"], folder_mode=folder_mode)
    assert cpu.load(cache)
    [warning] = warnings_of(caplog)
    assert "writable by group or others" in warning and "temporary folder" in warning
    assert [p.name for p in planted.parent.iterdir()] == [planted.name]  # nothing built into it
    assert mode(planted.parent) == folder_mode


def test_a_folder_owned_by_another_user_is_not_used(compile_as, real_library, stubs, caplog):
    if os.geteuid() != 0:
        pytest.skip("only root can make a folder owned by another user")
    cache = compile_as(real_library)
    planted = plant(cache, stubs["missing"])
    os.chown(planted.parent, 4321, 4321)
    assert cpu.load(cache)
    [warning] = warnings_of(caplog)
    assert "owned by uid 4321" in warning


@pytest.mark.parametrize("stub", ["missing", "abi", "garbage"])
def test_a_library_that_does_not_load_falls_back_to_pytorch(compile_as, stubs, stub, caplog):
    """Missing symbols, another ABI (pr_abi's struct sizes), not a shared library: one warning, no crash,
    and the process's library (the session's) is untouched."""
    cache = compile_as(stubs[stub])
    loaded = cpu._Loaded.lib
    assert cpu.load(cache) is False
    [warning] = warnings_of(caplog)
    assert "PyTorch path" in warning
    assert cpu._Loaded.lib is loaded


def test_select_ops_runs_pytorch_when_the_kernels_do_not_load(compile_as, stubs, caplog):
    cache = compile_as(stubs["missing"])
    ops = select_ops(torch.device("cpu"), torch.float32, True, cache)
    assert type(ops) is TorchOps and not isinstance(ops, CpuKernelOps)


def test_a_failed_build_falls_back_to_pytorch(compile_as, caplog):
    cache = compile_as(Path("/nonexistent/not-a-library"))  # the stand-in compiler exits 1
    assert cpu.load(cache) is False
    [warning] = warnings_of(caplog)
    assert "PyTorch path" in warning
    assert [p for p in cpu.library_path(cache).parent.iterdir()] == []  # no temporary file left behind


def test_a_cache_that_cannot_be_created_builds_into_a_temporary_folder(compile_as, real_library, caplog):
    cache = compile_as(real_library)
    cache.write_text("a file where the cache folder should be")  # as a read-only home would refuse it
    assert cpu.load(cache)
    [warning] = warnings_of(caplog)
    assert "temporary folder" in warning


def test_the_isa_setting_names_its_build_and_refuses_what_the_cpu_lacks(monkeypatch):
    """$PAGED_RUNTIME_CPU_ISA picks -march (each its own cached library); a name outside ISAS or one this CPU
    cannot run is refused, naming the choices or the missing instruction sets."""
    names = {}
    for name in cpu.ISAS:
        if cpu.cpu_has(name):
            monkeypatch.setenv(cpu.ISA_ENV, name)
            names[name] = cpu.library_path("/c").name
    assert len(set(names.values())) == len(names) >= 2  # auto and scalar at least, on any x86-64
    monkeypatch.setenv(cpu.ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match="must be one of auto, amx, avx512_vnni, avx512, avx_vnni, avx2, scalar; "
                                         "got 'avx1024'"):
        cpu.isa()
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: "flags\t: fpu sse2 avx avx2 fma f16c")
    monkeypatch.setenv(cpu.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="avx512: this CPU lacks avx512bw, avx512cd, avx512dq, avx512f, avx512vl"):
        cpu.isa()
    with pytest.raises(ValueError, match="avx_vnni: this CPU lacks avx_vnni$"):
        cpu.load("/c", "avx_vnni")  # a name given by the caller (EngineConfig.cpu_isa) wins over the environment
    with pytest.raises(ValueError, match="avx512_vnni: this CPU lacks avx512_vnni, avx512bw, avx512cd"):
        cpu.isa("avx512_vnni")
    assert cpu.isa("avx2") == "avx2" and cpu.has_vector_paths("avx2")
    monkeypatch.setenv(cpu.ISA_ENV, "scalar")
    assert cpu.isa() == "scalar" and not cpu.has_vector_paths()  # the plain loops: "auto" leaves them off


def test_each_isa_builds_with_its_flags(monkeypatch):
    """The levels' compiler flags, best first; each is part of the cache key (a build per ISA)."""
    assert {name: " ".join(isa.flags) for name, isa in cpu.ISAS.items()} == {
        "auto": "-march=native", "amx": "-march=x86-64-v4 -mavx512vnni -mavx512bf16 -mamx-tile -mamx-int8",
        "avx512_vnni": "-march=x86-64-v4 -mavx512vnni", "avx512": "-march=x86-64-v4",
        "avx_vnni": "-march=x86-64-v3 -mavxvnni", "avx2": "-march=x86-64-v3", "scalar": "-march=x86-64"}
    every_flag = " ".join(flag for isa in cpu.ISAS.values() for flag in isa.needs)
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: f"flags\t: {every_flag}")
    assert len({cpu.library_path("/c", "cc", name) for name in cpu.ISAS}) == len(cpu.ISAS)


def variants_built_for(isa_name: str, monkeypatch) -> dict[str, str]:
    """``kernel_variants()`` of the library built for ``isa_name``, opened beside the process's own (which is
    back in place when the test ends)."""
    lib = cpu._open_cached_library(cpu._compiler(), default_cache_dir(), isa_name)
    cpu._bind(lib)
    monkeypatch.setattr(cpu._Loaded, "lib", lib)
    return cpu.kernel_variants()


FAMILIES = ["linear", "attention", "norms", "lora", "gguf", "gguf_x8"]


def test_kernel_variants_name_the_path_each_family_was_built_to(monkeypatch):
    assert list(cpu.kernel_variants()) == FAMILIES
    assert cpu.info() == {"isa": cpu._Loaded.isa, "variants": cpu.kernel_variants()}
    assert set(variants_built_for("scalar", monkeypatch).values()) == {"scalar"}
    if not cpu.cpu_has("avx512_vnni"):
        pytest.skip("this CPU lacks AVX512-VNNI: the x8 kernel's vpdpbusd path cannot run here")
    # from 16 rows on an AMX CPU (cpu_ops.c's AMX section; fewer: vpdpbusd)
    auto_x8 = "amx_int8" if cpu.cpu_has("amx") else "avx512_vnni"
    assert variants_built_for("auto", monkeypatch)["gguf_x8"] == auto_x8
    assert variants_built_for("avx512_vnni", monkeypatch)["gguf_x8"] == "avx512_vnni"
    assert variants_built_for("avx512", monkeypatch) == dict.fromkeys(FAMILIES[:4], "avx512") | {
        "gguf": "avx2", "gguf_x8": "avx2"}  # x86-64-v4 without VNNI: the x8 kernel's AVX2 path


def test_a_second_load_for_another_isa_is_refused(compile_as, real_library):
    """The library is process-wide: a load asking for another ISA than the one loaded raises, naming both;
    asking for the same one (explicitly or through the environment's default) is fine."""
    loaded = cpu.info()["isa"]
    other = "scalar" if loaded != "scalar" else "auto"
    with pytest.raises(ValueError, match=f"loaded for cpu_isa {loaded} in this process, which cannot load them "
                                         f"for {other}"):
        cpu.load(default_cache_dir(), other)
    assert cpu.load(default_cache_dir(), loaded) and cpu.info()["isa"] == loaded
    cpu._Loaded.lib = None  # (compile_as restores it) no library yet: any ISA loads (here the stand-in compiler
    # copies the session's library whatever the flags) and is the one info() names
    assert cpu.load(compile_as(real_library), other) and cpu.info()["isa"] == other


def test_the_start_up_log_names_the_isa_and_each_family_s_path(compile_as, real_library, caplog):
    caplog.set_level(logging.INFO, logger=cpu.__name__)
    assert cpu.load(compile_as(real_library))
    name = cpu.isa()
    pairs = " ".join(f"{family}={path}" for family, path in cpu.kernel_variants().items())
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == cpu.__name__] == [
        f"CPU kernels loaded, built for {name} ({' '.join(cpu.ISAS[name].flags)}): {pairs}"]
    assert pairs.startswith("linear=") and " gguf_x8=" in pairs


def test_an_engine_loads_the_kernels_for_its_cpu_isa(tiny_llama_dir):
    """EngineConfig.cpu_isa reaches kernels/cpu.load from the worker: an ISA this CPU lacks, or another than the
    one this process loaded, is refused at start-up; the loaded one runs, and the engine reports it."""
    from tests.conftest import make_llm
    loaded = cpu.info()["isa"]
    other = "scalar" if loaded != "scalar" else "auto"
    with pytest.raises(ValueError, match=f"loaded for cpu_isa {loaded} in this process, which cannot load them "
                                         f"for {other}"):
        make_llm(tiny_llama_dir, cpu_isa=other, cpu_kernels=True, max_model_len=64, kv_cache_memory=2**20)
    lacking = next((name for name in cpu.ISAS if not cpu.cpu_has(name)), None)
    if lacking is not None:
        with pytest.raises(ValueError, match=f"cpu_isa {lacking}: this CPU lacks"):
            make_llm(tiny_llama_dir, cpu_isa=lacking, cpu_kernels=True, max_model_len=64, kv_cache_memory=2**20)
    llm = make_llm(tiny_llama_dir, cpu_isa=loaded, cpu_kernels=True, max_model_len=64, kv_cache_memory=2**20)
    assert llm.engine.cpu_kernels == {"isa": loaded, "variants": cpu.kernel_variants()}
    llm.engine.shutdown()
