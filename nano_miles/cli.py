"""`nano-miles` command line: one subcommand per concept, each living in its own module.

Every subcommand module exposes `add_arguments(parser)` and `run(args) -> int`, and `CONFIG`, its
root config dataclass, when it takes config keys (`--config` / `--set`, see nano_miles/config.py and
docs/config.md). This file only wires them together, importing a module when its subcommand is used
(torch imports are slow), and prints bad input as one line: a ConfigError or ValueError from a
subcommand is `nano-miles <command>: <what is wrong>` on stderr and exit status 2, never a traceback.
SIGTERM (a scheduler, `timeout`, `kill`) stops a command the way Ctrl-C does: what it holds is
released on the way out (sandboxes and their workspaces, engines; `train` checkpoints first), where
Python's default would end the process at once and leave them behind. Either ends with one line.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

from nano_miles.config import ConfigError

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "prepare-model": ("nano_miles.models.prepare", "materialise a model into the local cache and print its path"),
    "serve": ("nano_miles.engine.server", "start the SGLang-compatible inference engine server"),
    "tasks": ("nano_miles.tasks.cli", "list the shell tasks and their splits"),
    "rollout": ("nano_miles.rollout_command", "run multi-turn rollouts and write trajectories as JSONL"),
    "eval": ("nano_miles.evaluate", "pass@1 / pass@K of a model on a task split"),
    "train": ("nano_miles.train", "GRPO training: rollout, update, weight sync, telemetry"),
}


# The CUDA caching allocator, unless the user set it: with expandable segments a trainer's reserved
# memory stays near its peak (34 GB for 32 GB allocated, where the default held 78 GB for 51 GB and the
# other run sharing its GPU ran out of memory, H200, 2026-12-02), and the engine's CUDA graphs and the
# ipc weight sync work with it. Read at the first CUDA allocation; children (ranks, engines) inherit it.
CUDA_ALLOC_CONF = "expandable_segments:True"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)
    parser = argparse.ArgumentParser(prog="nano-miles", description="Agentic GRPO on Linux shell tasks.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else argv
    # Only import the module of the subcommand being run; list the others by name.
    wanted = next((a for a in argv if not a.startswith("-")), None)
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as e:
                if e.name == module_name:
                    print(f"nano-miles: '{name}' is not available in this build", file=sys.stderr)
                    return 2
                raise
            module.add_arguments(p)
            modules[name] = module
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    takes_sigterm = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if takes_sigterm:
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return int(modules[args.command].run(args) or 0)
    except KeyboardInterrupt:
        print(f"nano-miles {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, ValueError) as e:  # ConfigError is a ValueError; both are bad input
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"nano-miles {args.command}: {message}", file=sys.stderr)
        return 2
    finally:
        if takes_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _terminate(signum, frame):
    raise KeyboardInterrupt  # unwinds like Ctrl-C: every context manager and finally block runs


if __name__ == "__main__":
    sys.exit(main())
