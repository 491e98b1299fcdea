"""--compile: torch.compile a stage in place, and a preflight that the compiler works at all.

`maybe_compile` uses `nn.Module.compile()`, which compiles the module's forward in place: the
module keeps its class, attributes and state_dict keys (no `_orig_mod.` prefix), so
checkpoints, tied-parameter lookups and parameter lists are the same as without --compile.
Compilation happens lazily at the first forward, i.e. after the rendezvous, where a failure
would look like a lost peer; `check_compile_available` compiles a tiny function first, so a
missing compiler (inductor needs a C++ compiler on CPU, triton and a C compiler on CUDA) is a
UserError naming --compile before any rendezvous.
"""

from __future__ import annotations

import torch
from torch import nn

from formats.errors import UserError


def maybe_compile(module: nn.Module, enabled: bool) -> nn.Module:
    """`module` compiled in place when `enabled` (returned for chaining), else unchanged."""
    if enabled:
        module.compile()
    return module


def _probe(x: torch.Tensor) -> torch.Tensor:
    """Two ops inductor fuses into one generated kernel."""
    return (x * 2.0).sin() + 1.0


def check_compile_available(device: torch.device | None = None) -> None:
    """Compile and run a tiny function on `device` (default CPU); UserError naming --compile
    when torch.compile cannot build kernels there. A few seconds the first time (inductor's
    start-up and one C++/triton build), under a second once its cache holds the kernel."""
    device = torch.device("cpu") if device is None else device
    x = torch.arange(8, dtype=torch.float32, device=device)
    try:
        got = torch.compile(_probe, fullgraph=True)(x)
    except Exception as e:  # dynamo/inductor wrap toolchain failures in many exception types
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()),
                      type(e).__name__)
        hint = ("a C++ compiler, e.g. apt-get install g++" if device.type == "cpu"
                else "triton (bundled with CUDA builds of torch) and a C compiler with Python "
                "headers, e.g. apt-get install gcc python3-dev")
        raise UserError(f"--compile: torch.compile cannot build kernels for {device} "
                        f"({reason[:300]}); it needs {hint}; or leave out --compile") from None
    if not torch.allclose(got, _probe(x)):
        raise UserError(f"--compile: torch.compile's kernel on {device} computes a different "
                        "result than eager; leave out --compile")
