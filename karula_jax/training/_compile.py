"""XLA options for compiling programs of many loop iterations: a run's rounds (the chunk
program of :func:`run`) and the members' OT embedding (``protocol.member_dissimilarities``)."""

from __future__ import annotations

import os
from typing import Any

import jax

__all__ = ["compile_loops", "loop_compiler_options"]

# XLA:CPU compiles the rounds with LLVM's optimization level 2 instead of its default 3.
# Measured on the synthetic study's Karula CV chunk (one process, the option sets
# alternated, 5 runs each, twice): compiled in 4.95-5.18 s against 5.79-6.76 s, run in a
# median 7.6 s against 8.4 s; pFedMe's chunk 1.57 s against 2.17 s to compile, its run
# unchanged (5.3 against 5.6 s, within noise); the n = 300 MLP projection (10 Newton
# iterations) 183-200 ms against 183-195 ms. Level 1 compiles no faster than 2; the
# older loop emitters (``xla_cpu_use_fusion_emitters`` false) compile faster still but
# ran that projection 10% slower (results/bench/README.md, "Compile time"). The synthetic
# study's embedding of 60 data sets (Sinkhorn loops, its members then vmapped; now in turn,
# docs/implementation_notes.md): compiled in 3.4-4.0 s against 5.7-5.8 s, run in 10.5-12.5 s
# against 10.3-12.0 s, the same D.
_CPU_OPTIONS = {"xla_backend_optimization_level": 2}


def loop_compiler_options(tree: Any) -> dict[str, Any] | None:
    """Compiler options for a program whose arguments are ``tree``'s arrays.

    ``{"xla_backend_optimization_level": 2}`` where every array lives on CPU devices and
    ``XLA_FLAGS`` does not set that level itself (a level the user chose wins: the
    options of ``compile`` override the flags); else None (XLA's defaults). Results
    equal the default level's up to floating-point rounding (no fast math either way).
    """
    if "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return None
    platforms = {
        device.platform
        for leaf in jax.tree.leaves(tree)
        if isinstance(leaf, jax.Array)
        for device in leaf.devices()
    }
    return dict(_CPU_OPTIONS) if platforms == {"cpu"} else None


def compile_loops(jitted, *args):
    """``jitted`` (a ``jax.jit`` function) lowered for ``args`` and compiled with
    :func:`loop_compiler_options` of ``args``: the executable, called as ``f(*args)``."""
    return jitted.lower(*args).compile(loop_compiler_options(args))
