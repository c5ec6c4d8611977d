"""The task catalog: the four seed tasks, more training tasks, and a held-out set.

Each setup draws its parameters from the episode's rng, writes the workspace, and computes the
expected answer by running real commands in the sandbox (ws.run). Task ids are stable: never rename
one (results and held-out splits refer to them).
"""
from __future__ import annotations

import json
import random

from nano_miles.tasks.api import TaskInstance, Workspace, q, task

WORDS = ("apple", "river", "stone", "cloud", "tiger", "maple", "ember", "frost", "lemon", "otter",
         "pixel", "quartz", "raven", "solar", "tulip", "umber", "violet", "willow", "yarrow", "zephyr",
         "amber", "basil", "cedar", "delta", "eagle", "fjord", "garnet", "harbor", "iris", "juniper")


def token(rng: random.Random, n: int = 10) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(n))


def lines_of_words(rng: random.Random, n: int, vocab: int = 8) -> list[str]:
    pool = rng.sample(WORDS, vocab)
    return [rng.choice(pool) for _ in range(n)]


# ---- the four seed tasks (training split) ---------------------------------------------------------

@task("sha256_string", "hashing", "train", "SHA-256 of a given string", seed_task=True)
def sha256_string(ws: Workspace, rng: random.Random) -> TaskInstance:
    s = f"{rng.choice(WORDS)}-{token(rng, 8)}"
    cmd = f"printf %s {q(s)} | sha256sum | cut -d' ' -f1"
    return TaskInstance(
        f"Compute the SHA-256 hex digest of the string '{s}' (exactly those bytes, no trailing newline). "
        "Answer with the 64-character hex digest.", ws.run(cmd), "hex", solution=[cmd])


@task("numbers_file", "files", "train", "create numbers.txt holding 1..N and count its lines", seed_task=True)
def numbers_file(ws, rng):
    n = rng.randint(15, 120)
    return TaskInstance(
        f"Create a file numbers.txt in the current directory containing the integers 1 to {n}, one per "
        "line, then count its lines. Answer with the line count.",
        ws.run(f"seq 1 {n} | wc -l"), "int",
        check=f"seq 1 {n} | cmp -s - numbers.txt",
        solution=[f"seq 1 {n} > numbers.txt", "wc -l < numbers.txt"])


@task("kernel_name", "system", "train", "kernel name from uname -s, lower-cased", seed_task=True)
def kernel_name(ws, rng):
    return TaskInstance("What is the kernel name reported by `uname -s`? Answer with it in lower case.",
                        ws.run("uname -s | tr A-Z a-z"), "text", solution=["uname -s | tr A-Z a-z"])


@task("python_product", "scripts", "train", "a product computed with python3 -c from bash", seed_task=True)
def python_product(ws, rng):
    a, b = rng.randint(1000, 99999), rng.randint(1000, 99999)
    cmd = f"python3 -c 'print({a} * {b})'"
    return TaskInstance(f"Use `python3 -c` from bash to compute {a} * {b}. Answer with the number.",
                        ws.run(cmd), "int", solution=[cmd])


# ---- more training tasks --------------------------------------------------------------------------

@task("count_word", "text", "train", "occurrences of a word in a file (grep -o)")
def count_word(ws, rng):
    words = lines_of_words(rng, rng.randint(30, 80))
    target = rng.choice(words)
    text = "\n".join(" ".join(words[i:i + 5]) for i in range(0, len(words), 5)) + "\n"
    ws.write("story.txt", text)
    cmd = f"grep -ow {q(target)} story.txt | wc -l"
    return TaskInstance(f"How many times does the word '{target}' occur in story.txt? Answer with the number.",
                        ws.run(cmd), "int", solution=[cmd])


@task("unique_lines", "text", "train", "number of distinct lines (sort -u)")
def unique_lines(ws, rng):
    ws.write("names.txt", "\n".join(lines_of_words(rng, rng.randint(20, 60), vocab=rng.randint(5, 15))) + "\n")
    cmd = "sort -u names.txt | wc -l"
    return TaskInstance("How many distinct lines does names.txt contain? Answer with the number.",
                        ws.run(cmd), "int", solution=[cmd])


