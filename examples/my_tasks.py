"""Your own shell tasks, registered through the same public API as nano-miles' built-in catalog.

    nano-miles tasks list  --tasks-module examples/my_tasks.py --split logs
    nano-miles tasks check --tasks-module examples/my_tasks.py --tasks logs   # solvable here?
    nano-miles eval --model qwen2.5-coder-0.5b-instruct --tasks-module examples/my_tasks.py --tasks logs
    nano-miles train --set 'tasks_module=["examples/my_tasks.py"]' --set tasks=logs

Rules (docs/tasks.md): a setup draws every parameter from `rng` (the episode's seed), writes files
with `ws.write` (or runs commands), and computes the expected answer by running a real command in
the episode's sandbox with `ws.run`; it never types the answer in. `solution` is a scripted policy
(its last command prints the answer) that `nano-miles tasks check` and the tests play through the
environment. Task ids are stable: results refer to them.
"""
import random

from nano_miles.tasks import TaskInstance, Workspace, q, task

LEVELS = ("INFO", "WARN", "ERROR", "DEBUG")


def log_lines(rng: random.Random, n: int) -> list[str]:
    return [f"2026-12-0{rng.randint(1, 9)}T{rng.randint(10, 23)}:{rng.randint(10, 59)}:00 "
            f"{rng.choice(LEVELS)} worker-{rng.randint(1, 6)} job {rng.randint(1000, 9999)} done"
            for _ in range(n)]


@task("log_errors", family="logs", split="train", summary="count the ERROR lines of a log file")
def log_errors(ws: Workspace, rng: random.Random) -> TaskInstance:
    ws.write("app.log", "\n".join(log_lines(rng, rng.randint(20, 80))) + "\n")
    cmd = "grep -c ' ERROR ' app.log"
    return TaskInstance("How many lines of app.log have the level ERROR? Answer with the number.",
                        expected=ws.run(cmd), kind="int", solution=[cmd])


@task("log_busiest_worker", family="logs", split="heldout", summary="the worker with the most log lines")
def log_busiest_worker(ws: Workspace, rng: random.Random) -> TaskInstance:
    lines = log_lines(rng, rng.randint(20, 60))
    winner = f"worker-{rng.randint(1, 6)}"
    lines += [f"2026-12-10T10:00:00 INFO {winner} job 1 done"] * 25  # one clear winner
    rng.shuffle(lines)
    ws.write("app.log", "\n".join(lines) + "\n")
    cmd = "awk '{print $3}' app.log | sort | uniq -c | sort -rn | head -1 | awk '{print $2}'"
    return TaskInstance("Which worker (third field of app.log, like worker-3) has the most lines? Answer with "
                        "its name.", expected=ws.run(cmd), kind="text", solution=[cmd])


@task("log_rotate", family="logs", split="train", summary="gzip a log into an archive folder, report its size")
def log_rotate(ws: Workspace, rng: random.Random) -> TaskInstance:
    name = f"app-{rng.randint(100, 999)}.log"
    ws.write(name, "\n".join(log_lines(rng, rng.randint(30, 90))) + "\n")
    want = ws.run(f"sha256sum < {q(name)} | cut -d' ' -f1")   # the content the archive must hold
    return TaskInstance(
        f"Compress {name} with gzip into archive/{name}.gz (create the directory archive/, remove the original), "
        f"then answer with the number of lines of the uncompressed log.",
        expected=ws.run(f"wc -l < {q(name)}"), kind="int",
        # the workspace state is part of success: the archive decompresses to the original, which is gone
        check=f"test ! -e {q(name)} && [ \"$(gzip -dc archive/{q(name)}.gz | sha256sum | cut -d' ' -f1)\" = {want} ]",
        solution=["mkdir -p archive", f"gzip {q(name)}", f"mv {q(name)}.gz archive/",
                  f"gzip -dc archive/{q(name)}.gz | wc -l"])


# A task that needs files at a fixed absolute path: /srv/app is a fresh directory of each episode's
# sandbox, prepared here and thrown away with the episode (the namespaced tier; elsewhere the task is
# skipped with the reason). The policy's commands start in /srv/app (workdir).
@task("app_config_port", family="logs", split="heldout", summary="a port number from /srv/app/config.ini",
      mounts=("/srv/app",), workdir="/srv/app")
def app_config_port(ws: Workspace, rng: random.Random) -> TaskInstance:
    port = rng.randint(1024, 65000)
    ws.write("/srv/app/config.ini", f"[server]\nhost = 0.0.0.0\nport = {port}\n[db]\nport = {port + 1}\n")
    cmd = "awk -F' = ' '/^\\[server\\]/{s=1} /^\\[db\\]/{s=0} s && $1 == \"port\" {print $2}' /srv/app/config.ini"
    return TaskInstance("Which port does the [server] section of /srv/app/config.ini set? Answer with the number.",
                        expected=ws.run(cmd), kind="int", solution=["grep -A3 '^\\[server\\]' config.ini | "
                                                                   "grep '^port' | cut -d' ' -f3"])
