"""modules.control.agreement: the first rank's settings become the run's; a rank with another value
of a flag every rank must share is refused, naming that flag."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from formats.errors import UserError
from modules.control.agreement import agree
from modules.control.auth import Auth, AuthStore

RUN = {"--tokenizer": {"vocab_size": 256, "sha256": "bytes"}, "--pipeline-compression": "none",
       "--fragments": 2, "--overlap": True, "--overlap-alpha": 0.5}


def test_the_first_rank_sets_and_equal_ranks_pass():
    store = AuthStore(dist.HashStore(), Auth(b"test-secret-0123456789"))
    agree(store, RUN, 0)
    agree(store, dict(RUN), 1)  # same values, any key order


@pytest.mark.parametrize("flag, value, shown", [
    ("--pipeline-compression", "int8", "'int8' but the run's other ranks have 'none'"),
    ("--fragments", 1, "1 but the run's other ranks have 2"),
    ("--overlap-alpha", 0.25, "0.25 but the run's other ranks have 0.5"),
    ("--tokenizer", {"vocab_size": 1024, "sha256": "ab" * 32},
     "vocab 1024, sha256 abababababab but the run's other ranks have vocab 256"),
])
def test_a_rank_with_another_value_is_refused_naming_the_flag(flag, value, shown):
    store = AuthStore(dist.HashStore(), Auth(b"test-secret-0123456789"))
    agree(store, RUN, 0)
    with pytest.raises(UserError, match=f"^{flag}: rank 3 has ") as e:
        agree(store, {**RUN, flag: value}, 3)
    assert shown in str(e.value) and f"give every rank the same {flag}" in str(e.value)