@task("most_frequent", "text", "train", "most frequent line (sort | uniq -c)")
def most_frequent(ws, rng):
    words = lines_of_words(rng, rng.randint(20, 50))
    winner = rng.choice(words)
    top = max(words.count(w) for w in set(words))
    words += [winner] * (top - words.count(winner) + 1)  # make the maximum unique
    rng.shuffle(words)
    ws.write("votes.txt", "\n".join(words) + "\n")
    cmd = "sort votes.txt | uniq -c | sort -rn | head -1 | awk '{print $2}'"
    return TaskInstance("Which line occurs most often in votes.txt? Answer with that line.",
                        ws.run(cmd), "text", solution=[cmd])


@task("sed_replace", "text", "train", "replace a word in place (sed -i), report occurrences of the new one")
def sed_replace(ws, rng):
    old, new = rng.sample(WORDS, 2)
    words = [old if rng.random() < 0.3 else rng.choice(WORDS[:10]) for _ in range(40)]
    words = [w for w in words if w != new]
    ws.write("notes.txt", "\n".join(" ".join(words[i:i + 4]) for i in range(0, len(words), 4)) + "\n")
    want = ws.run(f"sed 's/\\b{old}\\b/{new}/g' notes.txt | sha256sum | cut -d' ' -f1")
    cmd = f"grep -ow {new} notes.txt | wc -l"
    return TaskInstance(
        f"In notes.txt, replace every occurrence of the word '{old}' with '{new}' (edit the file in place). "
        f"Then answer with the number of times '{new}' now occurs in the file.",
        ws.run(f"sed 's/\\b{old}\\b/{new}/g' notes.txt | grep -ow {new} | wc -l"), "int",
        check=f"[ \"$(sha256sum < notes.txt | cut -d' ' -f1)\" = {want} ]",
        solution=[f"sed -i 's/\\b{old}\\b/{new}/g' notes.txt", cmd])


@task("csv_column_sum", "text", "train", "sum of a CSV column (awk)")
def csv_column_sum(ws, rng):
    rows = ["item,qty,price"] + [f"{rng.choice(WORDS)},{rng.randint(1, 20)},{rng.randint(1, 500)}"
                                 for _ in range(rng.randint(8, 25))]
    ws.write("sales.csv", "\n".join(rows) + "\n")
    cmd = "awk -F, 'NR>1 {s+=$3} END {print s}' sales.csv"
    return TaskInstance("sales.csv has a header row and columns item,qty,price. What is the sum of the price "
                        "column? Answer with the number.", ws.run(cmd), "int", solution=[cmd])


@task("count_ext", "files", "train", "count files with an extension in a tree (find)")
def count_ext(ws, rng):
    for i in range(rng.randint(10, 30)):
        d = "/".join(rng.sample(["logs", "app", "old", "tmp", "var"], rng.randint(1, 3)))
        ws.write(f"tree/{d}/{token(rng, 5)}.{rng.choice(['log', 'txt', 'log', 'cfg'])}", "x\n")
    cmd = "find tree -type f -name '*.log' | wc -l"
    return TaskInstance("How many files ending in .log are there anywhere under the directory tree/? "
                        "Answer with the number.", ws.run(cmd), "int", solution=[cmd])


@task("largest_file", "files", "train", "name of the largest file in a directory")
def largest_file(ws, rng):
    sizes = rng.sample(range(10, 5000), rng.randint(4, 9))
    for s in sizes:
        ws.write(f"data/{token(rng, 6)}.bin", bytes(rng.getrandbits(8) for _ in range(s)))
    cmd = "ls -S data | head -1"
    return TaskInstance("Which file in the directory data/ is the largest? Answer with its file name only.",
                        ws.run(cmd), "text", solution=[cmd])


