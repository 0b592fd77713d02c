"""CPU import stub (eaglepatch smoke tests only).

The real package cannot load on a CPU-only machine. Importing this package and any of its
submodules works; every public attribute is a callable placeholder that raises
NotImplementedError("stub called: <name>") when called, so a real use fails loudly.
The stub ships no package metadata, so importlib.metadata treats the package as absent.
"""

from _cpu_stub import install

install(__name__, globals())
