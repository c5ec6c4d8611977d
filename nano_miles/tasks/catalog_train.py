"""More training tasks: 20 templates on top of task_catalog.py's, all in the train split.

On the GPU run the policy saturated the first 20 training tasks by ~step 60 (most GRPO groups all
right or all wrong: no signal left); these give training more variety. None repeats a held-out
template. Same rules as the catalog: parameters from the episode's rng, ground truth from ws.run.
"""
from __future__ import annotations

import datetime
import json
import random

from nano_miles.tasks.api import TaskInstance, Workspace, q, task
from nano_miles.tasks.catalog import WORDS, lines_of_words, token


def distinct_tokens(rng: random.Random, count: int, n: int = 6) -> list[str]:
    """`count` different tokens of the same length (so globs list them in the same order everywhere)."""
    out: list[str] = []
    while len(out) < count:
        t = token(rng, n)
        if t not in out:
            out.append(t)
    return out


# ---- text -----------------------------------------------------------------------------------------

@task("join_total", "text", "train", "join two files on a key and sum the matches (join/awk)")
def join_total(ws: Workspace, rng: random.Random) -> TaskInstance:
    names = rng.sample(WORDS, rng.randint(5, 10))
    ids = [f"u{n:03d}" for n in rng.sample(range(1000), len(names))]
    ws.write("users.txt", "".join(f"{i} {n}\n" for i, n in zip(ids, names)))
    who = rng.randrange(len(ids))
    orders = [rng.choice(ids) for _ in range(rng.randint(10, 30))] + [ids[who]]
    rng.shuffle(orders)
    ws.write("orders.txt", "".join(f"{i} {rng.randint(1, 500)}\n" for i in orders))
    name = names[who]
    want = (f"awk 'NR == FNR {{if ($2 == \"{name}\") id = $1; next}} $1 == id {{s += $2}} END {{print s}}' "
            "users.txt orders.txt")
    return TaskInstance(
        "users.txt has lines 'id name' and orders.txt has lines 'id amount' (the same ids). What is the total "
        f"amount of all the orders of the user named {name}? Answer with the number.", ws.run(want), "int",
        solution=["sort users.txt > users.sorted && sort orders.txt > orders.sorted",
                  f"join users.sorted orders.sorted | awk '$2 == \"{name}\" {{s += $3}} END {{print s}}'"])


@task("top_k_sum", "text", "train", "sum of the K largest values of a column (sort -n | head)")
def top_k_sum(ws, rng):
    names = rng.sample(WORDS, rng.randint(8, 20))
    ws.write("scores.txt", "".join(f"{n} {rng.randint(1, 999)}\n" for n in names))
    k = rng.randint(2, 5)
    cmd = f"sort -k2,2nr scores.txt | head -n {k} | awk '{{s += $2}} END {{print s}}'"
    return TaskInstance(f"scores.txt has lines 'name score'. What is the sum of the {k} highest scores? Answer "
                        "with the number.", ws.run(cmd), "int", solution=[cmd])


@task("diff_count", "text", "train", "number of lines that differ between two files (diff)")
def diff_count(ws, rng):
    old = distinct_tokens(rng, rng.randint(20, 50), 8)
    new = list(old)
    for i in rng.sample(range(len(old)), rng.randint(1, 8)):
        new[i] = token(rng, 9)  # 9 characters: never equal to an old line
    ws.write("old.txt", "\n".join(old) + "\n")
    ws.write("new.txt", "\n".join(new) + "\n")
    want = "awk 'NR == FNR {a[FNR] = $0; next} a[FNR] != $0' old.txt new.txt | wc -l"
    return TaskInstance("new.txt is a copy of old.txt in which some lines were replaced by others (no line was "
                        "added or removed). How many lines were replaced? Answer with the number.",
                        ws.run(want), "int", solution=["diff old.txt new.txt | grep -c '^<'"])


# ---- files ----------------------------------------------------------------------------------------

@task("files_over_size", "files", "train", "number of files larger than a size (find -size)")
def files_over_size(ws, rng):
    sizes = rng.sample(range(100, 6000), rng.randint(6, 14))
    for name, s in zip(distinct_tokens(rng, len(sizes)), sizes):
        ws.write(f"media/{name}.dat", "x" * s)
    limit = rng.randint(1000, 4000)
    while limit in sizes:
        limit += 1
    want = f"stat -c %s media/* | awk '$1 > {limit}' | wc -l"
    return TaskInstance(f"How many files in media/ are larger than {limit} bytes? Answer with the number.",
                        ws.run(want), "int", solution=[f"find media -type f -size +{limit}c | wc -l"])