@task("make_tree", "files", "train", "create nested directories and a file with given content")
def make_tree(ws, rng):
    a, b, c = rng.sample(WORDS, 3)
    secret = token(rng, 12)
    return TaskInstance(
        f"Create the directory path {a}/{b}/{c} and inside it a file named key.txt containing exactly the line "
        f"{secret}. Then answer with the output of `find {a} -type d | wc -l`.",
        ws.run(f"printf '%s\\n' {a} {a}/{b} {a}/{b}/{c} | wc -l"), "int",
        check=f"[ \"$(cat {a}/{b}/{c}/key.txt)\" = {secret} ]",
        solution=[f"mkdir -p {a}/{b}/{c} && echo {secret} > {a}/{b}/{c}/key.txt", f"find {a} -type d | wc -l"])


@task("tar_count", "archives", "train", "number of files in a .tar.gz (tar -t)")
def tar_count(ws, rng):
    for i in range(rng.randint(3, 15)):
        ws.write(f"pkg/{rng.choice(['src', 'doc', 'bin'])}/{token(rng, 5)}.txt", token(rng, 20))
    ws.run("tar -czf bundle.tar.gz pkg && rm -rf pkg")
    cmd = "tar -tzf bundle.tar.gz | grep -v '/$' | wc -l"
    return TaskInstance("How many regular files (not directories) does the archive bundle.tar.gz contain? "
                        "Answer with the number.", ws.run(cmd), "int", solution=[cmd])


@task("tar_extract_read", "archives", "train", "extract an archive and read a file inside")
def tar_extract_read(ws, rng):
    secret = token(rng, 16)
    name = rng.choice(WORDS)
    ws.write(f"vault/{name}/secret.txt", secret + "\n")
    for _ in range(3):
        ws.write(f"vault/{rng.choice(WORDS)}/noise.txt", token(rng, 16) + "\n")
    ws.run("tar -czf vault.tar.gz vault && rm -rf vault")
    return TaskInstance("Extract vault.tar.gz and answer with the content of the file secret.txt inside it.",
                        ws.run(f"tar -xzOf vault.tar.gz vault/{name}/secret.txt"), "text",
                        solution=["tar -xzf vault.tar.gz", "cat $(find vault -name secret.txt)"])


@task("json_field", "json", "train", "a nested field of a JSON file (python3 -c)")
def json_field(ws, rng):
    port, host = rng.randint(1024, 65535), f"{rng.choice(WORDS)}.internal"
    cfg = {"service": {"name": rng.choice(WORDS), "net": {"host": host, "port": port}},
           "debug": rng.random() < 0.5, "workers": rng.randint(1, 16)}
    ws.write("config.json", json.dumps(cfg, indent=2))
    cmd = "python3 -c 'import json; print(json.load(open(\"config.json\"))[\"service\"][\"net\"][\"port\"])'"
    return TaskInstance("What is the value of service.net.port in config.json? Answer with the number.",
                        ws.run(cmd), "int", solution=[cmd])


@task("make_executable", "permissions", "train", "chmod +x a script and run it")
def make_executable(ws, rng):
    word = token(rng, 10)
    ws.write("hello.sh", f"#!/bin/sh\necho {word}\n", mode=0o644)
    return TaskInstance("Make hello.sh executable, run it as ./hello.sh and answer with what it prints.",
                        ws.run("sh hello.sh"), "text", check="[ -x hello.sh ]",
                        solution=["chmod +x hello.sh", "./hello.sh"])


@task("octal_mode", "permissions", "train", "octal permission bits of a file (stat)")
def octal_mode(ws, rng):
    mode = rng.choice([0o600, 0o640, 0o644, 0o700, 0o750, 0o755, 0o444, 0o664])
    ws.write("report.txt", "data\n", mode=mode)
    cmd = "stat -c %a report.txt"
    return TaskInstance("What are the permission bits of report.txt in octal (like 644)? Answer with them.",
                        ws.run(cmd), "text", solution=[cmd])


@task("exit_status", "process", "train", "exit status of a script")
def exit_status(ws, rng):
    code = rng.randint(2, 120)
    ws.write("probe.sh", f"#!/bin/sh\necho probing\nexit {code}\n", mode=0o755)
    return TaskInstance("Run ./probe.sh and answer with its exit status (a number).",
                        ws.run("./probe.sh >/dev/null; echo $?"), "int", solution=["./probe.sh >/dev/null; echo $?"])


