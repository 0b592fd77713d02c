"""Shared machinery of the CPU import stubs (eaglepatch smoke tests only)."""


import importlib.abc
import importlib.machinery
import sys
import types

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
        if fullname.startswith(self._stub_root + "."):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


def install(root, namespace):
    """Make package `root` (whose globals are `namespace`) and all its submodules stubs."""
    if not any(getattr(f, "_stub_root", None) == root for f in sys.meta_path):
        finder = _StubFinder()
        finder._stub_root = root
        sys.meta_path.append(finder)
    namespace["__getattr__"] = _module_getattr(root)
