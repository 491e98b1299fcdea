"""Settings each rank resolves on its own but all must share, agreed through the store.

A rank's tokenizer, pipeline payload, DiLoCo schedule and --stop-at-loss come from its own
flags; one rank started with another value would fail much later (a collective of the wrong
size, store keys nobody else writes) or, worse, drift silently (another --overlap-alpha). The
first rank whose store answers records its values; every other rank compares and stops (exit 2)
naming the flag.
"""

from __future__ import annotations

import json
from typing import Any

from formats.errors import UserError
from modules.config import ResolvedRun
from modules.control.protocol import RUN_AGREED
from modules.data.tokenizer import TokenizerId
from modules.plan_flags import agreed_plan_fields


def agreed_fields(run: ResolvedRun, tokenizer: TokenizerId) -> dict[str, Any]:
    """The fields of a rank's resolved run that every rank must share, by the flag that sets
    them (`tokenizer`: the identity of the data's tokenizer)."""
    sync, data = run.plan.sync, run.cfg.data
    # --stop-at-loss: every rank reads the decision at the same evaluation steps
    stop = ({"--min-steps": data.min_steps, "--eval-every": data.eval_every}
            if data.stop_at_loss is not None else {})
    return {"--tokenizer": tokenizer.meta(),
            "--stop-at-loss": data.stop_at_loss, **stop,
            "--pipeline-compression": run.plan.pipeline_compression,
            "--fragments": sync.fragments, "--overlap": sync.overlap,
            "--overlap-alpha": run.overlap_alpha,
            **agreed_plan_fields(run.plan)}  # plan-less plans and the runner's overrides


def agree_run(store: Any, run: ResolvedRun, tokenizer: TokenizerId, rank: int) -> None:
    """`agree` on the shared fields of this rank's resolved run (UserError naming the flag)."""
    agree(store, agreed_fields(run, tokenizer), rank)


def agree(store: Any, mine: dict[str, Any], rank: int) -> None:
    """Record `mine` ({flag: value}) as the run's, or check it against the recorded one."""
    offer = json.dumps(mine, sort_keys=True)
    run = store.claim(RUN_AGREED, offer)  # signed (modules.control.auth): a forgery is replaced
    if run == offer:
        return
    theirs = json.loads(run)
    flag = next((f for f in sorted(mine) if mine[f] != theirs.get(f)), sorted(mine)[0])
    raise UserError(f"{flag}: rank {rank} has {_shown(mine.get(flag))} but the run's other ranks "
                    f"have {_shown(theirs.get(flag))} (set by the first rank to reach the "
                    f"store); give every rank the same {flag}")


def _shown(value: Any) -> str:
    """A value for the message (a tokenizer identity as vocab and digest prefix)."""
    if isinstance(value, dict) and "sha256" in value:
        return f"vocab {value['vocab_size']}, sha256 {str(value['sha256'])[:12]}"
    return repr(value)