@task("env_script", "process", "train", "run a script with an environment variable set")
def env_script(ws, rng):
    val = token(rng, 8)
    ws.write("greet.sh", '#!/bin/sh\n[ -n "$GREETING" ] || { echo "GREETING is not set" >&2; exit 1; }\n'
             'echo "$GREETING" | rev\n', mode=0o755)
    return TaskInstance(f"Run ./greet.sh with the environment variable GREETING set to {val} and answer with "
                        "what it prints.", ws.run(f"GREETING={val} ./greet.sh"), "text",
                        solution=[f"GREETING={val} ./greet.sh"])


@task("sum_args_script", "scripts", "train", "write a script that adds its two arguments")
def sum_args_script(ws, rng):
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    x, y = rng.randint(1000, 9999), rng.randint(1000, 9999)
    return TaskInstance(
        f"Write an executable shell script add.sh that prints the sum of its two integer arguments. "
        f"Then answer with the output of `./add.sh {a} {b}`.",
        ws.run(f"echo $(({a} + {b}))"), "int",
        check=f"[ \"$(./add.sh {x} {y})\" = {x + y} ]",
        solution=["printf '#!/bin/sh\\necho $(($1 + $2))\\n' > add.sh && chmod +x add.sh", f"./add.sh {a} {b}"])


# ---- held-out tasks: training never sees these ----------------------------------------------------

@task("grep_count_lines", "text", "heldout", "lines matching a pattern (grep -c)")
def grep_count_lines(ws, rng):
    levels = [rng.choice(["INFO", "WARN", "ERROR", "DEBUG"]) for _ in range(rng.randint(20, 60))]
    ws.write("app.log", "".join(f"2024-01-{i % 28 + 1:02d} {lv} {token(rng, 6)}\n" for i, lv in enumerate(levels)))
    lv = rng.choice(["WARN", "ERROR"])
    cmd = f"grep -c ' {lv} ' app.log"
    return TaskInstance(f"How many lines of app.log have the level {lv}? Answer with the number.",
                        ws.run(cmd), "int", solution=[cmd])


@task("nth_line", "text", "heldout", "the N-th line of a file (sed -n)")
def nth_line(ws, rng):
    ws.write("list.txt", "".join(f"{token(rng, 8)}\n" for _ in range(rng.randint(20, 40))))
    n = rng.randint(3, 19)
    cmd = f"sed -n '{n}p' list.txt"
    return TaskInstance(f"What is line number {n} of list.txt? Answer with that line.", ws.run(cmd), "text",
                        solution=[cmd])


@task("reverse_sort_first", "text", "heldout", "first line after a reverse sort")
def reverse_sort_first(ws, rng):
    ws.write("words.txt", "\n".join(lines_of_words(rng, 15, vocab=12)) + "\n")
    cmd = "sort -r words.txt | head -1"
    return TaskInstance("Sort words.txt in reverse alphabetical order and answer with the first line.",
                        ws.run(cmd), "text", solution=[cmd])


@task("uppercase_file", "text", "heldout", "upper-case a file into another (tr)")
def uppercase_file(ws, rng):
    ws.write("quiet.txt", " ".join(lines_of_words(rng, 12)) + "\n")
    want = ws.run("tr a-z A-Z < quiet.txt | sha256sum | cut -d' ' -f1")
    return TaskInstance("Write an upper-case copy of quiet.txt to loud.txt, then answer with the first word "
                        "of loud.txt.", ws.run("tr a-z A-Z < quiet.txt | awk '{print $1}'"), "text",
                        check=f"[ \"$(sha256sum < loud.txt | cut -d' ' -f1)\" = {want} ]",
                        solution=["tr a-z A-Z < quiet.txt > loud.txt", "awk '{print $1}' loud.txt"])


