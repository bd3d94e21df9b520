"""The schedule registry of this process put back as it was: for test modules that load plugin schedules or
schedule files in-process (`tests/conftest.py` wraps every module in it)."""
from __future__ import annotations

import sys
from contextlib import contextmanager


@contextmanager
def schedule_registry_restored():
    """On exit, drop the schedules (plugins, schedule files), schedule options and plugin loads added inside.
    A plugin loaded again later runs again: a file plugin is executed afresh anyway; a dotted module or an
    entry point's module is dropped from `sys.modules` too (with its submodules), since an import that finds
    it cached would register nothing."""
    from megatron_pp.schedules import plugins, registry

    tables = (registry._ENTRIES, registry._LOOKUP, registry._OPTIONS)
    saved, loaded = [dict(t) for t in tables], set(plugins._LOADED)
    try:
        yield
    finally:
        for table, before in zip(tables, saved):
            table.clear()
            table.update(before)
        for key in plugins._LOADED - loaded:
            if key.startswith("entry point "):
                module = key.split(" = ", 1)[1].split(":")[0]
            elif plugins._is_file(key):
                continue
            else:
                module = key
            for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
                del sys.modules[name]
        plugins._LOADED.intersection_update(loaded)
