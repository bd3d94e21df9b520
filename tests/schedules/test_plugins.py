"""Plugin schedules end to end: a schedule written outside the project, loaded by --schedule-plugin or an
entry point, is listed in --help, validated, drawn and trained exactly; a broken plugin is one line, exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_pp.schedules import registry
from megatron_pp.schedules.plugins import PluginError, load_entry_points, load_plugin, plugins_in_argv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Built only from the project's public helpers: a generator and the offload pass. It offloads, so it needs
# the host store, which the runtime must find from the list (OFFLOAD/RELOAD), not from the name.
PLUGIN = textwrap.dedent('''
    from megatron_pp.schedules.generators import interleaved_1f1b
    from megatron_pp.schedules.offload import add_offload
    from megatron_pp.schedules.registry import register_option, register_schedule


    def offloaded_interleaved(num_ranks, num_microbatches, num_chunks, plugin_offloaded_chunks=1):
        return add_offload(interleaved_1f1b(num_ranks, num_microbatches, num_chunks), plugin_offloaded_chunks)


    register_option("plugin_offloaded_chunks", "--plugin-offloaded-chunks", int,
                    "test plugin: chunks per rank whose stashes go to host memory")
    register_schedule("test-offloaded-interleaved", offloaded_interleaved, supports_virtual=True,
                      description="a plugin: interleaved 1F1B with its first chunk offloaded")
''')

COMMON = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4",
          "--train-iters", "2", "--lr", "1e-3", "--seed", "5"]


def _run(argv, **kwargs):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **kwargs.pop("env", {})}
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env, **kwargs)


def test_plugin_file_under_torchrun_trains_exactly(tmp_path):
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    plugin = tmp_path / "my_schedules.py"
    plugin.write_text(PLUGIN)
    metrics = tmp_path / "m.jsonl"
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "pretrain_gpt.py", *COMMON, "--schedule-plugin", str(plugin), "--pipeline-schedule",
                 "test-offloaded-interleaved", "--plugin-offloaded-chunks", "1", "--pipeline-model-parallel-size", "2",
                 "--num-virtual-stages-per-pipeline-rank", "2", "--metrics-file", str(metrics)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    reference = [r["loss"] for r in pretrain(parse_args(COMMON))]
    assert len(losses) == 2
    for a, b in zip(losses, reference):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, reference)


def test_plugin_schedules_and_flags_appear_in_help_and_in_the_drawing_tool(tmp_path):
    plugin = tmp_path / "my_schedules.py"
    plugin.write_text(PLUGIN)
    proc = _run([sys.executable, "pretrain_gpt.py", "--schedule-plugin", str(plugin), "--help"])
    assert proc.returncode == 0 and "--plugin-offloaded-chunks" in proc.stdout, proc.stderr
    out = tmp_path / "s.json"
    proc = _run([sys.executable, "tools/plot_schedule.py", "--schedule-plugin", str(plugin), "--schedule",
                 "test-offloaded-interleaved", "--pp", "2", "--microbatches", "4", "--chunks", "2",
                 "--export-schedule", str(out)])
    assert proc.returncode == 0, proc.stderr
    exported = json.loads(out.read_text())
    assert exported["name"] == "test-offloaded-interleaved"
    assert any(a.startswith("OFFLOAD") for acts in exported["actions"] for a in acts)


@pytest.mark.parametrize("spec,needle", [
    ("no_such_module_for_megatron_pp", "ModuleNotFoundError"),
    ("{tmp}/broken.py", "ZeroDivisionError"),
    ("{tmp}/missing.py", "no such file"),
])
def test_a_plugin_that_fails_is_one_line_and_exit_2(tmp_path, spec, needle):
    (tmp_path / "broken.py").write_text("1 / 0\n")
    spec = spec.format(tmp=tmp_path)
    for tool in (["pretrain_gpt.py", *COMMON], ["tools/plot_schedule.py", "--schedule", "1f1b", "--pp", "2",
                                               "--microbatches", "2", "--json", str(tmp_path / "x.json")]):
        proc = _run([sys.executable, *tool, "--schedule-plugin", spec])
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert spec in lines[0] and needle in lines[0], lines


def test_entry_point_group_registers_an_installed_package(tmp_path):
    """A package on the path that declares a megatron_pp.schedules entry point needs no flag."""
    site = tmp_path / "site"
    (site / "ep_demo-0.1.dist-info").mkdir(parents=True)
    (site / "ep_demo-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-demo\nVersion: 0.1\n")
    (site / "ep_demo-0.1.dist-info" / "entry_points.txt").write_text("[megatron_pp.schedules]\ndemo = ep_demo:register\n")
    (site / "ep_demo.py").write_text(textwrap.dedent('''
        from megatron_pp.schedules.generators import gpipe
        from megatron_pp.schedules.registry import register_schedule


        def register():
            register_schedule("ep-demo-gpipe", gpipe, supports_virtual=False, description="from an entry point")
    '''))
    proc = _run([sys.executable, "tools/plot_schedule.py", "--schedule", "ep-demo-gpipe", "--pp", "2",
                 "--microbatches", "2", "--json", str(tmp_path / "s.json")], env={"PYTHONPATH": str(site)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "s.json").read_text())["schedule"] == "ep-demo-gpipe"


def test_loading_twice_registers_once(tmp_path):
    plugin = tmp_path / "twice.py"
    plugin.write_text(PLUGIN.replace("test-offloaded-interleaved", "test-twice"))
    try:
        load_plugin(str(plugin))
        load_plugin(str(plugin))  # parse_args may run more than once in a process
        assert "test-twice" in registry.list_schedules()
    finally:
        registry.unregister_schedule("test-twice")
    assert load_entry_points() == [] or all(isinstance(n, str) for n in load_entry_points())


# A plugin written as people write modules today: postponed annotations, a dataclass for its settings, and
# its helpers in a sibling file imported relatively.
MODERN_PLUGIN = textwrap.dedent('''
    from __future__ import annotations

    from dataclasses import dataclass, field

    from megatron_pp.schedules.registry import register_schedule

    from .plugin_helpers import reversed_warmup


    @dataclass
    class Settings:
        name: str
        tags: list[str] = field(default_factory=list)


    SETTINGS = Settings("test-modern-plugin", ["dataclass"])
    register_schedule(SETTINGS.name, reversed_warmup, supports_virtual=False, description="a modern plugin file")
''')
MODERN_HELPERS = textwrap.dedent('''
    from __future__ import annotations

    from megatron_pp.schedules.generators import one_f_one_b
    from megatron_pp.schedules.ir import Schedule


    def reversed_warmup(num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
        return one_f_one_b(num_ranks, num_microbatches)
''')


def test_a_plugin_with_postponed_annotations_a_dataclass_and_a_relative_import_loads(tmp_path):
    """The loader registers the module before running it (a dataclass looks its module up in sys.modules;
    without it: AttributeError) and gives the file a package searching its directory (the relative import)."""
    (tmp_path / "modern_plugin.py").write_text(MODERN_PLUGIN)
    (tmp_path / "plugin_helpers.py").write_text(MODERN_HELPERS)
    try:
        load_plugin(str(tmp_path / "modern_plugin.py"))
        assert registry.build_schedule("test-modern-plugin", 2, 4, 1).actions == registry.build_schedule("1f1b", 2, 4).actions
    finally:
        registry.unregister_schedule("test-modern-plugin")
    # The same through a tool, as a user runs it.
    proc = _run([sys.executable, "tools/plot_schedule.py", "--schedule-plugin", str(tmp_path / "modern_plugin.py"),
                 "--schedule", "test-modern-plugin", "--pp", "2", "--microbatches", "2", "--json",
                 str(tmp_path / "s.json")])
    assert proc.returncode == 0, proc.stderr


def test_two_plugin_files_of_one_name_in_two_directories_both_load(tmp_path):
    for index in (1, 2):
        (tmp_path / f"d{index}").mkdir()
        (tmp_path / f"d{index}" / "schedules.py").write_text(PLUGIN.replace("test-offloaded-interleaved",
                                                                             f"test-same-name-{index}"))
    try:
        for index in (1, 2):
            load_plugin(str(tmp_path / f"d{index}" / "schedules.py"))
        assert {"test-same-name-1", "test-same-name-2"} <= set(registry.list_schedules())
    finally:
        for index in (1, 2):
            registry.unregister_schedule(f"test-same-name-{index}")


def test_flag_scan():
    assert plugins_in_argv(["--x", "1", "--schedule-plugin", "a.b", "--schedule-plugin=c.py"]) == ["a.b", "c.py"]
    with pytest.raises(PluginError, match="needs a module"):
        plugins_in_argv(["--schedule-plugin"])