@task("column_max", "text", "heldout", "maximum of a whitespace column (awk/sort -n)")
def column_max(ws, rng):
    ws.write("temps.txt", "".join(f"{rng.choice(WORDS)} {rng.randint(-30, 45)}\n" for _ in range(rng.randint(10, 30))))
    cmd = "awk '{print $2}' temps.txt | sort -n | tail -1"
    return TaskInstance("temps.txt has lines 'city temperature'. What is the highest temperature? Answer with "
                        "the number.", ws.run(cmd), "int", solution=[cmd])


@task("dedupe_file", "text", "heldout", "remove duplicate lines keeping first occurrences")
def dedupe_file(ws, rng):
    ws.write("dups.txt", "\n".join(lines_of_words(rng, 30, vocab=10)) + "\n")
    want = ws.run("awk '!seen[$0]++' dups.txt | sha256sum | cut -d' ' -f1")
    return TaskInstance("Write the lines of dups.txt to uniq.txt with duplicates removed, keeping the first "
                        "occurrence of each line in its original order. Answer with the number of lines in "
                        "uniq.txt.", ws.run("awk '!seen[$0]++' dups.txt | wc -l"), "int",
                        check=f"[ \"$(sha256sum < uniq.txt | cut -d' ' -f1)\" = {want} ]",
                        solution=["awk '!seen[$0]++' dups.txt > uniq.txt", "wc -l < uniq.txt"])


@task("count_dirs", "files", "heldout", "number of directories in a tree")
def count_dirs(ws, rng):
    for _ in range(rng.randint(5, 15)):
        ws.write("proj/" + "/".join(rng.sample(WORDS[:8], rng.randint(1, 3))) + "/f.txt", "x\n")
    cmd = "find proj -mindepth 1 -type d | wc -l"
    return TaskInstance("How many directories are there under proj/ (not counting proj itself)? Answer with "
                        "the number.", ws.run(cmd), "int", solution=[cmd])


@task("file_with_token", "files", "heldout", "which file contains a token (grep -l)")
def file_with_token(ws, rng):
    secret = token(rng, 12)
    names = rng.sample(WORDS, 8)
    holder = rng.choice(names)
    for n in names:
        body = "\n".join(token(rng, 12) for _ in range(20))
        if n == holder:
            body += f"\n{secret}"
        ws.write(f"docs/{n}.txt", body + "\n")
    cmd = f"grep -l {secret} docs/*.txt | xargs -n1 basename"
    return TaskInstance(f"Which file in docs/ contains the string {secret}? Answer with its file name only "
                        "(like name.txt).", ws.run(cmd), "text", solution=[cmd])


@task("total_bytes", "files", "heldout", "total size in bytes of the files in a directory")
def total_bytes(ws, rng):
    for _ in range(rng.randint(3, 8)):
        ws.write(f"blobs/{token(rng, 5)}.dat", bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 3000))))
    cmd = "cat blobs/* | wc -c"
    return TaskInstance("What is the total size in bytes of all files in blobs/ added together? Answer with the "
                        "number.", ws.run(cmd), "int", solution=[cmd])


@task("copy_rename", "files", "heldout", "copy files matching a pattern into a new directory")
def copy_rename(ws, rng):
    n_csv = 0
    for i in range(rng.randint(6, 14)):
        ext = "csv" if i == 0 else rng.choice(["csv", "txt"])
        n_csv += ext == "csv"
        ws.write(f"inbox/{token(rng, 6)}.{ext}", "a,b\n")
    want = ws.run("ls inbox/*.csv 2>/dev/null | xargs -n1 basename | sort | tr '\\n' ' '")
    return TaskInstance("Create a directory archive/ and copy every .csv file from inbox/ into it (keep inbox/ "
                        "unchanged). Answer with the number of files in archive/.",
                        ws.run("ls inbox/*.csv 2>/dev/null | wc -l"), "int",
                        check=f"[ \"$(ls archive | sort | tr '\\n' ' ')\" = {q(want)} ] && "
                              f"[ $(ls inbox/*.csv | wc -l) -eq {n_csv} ]",
                        solution=["mkdir -p archive && cp inbox/*.csv archive/", "ls archive | wc -l"])


