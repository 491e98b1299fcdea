"""Model stages: parameter counts are the presets' contract; a split computes what the full model
computes; seeded initialisation does not depend on the split."""

from __future__ import annotations

import pytest
import torch

from formats.models import PRESETS, get_model
from modules.model.decoder import StageModel, count_params, tie_weights_

SPLITS = [(0, 1), (1, 2), (0, 2), (2, 4), (1, 3)]


@pytest.mark.parametrize("name", list(PRESETS))
def test_stage_param_count_matches_preset_contract(name):
    spec = get_model(name)
    L = spec.num_layers
    ranges = [(0, L), (0, 1), (1, L), (1, 2), (L - 1, L)]
    for a, b in ranges:
        with torch.device("meta"):  # sizes only: no memory for the 1B models
            model = StageModel(spec, a, b, seed=None)
        assert count_params(model) == spec.stage_params(a, b), (name, a, b)


def test_tied_full_model_has_one_embedding_matrix():
    spec = get_model("gpt-tiny")
    model = tie_weights_(StageModel(spec, 0, spec.num_layers))
    assert count_params(model) == spec.stage_params(0, spec.num_layers) - spec.vocab_size * \
        spec.d_model


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-small"])
def test_split_forward_equals_full_model(name):
    torch.manual_seed(0)
    spec = get_model(name)
    full = StageModel(spec, 0, spec.num_layers, seed=3)
    cut = spec.num_layers // 2
    first, last = StageModel(spec, 0, cut, seed=3), StageModel(spec, cut, spec.num_layers, seed=3)
    x = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
    y = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
    torch.testing.assert_close(last(first(x), y), full(x, y), rtol=1e-6, atol=1e-6)


def test_llama_stage_runs_and_is_causal():
    spec = get_model("llama-150m")
    small = type(spec)("llama-test", "llama", num_layers=2, d_model=64, n_heads=4, d_ff=96,
                       seq_len=16, vocab_size=300, tie_embeddings=False)
    model = StageModel(small, 0, 2, seed=0)
    x = torch.randint(0, 300, (1, 16))
    logits = model(x)
    x2 = x.clone()
    x2[0, -1] = (x2[0, -1] + 1) % 300  # changing the last token must not change earlier logits
    torch.testing.assert_close(model(x2)[0, :-1], logits[0, :-1])
    assert count_params(model) == small.stage_params(0, 2)


def test_init_is_seeded_and_differs_by_seed():
    spec = get_model("gpt-tiny")
    a, b, c = (StageModel(spec, 1, 3, seed=s) for s in (5, 5, 6))
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), n


def test_head_copy_starts_equal_to_embedding():
    spec = get_model("gpt-tiny")
    first, last = StageModel(spec, 0, 1, seed=1), StageModel(spec, 3, 4, seed=1)
    assert torch.equal(first.embed.weight, last.head.weight)