@task("rename_ext", "files", "train", "rename files by pattern: .txt to .md (loop + mv)")
def rename_ext(ws, rng):
    names = distinct_tokens(rng, rng.randint(5, 12))
    for i, n in enumerate(names):
        ws.write(f"notes/{n}.{'txt' if i == 0 else rng.choice(['txt', 'txt', 'md', 'cfg'])}", f"{n}\n")
    want = ws.run("ls notes | sed 's/\\.txt$/.md/' | sort | tr '\\n' ' '")
    return TaskInstance("Rename every file in notes/ whose name ends in .txt so that it ends in .md instead "
                        "(abc.txt becomes abc.md); leave the other files alone. Then answer with the number of "
                        ".md files in notes/.", ws.run("ls notes | grep -c '\\.\\(txt\\|md\\)$'"), "int",
                        check=f"[ \"$(ls notes | sort | tr '\\n' ' ')\" = {q(want)} ]",
                        solution=['for f in notes/*.txt; do mv "$f" "${f%.txt}.md"; done', "ls notes/*.md | wc -l"])


@task("symlink_current", "files", "train", "create a relative symlink to a directory and read through it")
def symlink_current(ws, rng):
    versions = [f"v{rng.randint(1, 3)}.{m}" for m in sorted(rng.sample(range(30), rng.randint(3, 7)))]
    for v in versions:
        ws.write(f"releases/{v}/VERSION", f"{v}-{token(rng, 8)}\n")
    v = rng.choice(versions)
    return TaskInstance(f"Create a symbolic link named current in the current directory that points to the "
                        f"directory releases/{v} (a relative link). Then answer with the output of "
                        "`cat current/VERSION`.", ws.run(f"cat releases/{v}/VERSION"), "text",
                        check=f"[ -L current ] && [ \"$(cd current && pwd -P)\" = \"$(cd releases/{v} && pwd -P)\" ]",
                        solution=[f"ln -s releases/{v} current", "cat current/VERSION"])


# ---- archives -------------------------------------------------------------------------------------

@task("gzip_logs", "archives", "train", "gzip every .log file of a directory in place")
def gzip_logs(ws, rng):
    names = distinct_tokens(rng, rng.randint(4, 10))
    n_txt = 0
    for i, n in enumerate(names):
        ext = "log" if i < 2 else ("txt" if i == 2 else rng.choice(["log", "txt"]))
        n_txt += ext == "txt"
        ws.write(f"logs/{n}.{ext}", "".join(f"{token(rng, 12)}\n" for _ in range(rng.randint(5, 30))))
    want = ws.run("cat logs/*.log | sha256sum | cut -d' ' -f1")
    return TaskInstance("Compress every .log file in logs/ with gzip, replacing each by its .log.gz file (leave "
                        "the other files as they are). Then answer with the number of .gz files in logs/.",
                        ws.run("ls logs/*.log | wc -l"), "int",
                        check=f"[ -z \"$(ls logs | grep '\\.log$')\" ] && [ $(ls logs/*.txt | wc -l) -eq {n_txt} ] && "
                              f"[ \"$(gunzip -c logs/*.log.gz | sha256sum | cut -d' ' -f1)\" = {want} ]",
                        solution=["gzip logs/*.log", "ls logs/*.gz | wc -l"])


@task("tar_newest_member", "archives", "train", "the most recently modified file in a .tar.gz (tar -tv)")
def tar_newest_member(ws, rng):
    names = distinct_tokens(rng, rng.randint(4, 9))
    base = rng.randint(1_000_000_000, 1_600_000_000)
    for n, day in zip(names, rng.sample(range(400), len(names))):  # whole days apart: no time zone ties
        ws.write(f"logs/{n}.log", f"{token(rng, 20)}\n")
        ws.run(f"touch -d @{base + day * 86400} logs/{n}.log")
    want = ws.run("ls -t logs | head -1")
    ws.run("tar -czf logs.tar.gz logs && rm -rf logs")
    return TaskInstance("Which file in the archive logs.tar.gz has the most recent modification time? Answer "
                        "with its file name only (like name.log).", want, "text",
                        solution=["tar -tvzf logs.tar.gz | grep -v '^d' | sort -k4,5 | tail -1 | awk '{print $6}' "
                                  "| xargs basename"])


# ---- json -----------------------------------------------------------------------------------------

@task("json_keys", "json", "train", "top-level keys of a JSON object, sorted (python3 -c)")
def json_keys(ws, rng):
    keys = rng.sample(WORDS, rng.randint(3, 8))
    obj = {k: rng.choice([rng.randint(0, 999), token(rng, 5), rng.random() < 0.5,
                          {w: rng.randint(0, 9) for w in rng.sample(WORDS, 2)}]) for k in keys}
    ws.write("meta.json", json.dumps(obj, indent=2))
    cmd = "python3 -c 'import json; print(\",\".join(sorted(json.load(open(\"meta.json\")))))'"
    return TaskInstance("meta.json holds one JSON object. What are its top-level keys? Answer with them in "
                        "alphabetical order, separated by commas with no spaces (like a,b,c).",
                        ws.run(cmd), "text", solution=[cmd])