@task("make_tarball", "archives", "heldout", "create a .tar.gz of a directory")
def make_tarball(ws, rng):
    for _ in range(rng.randint(2, 6)):
        ws.write(f"site/{token(rng, 5)}.html", f"<p>{token(rng, 10)}</p>\n")
    return TaskInstance("Create a gzip-compressed tar archive backup.tar.gz containing the directory site/ (paths "
                        "inside should start with site/). Answer with the number of .html files it contains.",
                        ws.run("ls site/*.html | wc -l"), "int",
                        check="[ \"$(tar -tzf backup.tar.gz | grep '\\.html$' | sort)\" = "
                              "\"$(find site -name '*.html' | sort)\" ]",
                        solution=["tar -czf backup.tar.gz site", "tar -tzf backup.tar.gz | grep -c '\\.html$'"])


@task("gunzip_count", "archives", "heldout", "decompress a .gz file and count its lines")
def gunzip_count(ws, rng):
    ws.write("events.txt", "".join(f"{token(rng, 8)}\n" for _ in range(rng.randint(40, 200))))
    ws.run("gzip events.txt")
    cmd = "gunzip -c events.txt.gz | wc -l"
    return TaskInstance("How many lines does the compressed file events.txt.gz contain once decompressed? "
                        "Answer with the number.", ws.run(cmd), "int", solution=[cmd])


@task("json_count", "json", "heldout", "number of items in a JSON list matching a condition")
def json_count(ws, rng):
    users = [{"name": token(rng, 6), "active": rng.random() < 0.5, "age": rng.randint(18, 80)}
             for _ in range(rng.randint(8, 30))]
    ws.write("users.json", json.dumps({"users": users}))
    cmd = ("python3 -c 'import json; print(sum(u[\"active\"] for u in json.load(open(\"users.json\"))"
           "[\"users\"]))'")
    return TaskInstance("users.json has a list under the key \"users\"; how many users have \"active\": true? "
                        "Answer with the number.", ws.run(cmd), "int", solution=[cmd])


@task("json_sum", "json", "heldout", "sum of a numeric field across JSON records")
def json_sum(ws, rng):
    items = [{"sku": token(rng, 4), "stock": rng.randint(0, 300)} for _ in range(rng.randint(5, 20))]
    ws.write("inventory.json", json.dumps(items, indent=1))
    cmd = "python3 -c 'import json; print(sum(i[\"stock\"] for i in json.load(open(\"inventory.json\"))))'"
    return TaskInstance("inventory.json is a list of records with a \"stock\" field. What is the total stock? "
                        "Answer with the number.", ws.run(cmd), "int", solution=[cmd])


@task("json_write", "json", "heldout", "write a JSON file with given keys")
def json_write(ws, rng):
    name, n = rng.choice(WORDS), rng.randint(1, 999)
    # -I: a json.py the policy left in the workspace must not be imported by the check
    check = (f"python3 -I -c 'import json,sys; d=json.load(open(\"out.json\")); "
             f"sys.exit(0 if d == {{\"name\": \"{name}\", \"count\": {n}}} else 1)'")
    return TaskInstance(f"Create out.json holding a JSON object with exactly two keys: \"name\" set to the string "
                        f"\"{name}\" and \"count\" set to the number {n}. Answer with the value of count.",
                        ws.run(f"echo {n}"), "int", check=check,
                        solution=[f"echo '{{\"name\": \"{name}\", \"count\": {n}}}' > out.json",
                                  "python3 -c 'import json; print(json.load(open(\"out.json\"))[\"count\"])'"])


@task("set_mode", "permissions", "heldout", "set a file's permission bits (chmod)")
def set_mode(ws, rng):
    mode = rng.choice(["640", "600", "750", "444", "711"])
    ws.write("secret.key", token(rng, 32), mode=0o666)
    return TaskInstance(f"Set the permissions of secret.key to {mode} (octal), then answer with the output of "
                        "`stat -c %A secret.key`.", ws.run(f"f=$(mktemp) && chmod {mode} $f && stat -c %A $f; rm -f $f"),
                        "text", check=f"[ $(stat -c %a secret.key) = {mode} ]",
                        solution=[f"chmod {mode} secret.key", "stat -c %A secret.key"])


