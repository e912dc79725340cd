"""The prefetches ember's kernels ask for are in the build. GCC takes a helper whose only effect is
__builtin_prefetch for one without effects and drops the calls it does not inline, so for a time
attention's prefetches were in the source and nowhere in the library (common.h, prefetch_to_l2,
says how the kernels avoid it). This reads the built library's machine code and checks that every
function that should ask for lines does."""

import platform
import re
import shutil
import subprocess

import pytest
import torch

from ember import kernels

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 machine code")

# name fragment of a function -> the kernel path it belongs to
PREFETCHING = {
    "linear_ember::tile<": "the linear kernel's vector tiles (the next column blocks)",
    "amx_column_block<": "the linear kernel's AMX tiles (the next column block)",
    "tiles::attend<": "bfloat16 attention on AMX tiles (a decode row's blocks)",
    "<void ember_kernels::(anonymous namespace)::split_partials<": "attention's splits (the chunk ahead)",
}


def functions_of(library) -> dict[str, str]:
    """Each function of the library's disassembly (demangled), by its heading line, PLT stubs left out."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump (binutils) here")
    listing = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", str(library)], capture_output=True,
                             text=True, check=True).stdout
    functions = {}
    for part in re.split(r"\n(?=[0-9a-f]+ <)", listing):
        heading, _, body = part.partition("\n")
        if heading.endswith(">:") and "@plt>" not in heading:
            functions[heading] = body
    return functions


def test_every_prefetching_kernel_function_holds_its_prefetches():
    assert kernels.available(), kernels.status()
    if torch.ops.ember.vector_bits() == 0:
        pytest.skip("the plain C++ build asks for nothing ahead")
    assert kernels.library() is not None, "the kernels were loaded without a build of this process's"
    functions = functions_of(kernels.library())
    expected = {"linear_ember::tile<", "<void ember_kernels::(anonymous namespace)::split_partials<"}
    if torch.ops.ember.linear_tiles():
        expected.add("amx_column_block<")
    if torch.ops.ember.attention_tiles(None):
        expected.add("tiles::attend<")
    for fragment in expected:
        found = {heading: body for heading, body in functions.items() if fragment in heading}
        # (a function the compiler inlined everywhere keeps its prefetches in its callers: name them here)
        assert found, f"no function of {PREFETCHING[fragment]} left out of line in the build"
        missing = [heading for heading, body in found.items() if "prefetch" not in body]
        assert not missing, f"{PREFETCHING[fragment]}: {len(missing)} of {len(found)} functions without a prefetch"
