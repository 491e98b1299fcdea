"""--compile: in-place compilation keeps the module as it is, the preflight finds a missing
compiler before any rendezvous, and a compiled 2-stage pipeline trains like eager."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from formats.models import get_model
from modules.data.dataset import DEFAULT_CORPUS, TextData, load_tokens
from modules.device.compile import check_compile_available, maybe_compile
from modules.device.precision import make_precision
from modules.model.decoder import StageModel
from testkit.local_pipeline import LocalPipeline, train_losses
from tests.conftest import ROOT

TINY = get_model("gpt-tiny")


def test_maybe_compile_keeps_the_module_its_class_and_its_state_dict_keys():
    model = StageModel(TINY, 0, 2)
    keys = list(model.state_dict())
    assert maybe_compile(model, False) is model
    assert maybe_compile(model, True) is model
    assert type(model) is StageModel and list(model.state_dict()) == keys
    assert model.tied_pair() == [model.embed.weight]


@pytest.mark.timeout(600)
def test_preflight_passes_where_a_compiler_is_installed():
    check_compile_available()


@pytest.mark.timeout(600)
def test_preflight_without_a_compiler_exits_2_naming_the_flag(tmp_path):
    env = dict(os.environ, CXX=str(tmp_path / "no-such-g++"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))  # no cached kernel to reuse
    code = ("from formats.errors import run_main\n"
            "from modules.device.compile import check_compile_available\n"
            "run_main(lambda argv: check_compile_available() or 0)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=500)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("error: --compile: torch.compile cannot build kernels for cpu ")
    assert "No working C++ compiler" in r.stderr and "apt-get install g++" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_two_stage_pipeline_matches_eager():
    """5 steps of gpt-tiny split [0,2) + [2,4) on fortunes, compiled vs eager.

    Tolerance 1e-5 relative per step: inductor fuses ops and changes the order of fp32
    reductions (layer norm, softmax, row sums), so each op may differ from eager by a few
    fp32 ulps (~1e-7); measured here: at most 1.1e-7 over the 5 steps. 1e-5 leaves 100x room
    for other CPUs' vector widths while a wrongly compiled op (a lost mask, a wrong gradient)
    moves the loss by 1e-3 or more. Cold compilation: ~50 s on a loaded 2-core machine.
    """
    if not DEFAULT_CORPUS.exists():
        pytest.skip("Debian fortunes not installed (apt-get install fortunes fortunes-min)")
    data = TextData(load_tokens(DEFAULT_CORPUS), TINY.seq_len, TINY.vocab_size)
    fp32 = make_precision("fp32", torch.device("cpu"))
    splits = [(0, 2), (2, 4)]
    eager = train_losses(LocalPipeline(TINY, splits, fp32), data, 5, 8)
    compiled = train_losses(LocalPipeline(TINY, splits, fp32, compile=True), data, 5, 8)
    assert compiled == pytest.approx(eager, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_pipeline_on_cuda_matches_eager():
    """The same on the GPU (triton kernels); same tolerance and reasoning (fp32, TF32 off)."""
    if not DEFAULT_CORPUS.exists():
        pytest.skip("Debian fortunes not installed (apt-get install fortunes fortunes-min)")
    dev = torch.device("cuda", 0)
    check_compile_available(dev)
    data = TextData(load_tokens(DEFAULT_CORPUS), TINY.seq_len, TINY.vocab_size)
    fp32 = make_precision("fp32", dev)
    eager = train_losses(LocalPipeline(TINY, [(0, 2), (2, 4)], fp32), data, 5, 8)
    compiled = train_losses(LocalPipeline(TINY, [(0, 2), (2, 4)], fp32, compile=True), data,
                            5, 8)
    assert compiled == pytest.approx(eager, rel=1e-5)
