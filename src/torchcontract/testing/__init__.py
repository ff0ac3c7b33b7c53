"""Helpers for testing APIs built on the contract: launching ranks, and invariant checks.

``run_distributed`` (``_launch``, ``_collect``, ``_main_guard``) runs a function on N
local ranks of a gloo process group and reports the rank that failed first in cause;
``check_api_invariants`` (``_invariants``, ``_compare``) checks that an API keeps a
model's FQNs, state and numerics as an API built on the contract should.
"""

from __future__ import annotations

from ._collect import RankFailedError
from ._invariants import InvariantReport, ModelCase, check_api_invariants
from ._launch import StartMethod, free_port, run_distributed
from ._main_guard import UnguardedMainError

__all__ = [
    "InvariantReport",
    "ModelCase",
    "RankFailedError",
    "StartMethod",
    "UnguardedMainError",
    "check_api_invariants",
    "free_port",
    "run_distributed",
]
