"""mok_proto.kernels.sass_size: a kernel's SASS counted by the functions it was inlined from."""

import shutil

import pytest

from mok_proto.kernels import sass_size, token  # noqa: F401 - token registers its module

LISTING = """
//--------------------- .text.kern --------------------------
        /*0000*/                   LDC R1, c[0x0][0x28] ;
	//## File "{src}", line 9 inlined at "{src}", line 4
	//## File "{src}", line 4
        /*0010*/                   MOV R2, R3 ;
	//## File "{src}", line 6 inlined at "{src}", line 3
	//## File "{src}", line 3
        /*0020*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0030*/                   EXIT ;
"""
SOURCE = """// a kernel and two helpers
__global__ void __launch_bounds__(128) kern(int* p) {
  helper(p);
  other(p);
}
__device__ __forceinline__ void helper(int* p) {
  *p = 1;
}
template <int k> __device__ void other(int* p) {
  *p = k;
}
"""


def test_instructions_count_under_the_functions_they_came_from(tmp_path):
    src = tmp_path / "k.cuh"
    src.write_text(SOURCE)
    found = sass_size.chains(LISTING.format(src=src))
    assert list(found) == ["kern"] and len(found["kern"]) == 4
    # an instruction without its own line info keeps the last chain (nvdisasm writes a chain once)
    assert found["kern"][2] == found["kern"][3] == ((str(src), 6), (str(src), 3))
    assert sass_size.breakdown(found["kern"], depth=1) == {"(no line info)": 1, "k.cuh:other": 1, "k.cuh:helper": 2}
    # the kernel's own lines, and a call back into a function already on the chain (a lambda's body)
    chains = [((str(src), 3),), ((str(src), 7), (str(src), 10), (str(src), 7), (str(src), 3))]
    assert sass_size.breakdown(chains, depth=3) == {"k.cuh:kern (its own lines)": 1,
                                                    "k.cuh:helper < k.cuh:other < (lambda in k.cuh:helper)": 1}
    assert sass_size.owner(str(src), 3) == "k.cuh:kern"  # __launch_bounds__(...) is no function name


@pytest.mark.skipif(shutil.which("nvcc") is None or sass_size.nvdisasm() is None, reason="needs nvcc and nvdisasm")
def test_a_compiled_module_breaks_down_to_its_device_functions():
    found = sass_size.chains(sass_size.listing("token.cuh"))
    grad = next(c for name, c in found.items() if "topk_weight_grad" in name)
    counts = sass_size.breakdown(grad, depth=1)
    assert sum(counts.values()) == len(grad) > 100
    assert counts.most_common(1)[0][0] == "token.cuh:topk_weight_grad_part"
