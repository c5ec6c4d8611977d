"""nano_openshell: a zero-trust sandbox that runs one shell command at a time for an agent.

    from nano_openshell import Sandbox, SandboxPool, Limits, ExecResult, probe

The Sandbox names are imported lazily, so the fallback tier's init (which imports
nano_openshell.initproc) starts without loading the supervisor side.
"""

from .probe import probe  # binds the function over the submodule of the same name

__version__ = "0.1.0"
__all__ = ["Sandbox", "SandboxPool", "SandboxError", "Limits", "ExecResult", "probe"]


def __getattr__(name):
    if name in ("Sandbox", "SandboxError", "Limits", "ExecResult"):
        from . import sandbox

        return getattr(sandbox, name)
    if name == "SandboxPool":
        from .pool import SandboxPool

        return SandboxPool
    raise AttributeError(f"module 'nano_openshell' has no attribute {name!r}")
