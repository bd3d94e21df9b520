"""Loading schedule plugins: `--schedule-plugin MODULE_OR_FILE` and the `megatron_pp.schedules` entry points.

A plugin is Python code that calls `registry.register_schedule` (and `register_option` for its own flags)
when imported. It reaches the trainer and the tools in one of two ways:

- `--schedule-plugin NAME` (repeatable) names a dotted module on the path or a `.py` file. The entry
  points scan the command line for it *before* building their argument parser, so the plugin's schedules
  are listed and its option flags exist in `--help`.
- An installed package declares an entry point in the group `megatron_pp.schedules`, e.g. in its
  pyproject: `[project.entry-points."megatron_pp.schedules"] my_schedules = "my_pkg.schedules"`. The
  entry point may name a module (imported) or a callable (imported and called with no arguments). Every
  entry point of the group is loaded whenever plugins are loaded.

A plugin file is imported as a module of a package private to its directory, so it may import its
sibling files relatively (`from .helpers import x`); it is in `sys.modules` while it runs, so dataclasses
and `from __future__ import annotations` work as in any module.

A plugin that fails to import or to register gives one line naming it and the reason (`PluginError`,
which the entry points turn into exit status 2). Loading is idempotent: the same module or file is
imported once per process however often the arguments are parsed.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import types
from typing import Iterable, Sequence

ENTRY_POINT_GROUP = "megatron_pp.schedules"
FLAG = "--schedule-plugin"
_LOADED: set[str] = set()


class PluginError(ValueError):
    """A plugin that cannot be loaded; the message is one line naming it."""


def _one_line(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())


def _is_file(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or (os.altsep is not None and os.altsep in spec)


def _file_module_name(path: str) -> str:
    """The module name a plugin file runs under: `<package>.<file stem>`, where the package is private to
    the file's directory and searches it, so `from .helpers import x` in /a/sched.py imports /a/helpers.py
    (as `<package>.helpers`), and two plugins called schedules.py in two directories do not collide."""
    directory = os.path.dirname(path)
    package = "megatron_pp_plugin_" + hashlib.sha1(directory.encode()).hexdigest()[:12]
    if package not in sys.modules:
        holder = types.ModuleType(package, f"megatron_pp schedule plugins in {directory}")
        holder.__path__ = [directory]
        sys.modules[package] = holder
    return f"{package}.{os.path.splitext(os.path.basename(path))[0]}"


def load_plugin(spec: str) -> None:
    """Import the plugin `spec` (dotted module or `.py` path) once."""
    key = os.path.abspath(spec) if _is_file(spec) else spec
    if key in _LOADED:
        return
    try:
        if _is_file(spec):
            if not os.path.isfile(spec):
                raise PluginError(f"{FLAG} {spec}: no such file")
            name = _file_module_name(key)
            module_spec = importlib.util.spec_from_file_location(name, key)
            if module_spec is None or module_spec.loader is None:
                raise PluginError(f"{FLAG} {spec}: cannot be imported as a Python file")
            module = importlib.util.module_from_spec(module_spec)
            # Registered before it runs: a @dataclass (with `from __future__ import annotations` above all)
            # looks its module up in sys.modules while the class is being made.
            sys.modules[name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                raise
        else:
            importlib.import_module(spec)
    except PluginError:
        raise
    except Exception as err:
        raise PluginError(f"{FLAG} {spec}: {_one_line(err)}") from err
    _LOADED.add(key)


def load_entry_points() -> list[str]:
    """Load every entry point of the `megatron_pp.schedules` group once; their names."""
    names = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = f"entry point {ep.name} = {ep.value}"
        names.append(ep.name)
        if key in _LOADED:
            continue
        try:
            target = ep.load()
            if callable(target) and not isinstance(target, type(sys)):
                target()
        except Exception as err:
            raise PluginError(f"{key} (group {ENTRY_POINT_GROUP}): {_one_line(err)}") from err
        _LOADED.add(key)
    return names


def plugins_in_argv(argv: Sequence[str]) -> list[str]:
    """The values of every `--schedule-plugin X` / `--schedule-plugin=X` in `argv`, in order."""
    found = []
    args = list(argv)
    for i, token in enumerate(args):
        if token == FLAG:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise PluginError(f"{FLAG} needs a module or a .py file")
            found.append(args[i + 1])
        elif token.startswith(FLAG + "="):
            found.append(token[len(FLAG) + 1:])
    return found


def load_plugins(argv: Sequence[str] = (), extra: Iterable[str] = ()) -> None:
    """Entry points, then the plugins named on the command line `argv` and in `extra`."""
    load_entry_points()
    for spec in [*plugins_in_argv(argv), *extra]:
        load_plugin(spec)


def add_plugin_flag(parser) -> None:
    """Declare `--schedule-plugin` on an argument parser (the value was already acted on by `load_plugins`)."""
    parser.add_argument(FLAG, dest="schedule_plugin", action="append", default=[], metavar="MODULE_OR_FILE",
                        help="load pipeline schedules from a dotted module or a .py file before the arguments are "
                             "read (repeatable); installed packages register through the entry-point group "
                             f"{ENTRY_POINT_GROUP}")
