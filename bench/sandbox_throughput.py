"""Isolated commands per second and per-episode sandbox cost: each working tier against plain subprocess.

    .venv/bin/python bench/sandbox_throughput.py [--n 300] [--concurrency 8] [--command true] [--episodes 40]
                                                 [--pool-size 4] [--think-ms 0]

Commands: "plain subprocess" is bash -c COMMAND in a new session with captured output (what an
unsandboxed tool runner does); "bare bwrap" is `bwrap --unshare-all --ro-bind / / bash -c COMMAND`
(a sandbox start per command; as root, also under an unprivileged uid, as the Sandbox runs it). Each
tier runs through Sandbox.exec with default limits: one Sandbox shared by the threads (the goal's
figure), and for the namespaced tier also one Sandbox per thread (how rollouts use it: every episode
its own sandbox, its commands one at a time).
Goal (issue 12): namespaced >= 1,000 commands/s 8-way and >= 65% of plain subprocess.

Episodes: --episodes times, one at a time, Sandbox() + exec(COMMAND) + exec(COMMAND) + close().
"creation" is the episode's wall time beyond its commands: Sandbox() + close() + boot wait (first exec -
second exec), i.e. what a sandbox start adds (the namespaced tier's init boots while Sandbox() returns and
the first exec waits for it). Medians; "bare bwrap run" is one `bwrap ... true` for reference. CPU
(less moved by other load than wall time): of a command, and of a sandbox start (an episode's CPU
beyond its two commands), this process and its children together; plain subprocess's CPU per command
for comparison. Goal: creation <= 15 ms. The last lines say each goal's figure and whether it is met.
Pooled episodes (namespaced tier, --pool-size > 0): the same episodes and the same creation, with
SandboxPool(size).take() in place of Sandbox(): back to back (the worst case: the pool refills one boot
at a time while episodes drain it), and with --think-ms > 0 also with that much sleep between an
episode's two commands (a model generating: the pool refills meanwhile; "episode" includes it). Its CPU
a start counts the boots of the sandboxes left idle at the end too, spread over every sandbox booted.
The cold figure (Sandbox(), nothing booted ahead) stays the goal's figure; the pooled ones are beside it.

Fairness: every runner gets the same warm-up, then --rounds rounds in which the runners take turns
(so a burst of load from elsewhere hits them alike); each figure is the best round. The load average
is printed before and after: on a shared 2-core machine it moves the figures more than anything else.
Prints tables and appends one JSON line to bench/results.jsonl.
"""

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.results import add_dry_run, git_commit, save, utc_now  # noqa: E402
from nano_openshell import Sandbox, SandboxPool, probe  # noqa: E402
from nano_openshell.namespaced import find_bwrap, uid_drop_argv  # noqa: E402


def plain(command: str) -> None:
    subprocess.run(["/bin/bash", "-c", command], stdin=subprocess.DEVNULL, capture_output=True,
                   start_new_session=True, timeout=30)


def rate(run_one, n: int, concurrency: int) -> float:
    t0 = time.perf_counter()
    if concurrency == 1:
        for _ in range(n):
            run_one()
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda _: run_one(), range(n)))
    return n / (time.perf_counter() - t0)


def checked(sb: Sandbox, command: str) -> None:
    r = sb.exec(command, timeout=30)
    assert r.exit_code == 0 and not r.timed_out, r


