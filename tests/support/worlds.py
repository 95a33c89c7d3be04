"""The boundary where the tests' hand-written snapshots (dicts in the world's JSON shape, often partial) meet
decide/: each is parsed by model.World.from_json (a missing key takes its default) before the decision reads it
by attribute. ``typed(fn)`` wraps one function; ``typed(module)`` wraps a module's snapshot-taking functions.
Tests about the type itself are in tests/test_model.py."""

from __future__ import annotations

import functools
import types

from spark_memsaver.model import world_of

# decide/ functions whose first argument is the world
TAKES_A_WORLD = {"plan", "assess", "pre_install_plan", "installability", "evaluate", "config_changed",
                 "driver_present", "build_record", "source_search_remedy"}


def typed(obj):
    if isinstance(obj, types.ModuleType):
        return _Module(obj)

    @functools.wraps(obj)
    def call(snap, *a, **kw):
        return obj(world_of(snap) if isinstance(snap, dict) else snap, *a, **kw)
    return call


class _Module:
    def __init__(self, mod):
        self._mod = mod

    def __getattr__(self, name):
        v = getattr(self._mod, name)
        return typed(v) if name in TAKES_A_WORLD and callable(v) else v
