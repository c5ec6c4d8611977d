"""nano_openshell: a zero-trust sandbox that runs one shell command at a time for an agent.

    from nano_openshell import Sandbox, SandboxPool, Limits, ExecResult, probe
"""

from .api import ExecResult, Limits, SandboxError
from .pool import SandboxPool
from .probe import probe  # the function, over the submodule of the same name
from .sandbox import Sandbox

__version__ = "0.1.0"
__all__ = ["Sandbox", "SandboxPool", "SandboxError", "Limits", "ExecResult", "probe"]
