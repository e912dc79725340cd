"""ember's compiled CPU kernels: block-quantized linear layers (linear.cpp), paged attention over
a kernel-native cache layout (attention.cpp), the row-wise ops of a decoder layer
(layer_ops.cpp), the sampler's greedy choice (sampling.cpp), the vision tower's full bfloat16
attention (tower_attention.cpp, where the processor has bfloat16 dot products), all
batch-invariant by construction, and a Llama-shaped decoder's layers in one call of those ops
(decoder.cpp).

They are built on first use with the C++ compiler torch's extensions use, for the processor at
hand (-march=native), and cached by torch under its extensions folder
($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), keyed by the source, the compiler
flags and the processor, so a second start loads them in milliseconds. Where no compiler is
found or the build fails, `available()` is False, `status()` says why, and the engine keeps its
plain torch paths. EMBER_KERNEL_TARGET=avx2 builds them for AVX2 with FMA and F16C alone, the path
of processors without AVX-512, so that path can be run and measured on an AVX-512 machine;
`avx-vnni` for AVX2 with AVX-VNNI (Intel's laptop and desktop processors since Alder Lake),
`icelake` for AVX-512 with VNNI but without BF16 or AMX (Ice Lake and Cascade Lake Xeons), `no-amx`
for this processor's own instructions less AMX (on an AMX Xeon, a Zen 4's path), and `plain` for
the compiler's baseline (no vector path). Where the build has AMX tiles
(a Xeon's own -march=native), bfloat16 attention runs on them; EMBER_ATTENTION_TILES=0 keeps it on
the vector path's dot products instead (other bits, the same promises; docs/cpu-kernels.md). The
linear layers' integer products take them too for 32 rows and more (a prompt's chunk, many
streams), with the vector path's bits.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger("ember.kernels")

_FOLDER = Path(__file__).parent


def _units(source: Path) -> list[Path]:
    """A kernel's source and the units compiled with it (linear.cpp's linear_*.cpp: the column work,
    a few formats a unit, so that the compiler runs them side by side), the units first."""
    return [*sorted(source.parent.glob(f"{source.stem}_*.cpp")), source]


_SOURCES = [path for name in ("linear.cpp", "attention.cpp", "layer_ops.cpp", "sampling.cpp", "decoder.cpp",
                              "tower_attention.cpp") for path in _units(_FOLDER / name)]
_HEADERS = sorted(_FOLDER.glob("*.h"))
# The instructions a build may use: this processor's own, those less AMX, Ice Lake's (AVX-512 with
# VNNI, without BF16 or AMX), AVX2 with FMA, F16C and AVX-VNNI (Intel's processors since Alder Lake
# that stop short of AVX-512), AVX2 with FMA and F16C only (the path of processors without
# AVX-512), or the compiler's baseline (no vector path).
_TARGETS = {"native": ["-O3", "-march=native"],
            "no-amx": ["-O3", "-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"],
            "icelake": ["-O3", "-march=icelake-server"],
            "avx-vnni": ["-O3", "-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
            "avx2": ["-O3", "-mavx2", "-mfma", "-mf16c"], "plain": ["-O2"]}
_status = "not loaded yet"
_library: Path | None = None  # the shared library available() built or loaded


def build_flags(target: str | None = None) -> list[str]:
    """The compiler flags of a build for `target`, by default the one EMBER_KERNEL_TARGET names."""
    target = target or os.environ.get("EMBER_KERNEL_TARGET", "native")
    if target not in _TARGETS:
        raise ValueError(f"EMBER_KERNEL_TARGET={target!r}: expected one of {', '.join(_TARGETS)}")
    return [*_TARGETS[target], "-fopenmp"]


def _flags_line() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line for line in lines if line.startswith("flags")), None)


def _processor() -> str:
    return _flags_line() or platform.processor()


def processor_flags() -> set[str]:
    """The instruction sets this processor has, as Linux's /proc/cpuinfo names them (empty elsewhere):
    for tests that build a kernel for other instructions and must know whether it can run here."""
    return set((_flags_line() or "").split())


@contextlib.contextmanager
def _sole_builder(build_directory: Path):
    """Hold the build folder alone. torch marks a build in progress with a `lock` file that a
    killed process leaves behind, and every later build then waits on it forever; ember's own lock
    is a kernel lock that dies with its holder, so whoever holds it knows a `lock` file is stale."""
    build_directory.mkdir(parents=True, exist_ok=True)
    with open(build_directory / "ember-build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_directory / "lock").unlink(missing_ok=True)
        yield


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the kernels once per process; True when they run here."""
    global _status, _library
    if hasattr(torch.ops, "ember") and hasattr(torch.ops.ember, "quantized_linear"):
        _status = "loaded"
        return True
    from torch.utils import cpp_extension

    flags = build_flags()
    tiles = os.environ.get("EMBER_ATTENTION_TILES", "1")
    if tiles not in ("0", "1"):
        raise ValueError(f"EMBER_ATTENTION_TILES={tiles!r}: expected 0 or 1")
    source = b"".join(path.read_bytes() for path in [*_SOURCES, *_HEADERS])
    key = hashlib.sha256(source + " ".join(flags).encode() + _processor().encode() + torch.__version__.encode())
    name = f"ember_cpu_{key.hexdigest()[:16]}"
    began = time.perf_counter()
    try:
        build_directory = cpp_extension._get_build_directory(name, False)
        with _sole_builder(Path(build_directory)):
            cpp_extension.load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=flags,
                               extra_ldflags=["-fopenmp"], extra_include_paths=[str(_FOLDER)],
                               build_directory=build_directory, is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch paths serve instead
        _status = f"unavailable ({type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''})"
        logger.warning("ember's CPU kernels could not be built; using plain torch paths: %s", _status)
        return False
    _library = Path(build_directory) / f"{name}.so"
    vector = {512: "AVX-512 VNNI", 256: "AVX2"}.get(torch.ops.ember.vector_bits(), "plain C++")
    if torch.ops.ember.avx_vnni():
        vector += " with AVX-VNNI"
    if torch.ops.ember.attention_tiles(tiles == "1"):
        vector += ", AMX tiles for bfloat16 attention"
    if torch.ops.ember.linear_tiles():
        vector += ", AMX tiles for int8 linear layers of many rows"
    _status = f"loaded ({vector}, {time.perf_counter() - began:.1f} s to build or load)"
    logger.info("ember's CPU kernels: %s", _status)
    return True