@task("json_lookup", "json", "train", "a field of the JSON record with a given id")
def json_lookup(ws, rng):
    ids = rng.sample(range(100, 999), rng.randint(5, 15))
    users = [{"id": i, "name": rng.choice(WORDS),
              "email": f"{token(rng, 5)}@{rng.choice(WORDS)}.{rng.choice(['com', 'org', 'net'])}"} for i in ids]
    ws.write("users.json", json.dumps(users, indent=1))
    uid = rng.choice(ids)
    cmd = (f"python3 -c 'import json; print([u[\"email\"] for u in json.load(open(\"users.json\")) "
           f"if u[\"id\"] == {uid}][0])'")
    return TaskInstance(f"users.json is a JSON list of user records. What is the email address of the user whose "
                        f"id is {uid}? Answer with the address.", ws.run(cmd), "text", solution=[cmd])


# ---- permissions ----------------------------------------------------------------------------------

@task("world_writable_file", "permissions", "train", "the one file writable by others (find -perm)")
def world_writable_file(ws, rng):
    names = distinct_tokens(rng, rng.randint(4, 10))
    holder = rng.choice(names)
    for n in names:
        mode = rng.choice([0o666, 0o646, 0o777, 0o602]) if n == holder else \
            rng.choice([0o644, 0o640, 0o600, 0o755, 0o664, 0o775, 0o700])
        ws.write(f"shared/{n}.cfg", "k=v\n", mode=mode)
    cmd = "find shared -type f -perm -o+w | xargs -n1 basename"
    return TaskInstance("Exactly one file in shared/ can be written by others (the world-write permission bit). "
                        "Which one? Answer with its file name only (like name.cfg).", ws.run(cmd), "text",
                        solution=[cmd])


@task("strip_other_perms", "permissions", "train", "remove all permissions for others (chmod o-rwx)")
def strip_other_perms(ws, rng):
    names = distinct_tokens(rng, rng.randint(3, 8))
    for i, n in enumerate(names):
        mode = 0o644 if i == 0 else rng.choice([0o644, 0o755, 0o666, 0o604, 0o640, 0o750, 0o707])
        ws.write(f"vault/{n}.key", token(rng, 16), mode=mode)
    pick = rng.choice(names)
    mode = ws.run(f"stat -c %a vault/{pick}.key")
    owner_group = ws.run("cd vault && stat -c '%n %a' * | sed 's/.$//'")
    return TaskInstance("Remove every permission of others (read, write and execute) from all the files in "
                        "vault/, leaving the owner and group permissions as they are. Then answer with the "
                        f"output of `stat -c %a vault/{pick}.key`.",
                        ws.run(f"f=$(mktemp) && chmod {mode} $f && chmod o-rwx $f && stat -c %a $f; rm -f $f"), "text",
                        check="[ -z \"$(find vault -type f -perm /o=rwx)\" ] && "
                              f"[ \"$(cd vault && stat -c '%n %a' * | sed 's/.$//')\" = {q(owner_group)} ]",
                        solution=["chmod o-rwx vault/*", f"stat -c %a vault/{pick}.key"])


# ---- process --------------------------------------------------------------------------------------

@task("pipe_status", "process", "train", "exit status of every stage of a pipeline (PIPESTATUS)")
def pipe_status(ws, rng):
    a, b, c = (rng.randint(0, 60) for _ in range(3))
    ws.write("produce.sh", f"#!/bin/sh\necho {token(rng, 8)}\nexit {a}\n", mode=0o755)
    ws.write("filter.sh", f"#!/bin/sh\ncat\nexit {b}\n", mode=0o755)
    ws.write("consume.sh", f"#!/bin/sh\ncat >/dev/null\nexit {c}\n", mode=0o755)
    cmd = "./produce.sh | ./filter.sh | ./consume.sh; echo ${PIPESTATUS[@]}"
    return TaskInstance("Run the pipeline `./produce.sh | ./filter.sh | ./consume.sh` in bash. What is the exit "
                        "status of each of its three commands? Answer with the three numbers in pipeline order, "
                        "separated by single spaces (like 0 1 2).", ws.run(cmd), "text", solution=[cmd])


@task("stdin_script", "process", "train", "feed a file to a script on standard input")
def stdin_script(ws, rng):
    m, p = rng.randint(3, 97), rng.choice([10007, 65521, 99991])
    ws.write("digest.sh", f"#!/bin/sh\nawk '{{s = (s * {m} + $1) % {p}}} END {{print s + 0}}'\n", mode=0o755)
    ws.write("input.txt", "".join(f"{rng.randint(0, 9999)}\n" for _ in range(rng.randint(10, 40))))
    cmd = "./digest.sh < input.txt"
    return TaskInstance("./digest.sh reads numbers from its standard input. Run it with the contents of input.txt "
                        "as its standard input and answer with what it prints.", ws.run(cmd), "int",
                        solution=[cmd])


