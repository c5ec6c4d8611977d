"""`nano-miles`: the commands of nano_miles.COMMANDS, each module imported only when it runs (torch
imports are slow). Bad input is one line on stderr, `nano-miles <command>: <what is wrong>`, exit 2.
SIGTERM (a scheduler, `timeout`) stops a command as Ctrl-C does, so what it holds (sandboxes, engines)
is released on the way out and `train` checkpoints first.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

from nano_miles import COMMANDS
from nano_miles.config import ConfigError, not_a_flag

# The CUDA caching allocator, unless the user set it: with expandable segments a process's reserved
# memory stays near what it allocated, so a trainer and an engine sharing a GPU both fit. Children
# (ranks, engines) inherit it.
CUDA_ALLOC_CONF = "expandable_segments:True"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line (main prints it), not argparse's usage screen and exit
        raise ConfigError(message)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)
    argv = sys.argv[1:] if argv is None else argv
    parser = _Parser(prog="nano-miles", description="Agentic GRPO on Linux shell tasks.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted, module = next((a for a in argv if not a.startswith("-")), None), None
    for name, (module_name, help_text) in COMMANDS.items():  # every command listed, only one imported
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as e:
                if e.name != module_name:
                    raise
                print(f"nano-miles: '{name}' is not available in this build", file=sys.stderr)
                return 2
            module.add_arguments(p)
    prog = f"nano-miles {wanted}" if module else "nano-miles"
    takes_sigterm = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if takes_sigterm:
        signal.signal(signal.SIGTERM, _terminate)
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:
            raise ConfigError(not_a_flag(getattr(module, "CONFIG", None), wanted, extras))
        if args.command is None:
            parser.print_help()
            return 2
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except ValueError as e:  # a ConfigError, or another ValueError: bad input either way
        print(f"{prog}: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
        return 2
    finally:
        if takes_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _terminate(signum, frame):
    raise KeyboardInterrupt  # unwinds like Ctrl-C: every context manager and finally block runs


if __name__ == "__main__":
    sys.exit(main())