def cpu_s() -> float:
    """CPU seconds of this process and of every child it reaped (a Sandbox's bwrap carries its init's
    and its commands' CPU, once close() reaped it)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def episode_ms(tier: str, command: str, n: int, pool_size: int = 0, think_ms: float = 0) -> dict:
    """Medians over n sequential episodes, in ms; and CPU ms: per command (in one long-lived Sandbox)
    and per sandbox start (an episode's CPU beyond its two commands). pool_size > 0: the episodes take
    their sandboxes from a SandboxPool of that size, filled before the first one."""
    parts = {"sandbox_call": [], "first_exec": [], "exec": [], "close": [], "episode": []}
    pool = SandboxPool(pool_size, tier=tier, min_tier="fallback") if pool_size else None
    make = pool.take if pool else lambda: Sandbox(tier=tier, min_tier="fallback")
    c0 = cpu_s()
    if pool:
        assert pool.wait_filled(30), "the pool did not fill"
    for _ in range(n):
        t0 = time.perf_counter()
        sb = make()
        t1 = time.perf_counter()
        checked(sb, command)
        t2 = time.perf_counter()
        time.sleep(think_ms / 1000)
        t_think = time.perf_counter()
        checked(sb, command)
        t3 = time.perf_counter()
        sb.close()
        t4 = time.perf_counter()
        for key, v in (("sandbox_call", t1 - t0), ("first_exec", t2 - t1), ("exec", t3 - t_think),
                       ("close", t4 - t3), ("episode", t4 - t0)):
            parts[key].append(v * 1000)
    if pool:
        pool.close()
    booted = n + (pool_size if pool else 0)  # a pool leaves its idle ones booted (and closes them)
    episode_cpu = cpu_s() - c0
    c0, sb = cpu_s(), Sandbox(tier=tier, min_tier="fallback")
    for _ in range(10 * n):
        checked(sb, command)
    sb.close()
    command_cpu = (cpu_s() - c0) / (10 * n)
    out = {k: round(statistics.median(v), 2) for k, v in parts.items()}
    out["boot_wait"] = round(out["first_exec"] - out["exec"], 2)  # the first command waiting for the init
    out["creation"] = round(out["sandbox_call"] + out["close"] + out["boot_wait"], 2)
    out["cpu_command"] = round(command_cpu * 1000, 2)
    out["cpu_creation"] = round((episode_cpu - 2 * n * command_cpu) / booted * 1000, 2)
    return out


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def plain_cpu_ms(command: str, n: int) -> float:
    """CPU ms of one plain subprocess command (this process and its children), as cpu_command."""
    c0 = cpu_s()
    for _ in range(n):
        plain(command)
    return round((cpu_s() - c0) / n * 1000, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="commands per measurement")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--command", default="true")
    ap.add_argument("--rounds", type=int, default=3, help="each figure is the best of this many rounds")
    ap.add_argument("--episodes", type=int, default=40, help="sequential episodes per round (0: skip)")
    ap.add_argument("--pool-size", type=int, default=4, help="pooled episodes' SandboxPool size (0: skip them)")
    ap.add_argument("--think-ms", type=float, default=0, help="pooled episodes also with this sleep between commands")
    add_dry_run(ap)
    args = ap.parse_args()

    p = probe()
    runners = {"plain subprocess": lambda: plain(args.command)}
    bwrap = find_bwrap()
    bare = None
    if p["tiers"]["namespaced"]["ok"] and bwrap:
        bare = [bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "/bin/bash", "-c", args.command]
        runners["bare bwrap"] = lambda: subprocess.run(bare, stdin=subprocess.DEVNULL, capture_output=True,
                                                       timeout=30, check=True)
        drop = uid_drop_argv(65534) if os.geteuid() == 0 else None
        if drop:  # what the Sandbox does as root: bwrap under an unprivileged uid, dropped the same way
            bare_uid = drop + bare
            runners["bare bwrap, uid dropped"] = lambda: subprocess.run(
                bare_uid, stdin=subprocess.DEVNULL, capture_output=True, timeout=30, check=True)
    sandboxes, tiers = [], [t for t in ("namespaced", "fallback") if p["tiers"][t]["ok"]]
    for tier in ("namespaced", "fallback"):
        if tier not in tiers:
            print(f"# tier {tier} skipped: {p['tiers'][tier]['reason']}")
            continue
        sb = Sandbox(tier=tier, min_tier="fallback")
        sandboxes.append(sb)
        runners[f"Sandbox {tier}"] = lambda sb=sb: checked(sb, args.command)
        if tier == "namespaced":
            own = [Sandbox(tier=tier) for _ in range(args.concurrency)]
            sandboxes += own
            local, free, lock = threading.local(), list(own), threading.Lock()

            def per_thread():
                if not hasattr(local, "sb"):
                    with lock:  # the sequential figure reuses the first; each pool thread takes its own
                        local.sb = free.pop() if free else own[0]
                checked(local.sb, args.command)
            runners["Sandbox namespaced, one per thread"] = per_thread

    par_key = f"concurrent{args.concurrency}_per_s"
    best = {name: {"runner": name, "sequential_per_s": 0.0, par_key: 0.0} for name in runners}
    episodes = {tier: None for tier in tiers} if args.episodes else {}
    pooled = {}  # row name -> think ms, for the pooled episodes (namespaced: the tier whose init boots)
    if args.episodes and args.pool_size and "namespaced" in tiers:
        pooled[f"namespaced, pool of {args.pool_size}"] = 0
        if args.think_ms:
            pooled[f"namespaced, pool of {args.pool_size}, {args.think_ms:g} ms think"] = args.think_ms
    episodes.update({name: None for name in pooled})
    bare_ms, plain_cpu = None, None
    load_before = os.getloadavg()[0]
    try:
        for run_one in runners.values():
            for _ in range(min(10, args.n)):  # warm up (page cache, lazily built state)
                run_one()
        for _ in range(args.rounds):
            for name, run_one in runners.items():
                for key, concurrency in (("sequential_per_s", 1), (par_key, args.concurrency)):
                    best[name][key] = max(best[name][key], round(rate(run_one, args.n, concurrency), 1))
            if args.episodes:
                ms = plain_cpu_ms(args.command, 10 * args.episodes)
                plain_cpu = min(plain_cpu or ms, ms)
            for row in episodes:
                if row in pooled:
                    e = episode_ms("namespaced", args.command, args.episodes, args.pool_size, pooled[row])
                else:
                    e = episode_ms(row, args.command, args.episodes)
                if episodes[row] is None or e["creation"] < episodes[row]["creation"]:
                    episodes[row] = e
            if bare and args.episodes:
                ms = statistics.median(1000 / rate(runners["bare bwrap"], 1, 1) for _ in range(args.episodes))
                bare_ms = round(min(bare_ms or ms, ms), 2)
    finally:
        for sb in sandboxes:
            sb.close()
    rows = list(best.values())

    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, kernel {platform.release()}"
    load = os.getloadavg()[0]
    print(f"\n{args.n} x `{args.command}`, best of {args.rounds} rounds, {machine}, uid {os.geteuid()}, "
          f"preferred tier {p['tier']}, load average {load_before:.1f} before, {load:.1f} after")
    print(f"| runner | sequential /s | {args.concurrency}-way /s |\n|---|---|---|")
    for r in rows:
        print(f"| {r['runner']} | {r['sequential_per_s']} | {r[par_key]} |")
    plain_par = best["plain subprocess"][par_key]
    if episodes:
        print(f"\nepisodes (median ms of {args.episodes}, best round): Sandbox() + 2 x exec + close(); creation = "
              "Sandbox() (pool: take()) + close() + boot wait (first exec - exec: the first command waiting for "
              "the init)"
              + (f"; one bare bwrap run: {bare_ms} ms" if bare_ms else ""))
        print("| tier | Sandbox() | first exec | exec | close() | boot wait | creation | episode | CPU: a command "
              "| CPU: a start |\n|---|---|---|---|---|---|---|---|---|---|")
        for tier, e in episodes.items():
            print(f"| {tier} | {e['sandbox_call']} | {e['first_exec']} | {e['exec']} | {e['close']} | "
                  f"{e['boot_wait']} | {e['creation']} | {e['episode']} | {e['cpu_command']} | {e['cpu_creation']} |")
        print(f"| plain subprocess | | | | | | | | {plain_cpu} | |")
    print(f"\nGOALS (issue 12), load average {load_before:.1f} before, {load:.1f} after (figures from a loaded "
          "machine are low):")
    for name in ("Sandbox namespaced", "Sandbox namespaced, one per thread"):
        if name in best and plain_par:
            rate_par = best[name][par_key]
            print(f"  {name}: {rate_par}/s {args.concurrency}-way (goal >= 1,000: {_met(rate_par >= 1000)}); "
                  f"{100 * rate_par / plain_par:.0f}% of plain subprocess's {plain_par}/s "
                  f"(goal >= 65%: {_met(rate_par >= 0.65 * plain_par)})")
    if episodes.get("namespaced"):
        e = episodes["namespaced"]
        print(f"  namespaced creation, cold (Sandbox(), the goal's figure): {e['creation']} ms "
              f"(goal <= 15 ms: {_met(e['creation'] <= 15)}): "
              f"Sandbox() {e['sandbox_call']} + close() {e['close']} + boot wait {e['boot_wait']}; "
              f"CPU {e['cpu_creation']} ms a start, {e['cpu_command']} ms a command (plain subprocess {plain_cpu})")
    for row, think in pooled.items():
        e, how = episodes[row], "back to back" if not think else "thinking between commands"
        print(f"  namespaced creation, {row[len('namespaced, '):]} ({how}): {e['creation']} ms "
              f"(<= 15 ms: {_met(e['creation'] <= 15)}): "
              f"take() {e['sandbox_call']} + close() {e['close']} + boot wait {e['boot_wait']}")
    record = {"bench": "sandbox_throughput",
              "date": utc_now(),
              "commit": git_commit(), "machine": machine, "uid": os.geteuid(), "preferred_tier": p["tier"],
              "init": p["capabilities"].get("init"),
              "load_average": round(load, 2), "load_average_before": round(load_before, 2),
              "config": vars(args), "results": rows, "episodes_ms": episodes, "bare_bwrap_run_ms": bare_ms,
              "plain_cpu_command_ms": plain_cpu}
    save(record, "sandbox_throughput.json", dry_run=args.dry_run)


if __name__ == "__main__":
    main()
