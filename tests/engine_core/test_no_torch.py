import subprocess
import sys


def test_importing_every_engine_core_module_leaves_torch_out():
    code = (
        "import pkgutil, importlib, sys, engine_core\n"
        "for m in pkgutil.iter_modules(engine_core.__path__):\n"
        "    importlib.import_module('engine_core.' + m.name)\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_importing_the_engine_flags_leaves_torch_out():
    code = "import sys, strata.runtime.engine_args\nprint('torch' in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
