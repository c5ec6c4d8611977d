"""`nano-openshell`: exec / probe / proxy.

    nano-openshell exec [--timeout SEC] [--workspace DIR] [--policy FILE] [--min-tier TIER] -- COMMAND
        prints the ExecResult as one JSON object; exit 0 when the command ran (whatever its own exit
        code), 2 with a one-line error on bad input, 3 when the sandbox cannot run here as asked
    nano-openshell probe                           the probe as JSON
    nano-openshell proxy --policy FILE --socket PATH [--audit FILE]
        the egress proxy in the foreground (an invalid policy exits 2 before anything starts)
"""

import argparse
import json
import os
import shlex
import signal
import sys
import threading

from .api import SandboxError, validate_command, validate_timeout
from .policy import Policy, PolicyError
from .probe import probe
from .proxy import ProxyServer
from .sandbox import Sandbox


def _fail(message: str, code: int = 2) -> int:
    print(f"nano-openshell: error: {message}", file=sys.stderr)
    return code


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        sys.exit(_fail(message))


def _cmd_exec(args) -> int:
    words = args.command[1:] if args.command[:1] == ["--"] else args.command
    # one word is the whole bash command; several are joined as shell words, quoted
    command = words[0] if len(words) == 1 else " ".join(shlex.quote(w) for w in words)
    try:
        command = validate_command(command)  # undecodable argv bytes arrive as lone surrogates: refused there
        timeout = validate_timeout(args.timeout)
        if args.workspace is not None and not os.path.isdir(args.workspace):
            raise ValueError(f"workspace {args.workspace!r} does not exist or is not a directory")
        if args.policy is not None and not os.path.isfile(args.policy):
            raise ValueError(f"policy file {args.policy!r} does not exist")
    except (TypeError, ValueError) as e:
        return _fail(str(e))
    try:
        with Sandbox(workspace=args.workspace, policy=args.policy, min_tier=args.min_tier) as sb:
            result = sb.exec(command, timeout=timeout)
    except ValueError as e:  # includes PolicyError
        return _fail(str(e))
    except SandboxError as e:
        return _fail(str(e), 3)
    print(json.dumps(result.to_dict()))
    return 0


def _cmd_probe(_args) -> int:
    print(json.dumps(probe(), indent=2))
    return 0


def _cmd_proxy(args) -> int:
    try:
        policy = Policy.load(args.policy)
    except (PolicyError, OSError) as e:
        return _fail(f"invalid policy {args.policy!r}: {e}")
    p = probe()
    server = ProxyServer(policy, args.socket, audit_path=args.audit,
                         info={"tier": p["tier"], "capabilities": p["capabilities"]})
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with server:  # starts it; stops it on the way out
        print(json.dumps({"listening": args.socket, "policy_sha256": policy.sha256}), flush=True)
        stop.wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="nano-openshell", description="A zero-trust sandbox for agent shell commands.")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)
    ex = sub.add_parser("exec", help="run one command in the sandbox, print the result as JSON")
    ex.add_argument("--timeout", type=float, default=30.0)
    ex.add_argument("--workspace", default=None)
    ex.add_argument("--policy", default=None)
    ex.add_argument("--min-tier", default="namespaced", choices=("namespaced", "fallback", "none"))
    ex.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("probe", help="print which isolation tier works here, and each capability")
    px = sub.add_parser("proxy", help="run the egress proxy on a Unix socket in the foreground")
    px.add_argument("--policy", required=True)
    px.add_argument("--socket", required=True)
    px.add_argument("--audit", default=None)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.cmd is None:
        parser.print_help(sys.stderr)
        return 2
    if args.cmd == "exec" and not [w for w in args.command if w != "--"]:
        return _fail("empty command")
    return {"exec": _cmd_exec, "probe": _cmd_probe, "proxy": _cmd_proxy}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