def status() -> str:
    return _status


def library() -> Path | None:
    """The shared library this process built or loaded the kernels from (None before available(),
    or where they were loaded another way): for tests that read the build itself."""
    return _library


def kernel_copy(source: Path, namespace: str, target: str | None = None):
    """One kernel source built a second time under the op namespace `namespace`, for a target of
    _TARGETS (by default ember's own build's): for tests and benchmarks that hold one version or
    build of a kernel against another in one process, with the units beside it that are compiled
    with it (_units). Its headers are those beside it where its folder has ember's (common.h among
    them: another commit's kernels folder, `git archive REV ember/kernels | tar -x -C DIR`), else
    this tree's. Returns torch.ops.<namespace>."""
    from torch.utils import cpp_extension

    folder = Path(tempfile.mkdtemp(prefix=f"{namespace}-"))
    units = _units(source)
    for unit in units:
        shutil.copy(unit, folder / unit.name)
    own = sorted(source.parent.glob("*.h")) if (source.parent / "common.h").is_file() else []
    for header in own or _HEADERS:
        shutil.copy(header, folder / header.name)
    cpp_extension.load(name=f"{namespace}_{source.stem}", sources=[str(folder / unit.name) for unit in units],
                       extra_cflags=[*build_flags(target), f"-DEMBER_OPS={namespace}"], extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)
    return getattr(torch.ops, namespace)


def plain_linear_copy():
    """The linear kernel built a second time without vector instructions, under the op namespace
    `ember_plain_copy`: for tests and benchmarks that hold a vector path to its plain C++."""
    return kernel_copy(_FOLDER / "linear.cpp", "ember_plain_copy", target="plain")


def avx2_linear_copy():
    """The linear kernel built for AVX2 alone, under the op namespace `ember_avx2_copy`: its AVX2
    path tried on a processor whose own build takes AVX-512."""
    return kernel_copy(_FOLDER / "linear.cpp", "ember_avx2_copy", target="avx2")
