"""CPU import stub (eaglepatch smoke tests only).

The real package cannot load on a CPU-only machine. Importing this package and any of its
submodules works; every public attribute is a callable placeholder that raises
NotImplementedError("stub called: <name>") when called, so a real use fails loudly.
The stub ships no package metadata, so importlib.metadata treats the package as absent.
"""

import importlib.abc
import importlib.machinery
import sys
import types

_ROOT = __name__


class _Stub:
    __slots__ = ("_stub_name",)

    def __init__(self, name):
        object.__setattr__(self, "_stub_name", name)

    def __call__(self, *args, **kwargs):
        raise NotImplementedError("stub called: " + self._stub_name)

    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Stub(self._stub_name + "." + attr)

    def __repr__(self):
        return "<stub %s>" % self._stub_name


def _module_getattr(modname):
    def __getattr__(attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Stub(modname + "." + attr)

    return __getattr__


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = _module_getattr(spec.name)
        return mod

    def exec_module(self, module):
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(_ROOT + "."):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


if not any(getattr(f, "_stub_root", None) == _ROOT for f in sys.meta_path):
    _finder = _StubFinder()
    _finder._stub_root = _ROOT
    sys.meta_path.append(_finder)

__getattr__ = _module_getattr(_ROOT)
