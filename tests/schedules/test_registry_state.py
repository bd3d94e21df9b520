"""tests/registry_state.py, which every test module runs inside (tests/conftest.py): what a module registers
or loads is gone after it, and loading the same plugin again registers it again."""
import sys

from megatron_pp.schedules import plugins, registry
from tests.registry_state import schedule_registry_restored

PLUGIN = '''from megatron_pp.schedules import generators
from megatron_pp.schedules.registry import register_option, register_schedule

register_option("{option}", "--{flag}", int, "a test option")
register_schedule("{name}", lambda p, m: generators.gpipe(p, m), supports_virtual=False,
                  description="a test plugin")
'''


def _write(folder, module, name, option):
    path = folder / f"{module}.py"
    path.write_text(PLUGIN.format(option=option, flag=option.replace("_", "-"), name=name))
    return path


def test_a_file_plugin_and_a_dotted_one_are_gone_after_and_load_again(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    file_plugin = _write(tmp_path, "state_file_plugin", "state-file-gpipe", "state_file_option")
    _write(tmp_path, "state_dotted_plugin", "state-dotted-gpipe", "state_dotted_option")
    before = (registry.list_schedules(), registry.schedule_options(), set(plugins._LOADED))
    for _ in range(2):  # the second round finds nothing cached that would keep it from registering
        with schedule_registry_restored():
            plugins.load_plugin(str(file_plugin))
            plugins.load_plugin("state_dotted_plugin")
            registry.register_schedule("state-direct", registry.get_schedule("gpipe").builder,
                                       supports_virtual=False, description="registered by hand")
            assert {"state-file-gpipe", "state-dotted-gpipe", "state-direct"} <= set(registry.list_schedules())
            assert {"--state-file-option", "--state-dotted-option"} <= {o.flag for o in registry.schedule_options()}
        assert (registry.list_schedules(), registry.schedule_options(), set(plugins._LOADED)) == before
        assert "state_dotted_plugin" not in sys.modules
