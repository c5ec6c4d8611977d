"""nano_openshell: a zero-trust sandbox that runs one shell command at a time for an agent."""

__version__ = "0.1.0"
