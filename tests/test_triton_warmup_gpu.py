"""The warm-up kernels of 04 compiled on a CUDA GPU: their hidden checks, larger shapes, and the
TF32 diagnosis that only compiled tl.dot can show."""

import importlib.util
from pathlib import Path

import pytest
import torch

from flashcourse.checks import triton_warmup as wc

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)")]

WARMUPS = ["tile_copy", "row_softmax", "score_tile", "running_stats"]


@pytest.fixture(scope="module")
def engine():
    from flashcourse.engine import triton_flash

    return triton_flash


@pytest.mark.parametrize("name", WARMUPS)
def test_hidden_checks_compiled(engine, name):
    """Every hidden warm-up check passes with the compiled kernels (float32 on the GPU)."""
    from autograder.hidden import triton_flash as hidden

    getattr(hidden, f"test_{name}")(getattr(engine, name))


def test_larger_shapes(engine):
    """Shapes past the interpreter's comfort: thousands of rows and columns, 64 x 64 blocks, D = 128."""
    wc.check_tile_copy(engine.tile_copy, [(1000, 1500)], block_m=64, block_n=64, device="cuda")
    wc.check_row_softmax(engine.row_softmax, [wc.softmax_input(300, 3000)], device="cuda")
    wc.check_score_tile(engine.score_tile, [(1000, 777, 128)], block_m=64, block_n=64, device="cuda")
    wc.check_running_stats(engine.running_stats, [wc.scores_input(500, 2000, block_n=64)], block_m=64, block_n=64,
                           device="cuda")


def test_tf32_is_named(engine, tmp_path):
    """score_tile without input_precision="ieee" multiplies on TF32 tensor cores; the check says so."""
    source = Path(engine.__file__).read_text()
    old = 's = tl.dot(q, tl.trans(k), input_precision="ieee") * scale'
    assert source.count(old) == 1
    path = tmp_path / "tf32_score_tile.py"
    path.write_text(source.replace(old, 's = tl.dot(q, tl.trans(k), input_precision="tf32") * scale'))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(AssertionError, match="TF32"):
        wc.check_score_tile(module.score_tile, [(128, 128, 64)], device="cuda")