# ---- scripts --------------------------------------------------------------------------------------

@task("squares_script", "scripts", "train", "write a script with a loop, then sum its output")
def squares_script(ws, rng):
    n, m = rng.randint(5, 60), rng.randint(3, 12)
    return TaskInstance(
        "Write an executable bash script squares.sh that takes one argument N and prints the squares "
        f"1, 4, 9, ..., N*N, one per line. Then answer with the sum of the numbers that `./squares.sh {n}` "
        "prints.", ws.run(f"seq 1 {n} | awk '{{s += $1 * $1}} END {{print s}}'"), "int",
        check=f"[ \"$(./squares.sh {m} | tr '\\n' ' ')\" = \"$(seq 1 {m} | awk '{{printf \"%d \", $1 * $1}}')\" ]",
        solution=["printf '#!/bin/bash\\nfor ((i = 1; i <= $1; i++)); do echo $((i * i)); done\\n' > squares.sh "
                  "&& chmod +x squares.sh", f"./squares.sh {n} | awk '{{s += $1}} END {{print s}}'"])


@task("divmod", "scripts", "train", "integer quotient and remainder with shell arithmetic")
def divmod_task(ws, rng):
    a, b = rng.randint(10000, 999999), rng.randint(7, 997)
    return TaskInstance(f"Using shell arithmetic, compute the integer quotient and the remainder of {a} divided by "
                        f"{b}. Answer with both numbers, quotient first, separated by one space (like 12 5).",
                        ws.run(f"echo $(({a} / {b})) $(({a} % {b}))"), "text",
                        solution=[f"echo $(expr {a} / {b}) $(expr {a} % {b})"])


# ---- hashing --------------------------------------------------------------------------------------

@task("sha1_created_file", "hashing", "train", "create a file with a given line, then its SHA-1")
def sha1_created_file(ws, rng):
    s = f"{rng.choice(WORDS)} {token(rng, 8)}"
    return TaskInstance(f"Create a file greeting.txt whose content is exactly the line '{s}' followed by a "
                        "newline. Then answer with the SHA-1 hex digest of greeting.txt (40 hex characters).",
                        ws.run(f"printf '%s\\n' {q(s)} | sha1sum | cut -d' ' -f1"), "hex",
                        check=f"printf '%s\\n' {q(s)} | cmp -s - greeting.txt",
                        solution=[f"echo {q(s)} > greeting.txt", "sha1sum greeting.txt | cut -d' ' -f1"])


@task("checksum_mismatch", "hashing", "train", "the file that fails a SHA-256 checksum list (sha256sum -c)")
def checksum_mismatch(ws, rng):
    names = distinct_tokens(rng, rng.randint(4, 10))
    for n in names:
        ws.write(f"data/{n}.txt", " ".join(lines_of_words(rng, rng.randint(5, 20))) + "\n")
    ws.run("sha256sum data/*.txt > SHA256SUMS")
    bad = rng.choice(names)
    ws.write(f"data/{bad}.txt", token(rng, 24) + "\n")
    cmd = "sha256sum -c SHA256SUMS 2>/dev/null | grep ': FAILED$' | cut -d: -f1 | xargs basename"
    return TaskInstance("SHA256SUMS lists the SHA-256 sums of the files in data/, but one file was changed after "
                        "the list was made. Which one? Answer with its file name only (like name.txt).",
                        ws.run(cmd), "text", solution=[cmd])


# ---- system ---------------------------------------------------------------------------------------

@task("epoch_to_date", "system", "train", "a Unix timestamp as a UTC date (date -d @N -u)")
def epoch_to_date(ws, rng):
    e = rng.randint(0, 2_000_000_000)
    cmd = f"date -u -d @{e} +%Y-%m-%d"
    return TaskInstance(f"Convert the Unix timestamp {e} (seconds since 1970-01-01 00:00:00 UTC) to a calendar "
                        "date in UTC. Answer in the form YYYY-MM-DD.", ws.run(cmd), "text", solution=[cmd])


@task("days_between", "system", "train", "days between two dates (date +%s arithmetic)")
def days_between(ws, rng):
    d1 = datetime.date(2000, 1, 1) + datetime.timedelta(days=rng.randint(0, 9000))
    d2 = d1 + datetime.timedelta(days=rng.randint(1, 3000))
    cmd = f"echo $(( ($(date -u -d {d2} +%s) - $(date -u -d {d1} +%s)) / 86400 ))"
    return TaskInstance(f"How many days are there from {d1} to {d2} (the later date minus the earlier one)? "
                        "Answer with the number.", ws.run(cmd), "int", solution=[cmd])