@task("count_executables", "permissions", "heldout", "number of executable files in a directory")
def count_executables(ws, rng):
    for _ in range(rng.randint(4, 12)):
        ws.write(f"bin/{token(rng, 5)}", "#!/bin/sh\n", mode=rng.choice([0o755, 0o644, 0o700, 0o600]))
    cmd = "find bin -type f -perm -u+x | wc -l"
    return TaskInstance("How many files in bin/ have the owner-execute permission bit set? Answer with the "
                        "number.", ws.run(cmd), "int", solution=[cmd])


@task("script_stdout_lines", "process", "heldout", "run a script, count lines on stdout only")
def script_stdout_lines(ws, rng):
    n_out, n_err = rng.randint(3, 12), rng.randint(2, 9)
    body = "".join(rng.sample([f"echo out{i}\n" for i in range(n_out)] +
                              [f"echo err{i} >&2\n" for i in range(n_err)], n_out + n_err))
    ws.write("noisy.sh", "#!/bin/sh\n" + body, mode=0o755)
    cmd = "./noisy.sh 2>/dev/null | wc -l"
    return TaskInstance("Run ./noisy.sh. How many lines does it print to standard output (ignore standard error)? "
                        "Answer with the number.", ws.run(cmd), "int", solution=[cmd])


@task("env_default", "process", "heldout", "value a script derives from an environment variable")
def env_default(ws, rng):
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    ws.write("calc.sh", '#!/bin/sh\necho $(( ${FACTOR:-1} * ' + str(a) + ' ))\n', mode=0o755)
    return TaskInstance(f"Run ./calc.sh with the environment variable FACTOR set to {b}, and answer with what it "
                        "prints.", ws.run(f"FACTOR={b} ./calc.sh"), "int", solution=[f"FACTOR={b} ./calc.sh"])


@task("loop_sum", "scripts", "heldout", "sum of multiples computed with a shell loop")
def loop_sum(ws, rng):
    n, k = rng.randint(50, 400), rng.randint(3, 9)
    return TaskInstance(f"Compute the sum of all integers from 1 to {n} that are divisible by {k}. Answer with "
                        "the number.", ws.run(f"seq {k} {k} {n} | awk '{{s+=$1}} END {{print s}}'"), "int",
                        solution=[f"s=0; for i in $(seq 1 {n}); do [ $((i % {k})) -eq 0 ] && s=$((s+i)); done; echo $s"])


@task("md5_file", "hashing", "heldout", "MD5 of a file")
def md5_file(ws, rng):
    ws.write("payload.bin", bytes(rng.getrandbits(8) for _ in range(rng.randint(50, 500))))
    cmd = "md5sum payload.bin | cut -d' ' -f1"
    return TaskInstance("What is the MD5 hex digest of payload.bin? Answer with the 32-character hex digest.",
                        ws.run(cmd), "hex", solution=[cmd])


@task("base64_decode", "hashing", "heldout", "decode a base64 string")
def base64_decode(ws, rng):
    s = f"{rng.choice(WORDS)}:{token(rng, 10)}"
    enc = ws.run(f"printf %s {q(s)} | base64")
    cmd = f"echo {q(enc)} | base64 -d"
    return TaskInstance(f"Decode the base64 string {enc} and answer with the decoded text.", ws.run(cmd), "text",
                        solution=[cmd])


@task("word_count_total", "text", "heldout", "total number of words over several files (wc -w)")
def word_count_total(ws, rng):
    for _ in range(rng.randint(2, 5)):
        ws.write(f"chapters/{token(rng, 4)}.txt", " ".join(lines_of_words(rng, rng.randint(5, 40))) + "\n")
    cmd = "cat chapters/*.txt | wc -w"
    return TaskInstance("How many words are there in all the .txt files in chapters/ together? Answer with the "
                        "number.", ws.run(cmd), "int", solution=[cmd])
