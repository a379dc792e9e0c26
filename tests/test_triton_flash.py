"""The exported Triton kernel on small shapes: Triton's interpreter on a CPU, compiled on a GPU."""

import pytest
import torch

from flashcourse.checks import core as ac
from flashcourse.checks import triton_flash as kc
from flashcourse import runtime
from flashcourse.engine.triton_flash import flash_attention

RT = runtime.current()


def test_standard_cases():
    """Prefill, chunked prefill, decode, GQA and large scores, with 16 x 16 blocks."""
    cases = [c.with_kwargs(block_m=16, block_n=16) for c in ac.standard_cases(RT.dtype, RT.device)]
    kc.check_cases(flash_attention, cases)


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (16, 32), (32, 16), (64, 32)])
def test_blocks_not_dividing_t(block_m, block_n):
    """T = 45 and S = 51 divide by no block size; GQA with 2 query heads per KV head."""
    c = kc.case("odd", batch=2, q_heads=4, kv_heads=2, t=45, s=51, d=32, block_m=block_m, block_n=block_n,
                dtype=RT.dtype, device=RT.device)
    kc.check_cases(flash_attention, [c])


def test_explicit_offset_and_nan_past_the_queries():
    """Queries in the middle of a cache whose tail is NaN: right, and finite."""
    c = kc.case("middle", q_heads=2, kv_heads=1, t=12, s=80, query_offset=25, block_m=16, block_n=16,
                dtype=RT.dtype, device=RT.device)
    kc.check_block_skipping(flash_attention, [c])


def test_window_matches_reference_and_skips_tiles():
    """window=w against reference.attention(window=w); NaN before the window is never read."""
    kc.check_window(flash_attention, [kc.case("window", q_heads=2, kv_heads=2, t=40, window=6, block_m=16,
                                              block_n=16, dtype=RT.dtype, device=RT.device)])
    kc.check_block_skipping(flash_attention, [kc.case("window decode", q_heads=2, kv_heads=1, t=1, s=70, window=9,
                                                      block_m=16, block_n=16, dtype=RT.dtype, device=RT.device)])


def test_validation():
    """ValueError before launch: D = 24, D = 8, Hq % Hkv != 0, k and v on another device."""
    kc.check_validation(flash_attention, RT.device, RT.dtype)


def test_negative_offset_and_window_rejected():
    """A query before key 0 sees nothing, and a window must hold at least the query's own key."""
    q = torch.randn(1, 1, 4, 16, device=RT.device, dtype=RT.dtype)
    with pytest.raises(ValueError):
        flash_attention(q, q, q, query_offset=-1)
    with pytest.raises(ValueError):
        flash_attention(q, q, q, window=0)


def test_window_check_explains_a_nan_row_without_naming_one_cause():
    """A windowed row that comes back NaN is described by both ways a kernel gets there, not blamed on one."""
    c = kc.case("window", q_heads=1, kv_heads=1, t=20, window=5, block_m=16, block_n=16, dtype=RT.dtype, device=RT.device)
    nan_rows = lambda q, k, v, **kw: flash_attention(q, k, v, **kw) * float("nan")  # noqa: E731
    with pytest.raises(AssertionError, match="The row is NaN: either the loop visited none of the keys"):
        kc.check_window(nan_rows, [c])


def test_checks_name_the_classic_kernel_bugs():
    """kernel_checks recognises an ignored query_offset and a kernel that reads NaN keys."""
    c = kc.case("middle", q_heads=1, kv_heads=1, t=6, s=60, query_offset=10, block_m=16, block_n=16,
                dtype=RT.dtype, device=RT.device)
    ignores_offset = lambda q, k, v, query_offset=None, **kw: flash_attention(q, k, v, query_offset=0, **kw)  # noqa: E731
    with pytest.raises(AssertionError, match="query_offset=10 was ignored"):
        kc.check_cases(ignores_offset, [c])
    # A stand-in for a kernel without block skipping: its output depends on every value, NaN ones too.
    reads_all = lambda q, k, v, **kw: flash_attention(q, k, v, **kw) + 0 * v.sum()  # noqa: E731
    with pytest.raises(AssertionError, match="NaN") as caught:
        kc.check_block_skipping(reads_all, [c])
    assert "last existing query row" in str(caught.value) and "min((block + 1) * BLOCK_M, T) - 1" in str(caught.value)


def _release_cell(grade_id):
    import nbformat

    from autograder.building import build

    nb = nbformat.read(build.RELEASE / "04_triton_flash" / "04_triton_flash.ipynb", as_version=4)
    return next(c.source for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def test_release_gives_the_plumbing_and_leaves_the_loop():
    """The released kernel keeps program ids, pointers, masked loads and the store; the positions, state,
    loop bounds, recurrence and normalization are the learner's (three stubs), as are the wrapper's checks."""
    kernel = _release_cell("flash_fwd_kernel")
    for given in ("tl.program_id(0)", "kv_h = h // group", "mask=row_ok[:, None], other=0.0",
                  "for n0 in range(start, stop, BLOCK_N):", "mask=key_ok[:, None], other=0.0", "tl.store(o_base"):
        assert given in kernel, f"the release should give {given!r}"
    for written in ("q_pos = offset + rows", "stop = ", "tl.dot(", "tl.exp(", "acc / l"):
        assert written not in kernel, f"the release gives away {written!r}"
    assert kernel.count("raise NotImplementedError()") == 3
    assert "define s" in _release_cell("score_tile"), "the score_tile stub should say that s is the learner's to define"
    wrapper = _release_cell("flash_attention")
    assert "flash_fwd_kernel[grid](" in wrapper and "raise NotImplementedError()" in wrapper
    assert "q_heads % kv_heads" not in wrapper and "query_offset is None" not in wrapper


def test_measurements_04_reads_are_installed():
    """Every bench.measured(...) file 04's cells read ships in flashcourse/bench/measured."""
    import re

    import nbformat

    from autograder.building import build
    from flashcourse import bench

    nb = nbformat.read(build.source_notebook("04_triton_flash"), as_version=4)
    names = re.findall(r'bench\.measured\("([^"]+)"\)', "\n".join(c.source for c in nb.cells if c.cell_type == "code"))
    assert sorted(names) == ["triton_flash_sweep.png", "triton_flash_tf32.json"]
    assert all(bench.measured(name) for name in names)
