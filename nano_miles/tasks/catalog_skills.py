"""A broader, opt-in training set: more train templates, each exercising another general shell skill.

On the 40 built-in training templates the policy reaches 0.6-0.7 accuracy while held-out pass@1 stays near
0.25: it fits the templates instead of learning skills that transfer. These widen training (cut, paste, sort -t,
uniq -d, sed ranges, awk conditions, find -newer/-empty/-xtype, du, split, tar subsets, gzip -t, JSON edits,
umask, && / ||, stderr, retries, here-documents, scripts with arguments, od, dates...); a third of them ask for a
change to the workspace (held to account by a check), then a value. None repeats or nearly copies a held-out
template. Not imported by default: `--tasks-module nano_miles.tasks.catalog_skills` (tasks, rollout, eval) or
`--set tasks_module=nano_miles.tasks.catalog_skills` (train). Catalog rules: parameters from rng, truth from ws.run.
"""
from __future__ import annotations

import datetime
import json
import random

from nano_miles.tasks.api import TaskInstance, Workspace, q, task
from nano_miles.tasks.catalog import WORDS, lines_of_words, token
from nano_miles.tasks.catalog_train import distinct_tokens

SHA = "sha256sum | cut -d' ' -f1"


# ---- text -----------------------------------------------------------------------------------------

@task("passwd_home", "text", "train", "a field of the passwd line with a given uid (awk -F:)")
def passwd_home(ws: Workspace, rng: random.Random) -> TaskInstance:
    names, uids = rng.sample(WORDS, rng.randint(5, 12)), rng.sample(range(1000, 3000), 12)
    ws.write("accounts.txt", "".join(
        f"{n}:x:{u}:{rng.choice(uids)}:{n.title()}:{rng.choice(['/home', '/srv', '/var/lib'])}/{n}:"
        f"{rng.choice(['/bin/bash', '/bin/sh', '/usr/sbin/nologin'])}\n" for n, u in zip(names, uids)))
    uid = uids[rng.randrange(len(names))]
    return TaskInstance("accounts.txt is in /etc/passwd format (name:password:uid:gid:gecos:home:shell). What is "
                        f"the home directory of the account whose uid is {uid}? Answer with the path.",
                        ws.run(f"awk -F: '$3 == {uid} {{print $6}}' accounts.txt"), "text",
                        solution=[f"grep -E '^[^:]*:[^:]*:{uid}:' accounts.txt | cut -d: -f6"])


@task("repeated_lines", "text", "train", "number of different lines that occur more than once (uniq -d)")
def repeated_lines(ws, rng):
    ws.write("tags.txt", "\n".join(lines_of_words(rng, rng.randint(12, 40), vocab=rng.randint(8, 20))) + "\n")
    cmd = "sort tags.txt | uniq -d | wc -l"
    return TaskInstance("How many different lines of tags.txt occur more than once in the file? Answer with the "
                        "number.", ws.run(cmd), "int", solution=[cmd])


@task("extract_range", "text", "train", "save a range of lines to a file (sed -n 'a,bp'), count its words")
def extract_range(ws, rng):
    ws.write("book.txt", "".join(" ".join(lines_of_words(rng, rng.randint(1, 9), 12)) + "\n"
                                 for _ in range(rng.randint(30, 60))))
    a = rng.randint(2, 20)
    b = a + rng.randint(3, 9)
    return TaskInstance(f"Write lines {a} to {b} of book.txt (both included) to a new file excerpt.txt. Then answer "
                        "with the number of words in excerpt.txt.", ws.run(f"sed -n '{a},{b}p' book.txt | wc -w"),
                        "int", check=f"sed -n '{a},{b}p' book.txt | cmp -s - excerpt.txt",
                        solution=[f"head -n {b} book.txt | tail -n +{a} > excerpt.txt", "wc -w < excerpt.txt"])


@task("strip_comments", "text", "train", "delete comment and empty lines in place (sed -i '/re/d')")
def strip_comments(ws, rng):
    kinds = ["#", "", "kv", "kv"] + [rng.choice(["#", "", "kv", "kv", "url"]) for _ in range(rng.randint(6, 20))]
    rng.shuffle(kinds)
    ws.write("settings.conf", "".join(
        {"#": f"# {' '.join(lines_of_words(rng, 3))}\n", "": "\n", "kv": f"{rng.choice(WORDS)}={token(rng, 5)}\n",
         "url": f"link=http://{rng.choice(WORDS)}.org/#{token(rng, 4)}\n"}[k] for k in kinds))
    want = ws.run(f"grep -v '^#' settings.conf | grep -v '^$' | {SHA}")
    return TaskInstance("Edit settings.conf in place: delete every comment line (a line that starts with #) and "
                        "every empty line, keeping all the other lines in order. Then answer with the number of "
                        "lines left in settings.conf.", ws.run("grep -v '^#' settings.conf | grep -vc '^$'"), "int",
                        check=f"[ \"$(cat settings.conf | {SHA})\" = {want} ]",
                        solution=["sed -i '/^#/d; /^$/d' settings.conf", "wc -l < settings.conf"])


@task("group_mean", "text", "train", "average of a column over the rows matching a condition (awk)")
def group_mean(ws, rng):
    teams = rng.sample(WORDS, 3)
    rows = [[token(rng, 6), rng.choice(teams), rng.randint(10, 99)] for _ in range(rng.randint(8, 25))]
    team = rows[0][1]
    mine = [r for r in rows if r[1] == team]
    mine[-1][2] -= sum(r[2] for r in mine) % len(mine)  # a whole-number mean: no rounding question
    ws.write("scores.txt", "".join(f"{n} {t} {s}\n" for n, t, s in rows))
    return TaskInstance(f"scores.txt has lines 'player team score'. What is the average score of the players of "
                        f"team {team}? (It is a whole number.) Answer with the number.",
                        ws.run(f"awk '$2 == \"{team}\" {{s += $3; n++}} END {{print s / n}}' scores.txt"), "int",
                        solution=[f"grep -w {team} scores.txt | awk '{{s += $3}} END {{print s / NR}}'"])


@task("distinct_ips", "text", "train", "distinct IPv4 addresses in a log (grep -oE | sort -u)")
def distinct_ips(ws, rng):
    ips = [".".join(str(rng.randint(1, 254)) for _ in range(4)) for _ in range(rng.randint(2, 9))]
    ws.write("server.log", "".join(
        f"[{rng.randint(0, 86399)}] client={rng.choice(ips)} {rng.choice(['GET', 'POST'])} /{rng.choice(WORDS)} "
        f"build {rng.randint(1, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 99)}\n" for _ in range(rng.randint(10, 40))))
    cmd = "grep -oE '[0-9]+(\\.[0-9]+){3}' server.log | sort -u | wc -l"
    return TaskInstance("How many different IPv4 addresses appear in server.log? Answer with the number.",
                        ws.run(cmd), "int", solution=[cmd])


@task("paste_oldest", "text", "train", "pair two files line by line (paste) and pick the maximum")
def paste_oldest(ws, rng):
    names = rng.sample(WORDS, rng.randint(5, 15))
    ws.write("names.txt", "\n".join(names) + "\n")
    ws.write("ages.txt", "\n".join(map(str, rng.sample(range(18, 99), len(names)))) + "\n")
    want = "awk 'NR == FNR {n[FNR] = $0; next} {print $1, n[FNR]}' names.txt ages.txt | sort -n | tail -1"
    return TaskInstance("Line i of ages.txt is the age of the person named on line i of names.txt. Who is the "
                        "oldest? Answer with the name.", ws.run(f"{want} | cut -d' ' -f2"), "text",
                        solution=["paste ages.txt names.txt | sort -n | tail -1 | cut -f2"])


@task("nth_cheapest", "text", "train", "sort a ';'-separated file on a numeric field (sort -t -k)")
def nth_cheapest(ws, rng):
    n, k = rng.randint(6, 15), rng.randint(2, 4)
    ws.write("parts.txt", "".join(f"P{s};{rng.choice(WORDS)};{p}\n"
                                  for s, p in zip(rng.sample(range(1000, 9999), n), rng.sample(range(5, 5000), n))))
    cmd = f"sort -t';' -k3,3n parts.txt | sed -n '{k}p' | cut -d';' -f1"
    return TaskInstance(f"parts.txt has lines 'sku;name;price'. Which part has the {['2nd', '3rd', '4th'][k - 2]} "
                        "lowest price? Answer with its sku.", ws.run(cmd), "text", solution=[cmd])


# ---- files ----------------------------------------------------------------------------------------

@task("delete_empty_files", "files", "train", "delete the empty files of a tree, keep its directories")
def delete_empty_files(ws, rng):
    for i, n in enumerate(distinct_tokens(rng, rng.randint(5, 14))):
        ws.write(f"cache/{rng.choice(['img', 'css', 'js/lib'])}/{n}.tmp", "" if i % 3 == 0 else token(rng, 30))
    keep = ws.run("find cache -type d -o ! -empty | sort")  # everything but the empty files
    return TaskInstance("Delete every empty file under cache/ (in all its subdirectories), keeping the directories "
                        "and the other files. Then answer with the number of files left under cache/.",
                        ws.run("find cache -type f ! -empty | wc -l"), "int",
                        check=f"[ \"$(find cache | sort)\" = {q(keep)} ]",
                        solution=["find cache -type f -empty -delete", "find cache -type f | wc -l"])


@task("newer_than_marker", "files", "train", "files modified after a reference file (find -newer)")
def newer_than_marker(ws, rng):
    paths = [f"src/{n}.c" for n in distinct_tokens(rng, rng.randint(5, 12))] + ["last_build"]
    base = rng.randint(1_000_000_000, 1_600_000_000)
    for p, day in zip(paths, rng.sample(range(500), len(paths))):  # whole days apart: no ties, no zones
        ws.write(p, f"{token(rng, 10)}\n")
        ws.run(f"touch -d @{base + day * 86400} {p}")
    cmd = "find src -type f -newer last_build | wc -l"
    return TaskInstance("How many files in src/ were modified more recently than the file last_build? Answer with "
                        "the number.", ws.run(cmd), "int", solution=[cmd])


@task("heaviest_subdir", "files", "train", "the subdirectory whose files add up to the most bytes (du)")
def heaviest_subdir(ws, rng):
    for d, total in zip(rng.sample(WORDS, rng.randint(3, 6)), rng.sample(range(2, 40), 6)):  # >= 1000 bytes apart
        parts = rng.randint(1, 4)
        for _ in range(parts):
            ws.write(f"data/{d}/{token(rng, 6)}.bin", "z" * (total * 1000 // parts + rng.randint(0, 99)))
    want = "find data -type f -printf '%s %h\\n' | awk '{s[$2] += $1} END {for (d in s) print s[d], d}' | sort -n"
    return TaskInstance("Which subdirectory of data/ holds the most data (the sizes of its files added up)? Answer "
                        "with the directory's name only.", ws.run(f"{want} | tail -1 | cut -d/ -f2"), "text",
                        solution=["du -sb data/* | sort -n | tail -1 | cut -d/ -f2"])


@task("broken_symlink", "files", "train", "the one symbolic link whose target is missing")
def broken_symlink(ws, rng):
    names = distinct_tokens(rng, rng.randint(4, 9))
    bad = rng.choice(names)
    for n in names:
        ws.write(f"targets/{n}.conf", "k=v\n")
        ws.run(f"mkdir -p links && ln -s ../targets/{n}.conf{'.old' if n == bad else ''} links/{n}")
    return TaskInstance("Exactly one symbolic link in links/ is broken (what it points to does not exist). Which "
                        "one? Answer with the link's name only.", ws.run("find links -xtype l -printf '%f\\n'"),
                        "text", solution=['for f in links/*; do [ -e "$f" ] || basename "$f"; done'])


@task("split_pieces", "files", "train", "split a file into pieces of N lines (split -l)")
def split_pieces(ws, rng):
    ws.write("big.txt", "".join(f"{token(rng, 12)}\n" for _ in range(rng.randint(50, 300))))
    n = rng.randint(10, 40)
    pieces = ws.run(f"d=$(mktemp -d) && split -l {n} big.txt $d/part_ && ls $d | wc -l && rm -rf $d")
    return TaskInstance(f"Split big.txt into pieces of {n} lines each (the last one may be shorter), named part_aa, "
                        "part_ab, part_ac, ... in the current directory; keep big.txt. Then answer with the number "
                        "of pieces.", pieces, "int",
                        check=f"[ \"$(cat part_* | {SHA})\" = \"$(cat big.txt | {SHA})\" ] && "
                              f"[ $(ls part_* | wc -l) -eq {pieces} ] && [ $(wc -l < part_aa) -eq {n} ]",
                        solution=[f"split -l {n} big.txt part_", "ls part_* | wc -l"])


# ---- archives -------------------------------------------------------------------------------------

@task("tar_extract_one", "archives", "train", "extract a single member of an archive (tar -x MEMBER)")
def tar_extract_one(ws, rng):
    members = [f"pkg/{rng.choice(['src', 'doc', 'etc'])}/{n}.txt" for n in distinct_tokens(rng, rng.randint(4, 10))]
    for m in members:
        ws.write(m, "".join(f"{token(rng, 9)}\n" for _ in range(rng.randint(3, 40))))
    ws.run("tar -czf bundle.tar.gz pkg && rm -rf pkg")
    m = rng.choice(members)
    return TaskInstance(f"Extract only the member {m} from bundle.tar.gz (do not extract the other members). Then "
                        "answer with the number of lines of the extracted file.",
                        ws.run(f"tar -xzOf bundle.tar.gz {m} | wc -l"), "int",
                        check=f"[ \"$(find pkg -type f)\" = {m} ] && tar -xzOf bundle.tar.gz {m} | cmp -s - {m}",
                        solution=[f"tar -xzf bundle.tar.gz {m}", f"wc -l < {m}"])


@task("tar_append", "archives", "train", "add a file to an existing archive (tar -r)")
def tar_append(ws, rng):
    *names, extra = [f"{n}.md" for n in distinct_tokens(rng, rng.randint(3, 8))]
    for n in names + [extra]:
        ws.write(n, f"{token(rng, 20)}\n")
    ws.run(f"tar -cf pack.tar {' '.join(names)} && rm {' '.join(names)}")
    listing = f"{{ tar -tf pack.tar; echo {extra}; }}"
    return TaskInstance(f"Add the file {extra} to the existing archive pack.tar, keeping the members it already has. "
                        "Then answer with the number of members pack.tar lists.", ws.run(f"{listing} | wc -l"), "int",
                        check=f"[ \"$(tar -tf pack.tar | sort)\" = {q(ws.run(f'{listing} | sort'))} ] && "
                              f"tar -xOf pack.tar {extra} | cmp -s - {extra}",
                        solution=[f"tar -rf pack.tar {extra}", "tar -tf pack.tar | wc -l"])


@task("tar_member_size", "archives", "train", "size of one member of a .tar.gz (tar -tv)")
def tar_member_size(ws, rng):
    names = distinct_tokens(rng, rng.randint(3, 8))
    for n in names:
        ws.write(f"site/{n}.html", "<p>" + "x" * rng.randint(10, 9000) + "</p>\n")
    ws.run("tar -czf site.tar.gz site && rm -rf site")
    m = f"site/{rng.choice(names)}.html"
    return TaskInstance(f"What is the size in bytes of the member {m} of the archive site.tar.gz? Answer with the "
                        "number.", ws.run(f"tar -xzOf site.tar.gz {m} | wc -c"), "int",
                        solution=[f"tar -tvzf site.tar.gz | awk '$6 == \"{m}\" {{print $3}}'"])


@task("gzip_damaged", "archives", "train", "the damaged .gz file of a directory (gzip -t)")
def gzip_damaged(ws, rng):
    names = distinct_tokens(rng, rng.randint(4, 8))
    for n in names:
        ws.write(f"dumps/{n}.sql", "".join(f"INSERT {token(rng, 30)};\n" for _ in range(rng.randint(40, 120))))
    bad = f"dumps/{rng.choice(names)}.sql.gz"
    ws.run(f"gzip dumps/*.sql && head -c $(( $(stat -c %s {bad}) / 2 )) {bad} > cut && mv cut {bad}")
    return TaskInstance("Exactly one .gz file in dumps/ is damaged (gzip cannot decompress it completely). Which one? "
                        "Answer with its file name only (like name.sql.gz).",
                        ws.run("for f in dumps/*.gz; do gunzip -c \"$f\" >/dev/null 2>&1 || basename \"$f\"; done"),
                        "text", solution=['for f in dumps/*.gz; do gzip -t "$f" 2>/dev/null || basename "$f"; done'])


# ---- json -----------------------------------------------------------------------------------------

@task("json_top_value", "json", "train", "the JSON record with the largest price times stock (python3 -c)")
def json_top_value(ws, rng):
    names = rng.sample(WORDS, rng.randint(4, 12))
    items: list[dict] = []
    while len({i["price"] * i["stock"] for i in items}) < len(names):  # no two values alike: no tie
        items = [{"name": n, "price": rng.randint(1, 200), "stock": rng.randint(1, 50)} for n in names]
    ws.write("products.json", json.dumps(items, indent=2))
    cmd = ("python3 -c 'import json; print(max(json.load(open(\"products.json\")), "
           "key=lambda p: p[\"price\"] * p[\"stock\"])[\"name\"])'")
    return TaskInstance("products.json is a list of products with a price and a stock. Which product has the largest "
                        "stock value (price times stock)? Answer with its name.", ws.run(cmd), "text", solution=[cmd])


@task("json_bump", "json", "train", "change one nested value of a JSON file in place")
def json_bump(ws, rng):
    cfg = {"app": {"name": rng.choice(WORDS), "retries": rng.randint(0, 9), "timeout": rng.randint(5, 120)},
           "debug": rng.random() < 0.5, "tags": rng.sample(WORDS, 3)}
    ws.write("settings.json", json.dumps(cfg, indent=rng.choice([2, 4])))
    k = rng.randint(2, 9)
    bump = f"import json; d = json.load(open(\"settings.json\")); d[\"app\"][\"retries\"] += {k}"
    want = ws.run(f"python3 -c '{bump}; print(json.dumps(d))'")
    return TaskInstance(f"In settings.json, increase the value of app.retries by {k}, leaving everything else as it "
                        "is (the file must stay valid JSON). Then answer with the new value of app.retries.",
                        ws.run(f"python3 -c '{bump}; print(d[\"app\"][\"retries\"])'"), "int",
                        check="python3 -I -c 'import json, sys; sys.exit(json.load(open(\"settings.json\")) != "
                              f"json.loads(sys.argv[1]))' {q(want)}",
                        solution=[f"python3 -c '{bump}; json.dump(d, open(\"settings.json\", \"w\")); "
                                  "print(d[\"app\"][\"retries\"])'"])


@task("jsonl_ids", "json", "train", "filter a JSON-lines file into a file of ids")
def jsonl_ids(ws, rng):
    types = rng.sample(["login", "logout", "upload", "delete", "share"], 3)
    kinds = [types[0]] + [rng.choice(types) for _ in range(rng.randint(6, 25))]
    ws.write("events.jsonl", "".join(json.dumps({"id": f"ev-{token(rng, 6)}", "type": t, "ts": rng.randint(1, 99999)})
                                     + "\n" for t in rng.sample(kinds, len(kinds))))
    pick = ("python3 -c 'import json; [print(e[\"id\"]) for e in map(json.loads, open(\"events.jsonl\")) "
            f"if e[\"type\"] == \"{types[0]}\"]'")
    return TaskInstance(f"events.jsonl holds one JSON object per line. Write the id of every event whose type is "
                        f"{types[0]} to ids.txt, one per line, in the order they appear in events.jsonl. Then answer "
                        "with the number of lines of ids.txt.", ws.run(f"{pick} | wc -l"), "int",
                        check=f"[ \"$(cat ids.txt | {SHA})\" = \"$({pick} | {SHA})\" ]",
                        solution=[f"{pick} > ids.txt", "wc -l < ids.txt"])


# ---- permissions ----------------------------------------------------------------------------------

@task("umask_create", "permissions", "train", "the mode a new file gets under a umask")
def umask_create(ws, rng):
    u = rng.choice(["027", "077", "022", "007", "037", "002", "033", "026"])
    mode = ws.run(f"d=$(mktemp -d) && umask {u} && touch $d/f && stat -c %a $d/f && rm -rf $d")
    return TaskInstance(f"With the umask set to {u}, create a new empty file private.log in the current directory "
                        "(do not chmod it). Then answer with the output of `stat -c %a private.log`.", mode, "text",
                        check=f"[ -f private.log ] && [ ! -s private.log ] && [ $(stat -c %a private.log) = {mode} ]",
                        solution=[f"umask {u} && touch private.log", "stat -c %a private.log"])


@task("find_exact_mode", "permissions", "train", "the file with given symbolic permissions (find -perm MODE)")
def find_exact_mode(ws, rng):
    modes = rng.sample(["600", "640", "644", "660", "664", "700", "750", "755", "444", "400", "711"], rng.randint(4, 8))
    for n, m in zip(distinct_tokens(rng, len(modes)), modes):
        ws.write(f"etc/{n}.conf", "k=v\n", mode=int(m, 8))
    m = rng.choice(modes)
    sym = ws.run(f"find etc -type f -perm {m} -exec stat -c %A {{}} + | cut -c2-")
    return TaskInstance(f"Which file in etc/ has exactly the permissions {sym} (as `ls -l` shows them)? Answer with "
                        "its file name only (like name.conf).", ws.run(f"find etc -type f -perm {m} -printf '%f\\n'"),
                        "text", solution=[f"cd etc && stat -c '%A %n' * | awk '$1 == \"-{sym}\" {{print $2}}'"])


@task("normalize_modes", "permissions", "train", "755 for every directory, 644 for every file (find -exec chmod)")
def normalize_modes(ws, rng):
    for n in distinct_tokens(rng, rng.randint(4, 12)):
        ws.write(f"site/{rng.choice(['', 'css/', 'img/', 'img/icons/', 'js/'])}{n}.x", "data\n",
                 mode=rng.choice([0o600, 0o666, 0o700, 0o755, 0o640, 0o777]))
    ws.run(f"for d in $(find site -mindepth 1 -type d); do chmod {rng.choice(['700', '750', '775', '711'])} $d; done")
    n = ws.run("find site -type f | wc -l")
    return TaskInstance("Set the permissions of every directory under site/ (site/ included) to 755 and of every "
                        "regular file under it to 644. Then answer with the number of regular files under site/.",
                        n, "int", check=f"[ -z \"$(find site ! -perm 755 -type d -o ! -perm 644 -type f)\" ] && "
                                        f"[ $(find site -type f | wc -l) -eq {n} ]",
                        solution=["find site -type d -exec chmod 755 {} + && find site -type f -exec chmod 644 {} +",
                                  "find site -type f | wc -l"])


# ---- process --------------------------------------------------------------------------------------

@task("and_or_chain", "process", "train", "what a && / || command list runs, from the exit statuses")
def and_or_chain(ws, rng):
    for name, w in zip(["check", "build", "fallback"], distinct_tokens(rng, 3, 5)):
        ws.write(f"{name}.sh", f"#!/bin/sh\necho {w}\nexit {rng.choice([0, 0, 1, 2])}\n", mode=0o755)
    cmd = "{ ./check.sh && ./build.sh || ./fallback.sh; } | paste -sd' '"
    return TaskInstance("Run the command list `./check.sh && ./build.sh || ./fallback.sh`. What does it print? "
                        "Answer with the printed words in order, separated by single spaces.", ws.run(cmd), "text",
                        solution=[cmd])


@task("stderr_last_line", "process", "train", "the last line a script writes to standard error (2>&1 >/dev/null)")
def stderr_last_line(ws, rng):
    ws.write("job.sh", "#!/bin/sh\n" + "".join(f"echo warn-{token(rng, 6)} >&2\n" if i == 0 or rng.random() < 0.5 else
                                               f"echo out-{token(rng, 6)}\n" for i in range(rng.randint(4, 12))), 0o755)
    return TaskInstance("Run ./job.sh. What is the last line it writes to standard error? Answer with that line.",
                        ws.run("./job.sh 2>&1 1>/dev/null | tail -n 1"), "text",
                        solution=["./job.sh 2>err.txt >/dev/null; tail -n 1 err.txt"])


@task("count_passing", "process", "train", "run every script of a directory and count those exiting 0")
def count_passing(ws, rng):
    for i, n in enumerate(distinct_tokens(rng, rng.randint(4, 10))):
        ws.write(f"checks/{n}.sh", f"#!/bin/sh\necho {n}\nexit {i % 2 if i < 2 else rng.choice([0, 1, 3])}\n", 0o755)
    cmd = 'n=0; for f in checks/*.sh; do "$f" >/dev/null 2>&1 && n=$((n + 1)); done; echo $n'
    return TaskInstance("Run each of the scripts in checks/. How many of them exit with status 0? Answer with the "
                        "number.", ws.run(cmd), "int",
                        solution=['for f in checks/*.sh; do "$f" >/dev/null 2>&1; echo $?; done | grep -cx 0'])


@task("retry_until_ok", "process", "train", "run a flaky script until it succeeds (until loop)")
def retry_until_ok(ws, rng):
    k, word = rng.randint(3, 9), f"{rng.choice(WORDS)}-{token(rng, 6)}"
    ws.write("flaky.sh", "#!/bin/sh\nn=$(cat .attempts 2>/dev/null || echo 0); n=$((n + 1)); echo $n > .attempts\n"
             f"if [ $n -lt {k} ]; then echo \"attempt $n failed\" >&2; exit 1; fi\necho ready {word}\n", mode=0o755)
    return TaskInstance("./flaky.sh fails the first few times it is run. Run it again and again until it exits with "
                        "status 0, then answer with what it printed on that run.",
                        ws.run("d=$(mktemp -d) && cp flaky.sh $d && cd $d && until ./flaky.sh 2>/dev/null; do :; "
                               "done && rm -rf $d"), "text", solution=["until ./flaky.sh 2>/dev/null; do :; done"])


# ---- scripts --------------------------------------------------------------------------------------

@task("heredoc_config", "scripts", "train", "write a multi-line file exactly (here-document)")
def heredoc_config(ws, rng):
    lines = [f"host={rng.choice(WORDS)}.internal", f"port={rng.randint(1024, 65535)}",
             f"user={token(rng, 6)}"] + [f"{w}={token(rng, 4)}" for w in rng.sample(WORDS, rng.randint(0, 3))]
    body, printed = "\n".join(lines), f"printf '%s\\n' {' '.join(q(x) for x in lines)}"
    return TaskInstance(f"Create the file app.conf containing exactly these {len(lines)} lines (each ending with a "
                        f"newline):\n{body}\nThen answer with the size of app.conf in bytes.",
                        ws.run(f"{printed} | wc -c"), "int", check=f"{printed} | cmp -s - app.conf",
                        solution=[f"cat > app.conf <<'EOF'\n{body}\nEOF", "wc -c < app.conf"])


@task("max_arg_script", "scripts", "train", "write a script that loops over its arguments (max)")
def max_arg_script(ws, rng):
    args = " ".join(str(rng.randint(-500, 999)) for _ in range(rng.randint(3, 7)))
    other = " ".join(str(rng.randint(-999, -1)) for _ in range(3)) + f" {rng.randint(-50, 50)}"
    return TaskInstance("Write an executable bash script max.sh that prints the largest of its integer arguments (any "
                        f"number of them, possibly negative). Then answer with the output of `./max.sh {args}`.",
                        ws.run(f"printf '%s\\n' {args} | sort -n | tail -1"), "int",
                        check=f"[ \"$(./max.sh {other})\" = \"$(printf '%s\\n' {other} | sort -n | tail -1)\" ]",
                        solution=["printf '#!/bin/bash\\nm=$1\\nfor x in \"$@\"; do [ $x -gt $m ] && m=$x; done\\n"
                                  "echo $m\\n' > max.sh && chmod +x max.sh", f"./max.sh {args}"])


@task("substring", "scripts", "train", "characters i..j of a string (${s:off:len} / cut -c)")
def substring(ws, rng):
    s, i = token(rng, rng.randint(18, 30)), rng.randint(2, 10)
    j = i + rng.randint(2, 7)
    return TaskInstance(f"What are the characters at positions {i} to {j} (both included) of the string {s}, the "
                        "first character being position 1? Answer with them.",
                        ws.run(f"printf '%s\\n' {s} | cut -c {i}-{j}"), "text",
                        solution=[f"s={s}; echo \"${{s:{i - 1}:{j - i + 1}}}\""])


@task("count_ext_script", "scripts", "train", "write a script with two arguments: a directory and an extension")
def count_ext_script(ws, rng):
    a, b, _ = exts = rng.sample(["md", "txt", "csv", "log", "cfg"], 3)
    for i, n in enumerate(distinct_tokens(rng, rng.randint(6, 16))):
        ws.write(f"{'misc' if i % 4 == 3 else 'docs'}/{n}.{exts[i] if i < 3 else rng.choice(exts)}", "x\n")
    count = "find {} -name '*.{}' | wc -l"
    check = " && ".join(f"[ \"$(./count.sh {d} {b})\" -eq $({count.format(d, b)}) ]" for d in ["misc", "docs"])
    return TaskInstance("Write an executable shell script count.sh that takes a directory and an extension as its "
                        "arguments and prints how many files in that directory have that extension (./count.sh docs "
                        f"md counts docs/*.md). Then answer with the output of `./count.sh docs {a}`.",
                        ws.run(count.format("docs", a)), "int", check=check,
                        solution=["printf '#!/bin/sh\\nfind \"$1\" -type f -name \"*.$2\" | wc -l\\n' > count.sh && "
                                  "chmod +x count.sh", f"./count.sh docs {a}"])


# ---- hashing --------------------------------------------------------------------------------------

@task("identical_files", "hashing", "train", "the two files with the same content (sha1sum | uniq -w)")
def identical_files(ws, rng):
    names = distinct_tokens(rng, rng.randint(5, 9))
    blobs = [rng.randbytes(rng.randint(100, 400)) for _ in names]
    for n, data in zip(names, blobs[:-1] + [rng.choice(blobs[:-1])]):  # the last file copies another one
        ws.write(f"photos/{n}.jpg", data)
    return TaskInstance("Exactly two files in photos/ have the same content. Which ones? Answer with their two file "
                        "names in alphabetical order, separated by a comma (like a.jpg,b.jpg).",
                        ws.run("md5sum photos/* | sort | uniq -w32 -D | cut -d/ -f2 | sort | paste -sd,"), "text",
                        solution=["sha1sum photos/* | sort | uniq -w40 -D | cut -d/ -f2 | sort | paste -sd,"])


@task("magic_bytes", "hashing", "train", "the first bytes of a binary file in hex (od -tx1)")
def magic_bytes(ws, rng):
    n = rng.randint(3, 8)
    ws.write("blob.bin", rng.randbytes(rng.randint(64, 512)))
    return TaskInstance(f"What are the first {n} bytes of blob.bin in hexadecimal? Answer with two hex digits per "
                        "byte and no spaces (like 7f454c46).", ws.run(f"od -An -tx1 -N{n} blob.bin | tr -d ' \\n'"),
                        "hex", solution=[f"head -c {n} blob.bin | od -An -tx1 | tr -d ' \\n'"])


@task("byte_at_offset", "hashing", "train", "the value of the byte at an offset of a file (od -j -N)")
def byte_at_offset(ws, rng):
    size = rng.randint(200, 2000)
    ws.write("blob.bin", rng.randbytes(size))
    k = rng.randint(1, size - 1)
    return TaskInstance(f"What is the value (0 to 255) of the byte at offset {k} of blob.bin (the first byte is at "
                        "offset 0)? Answer with the number in decimal.",
                        ws.run(f"od -An -tu1 -j{k} -N1 blob.bin | tr -d ' '"), "int",
                        solution=[f"tail -c +{k + 1} blob.bin | head -c 1 | od -An -tu1"])


# ---- system ---------------------------------------------------------------------------------------

@task("date_add_days", "system", "train", "the date N days after a date (date -d 'D + N days')")
def date_add_days(ws, rng):
    d, n = datetime.date(1990, 1, 1) + datetime.timedelta(days=rng.randint(0, 15000)), rng.randint(1, 2000)
    return TaskInstance(f"What date is {n} days after {d}? Answer in the form YYYY-MM-DD.",
                        ws.run(f"date -u -d '{d} + {n} days' +%Y-%m-%d"), "text",
                        solution=[f"date -u -d @$(( $(date -u -d {d} +%s) + {n} * 86400 )) +%F"])


@task("env_file", "system", "train", "source a file of variable assignments and read one back")
def env_file(ws, rng):
    ws.write("app.env", f"BASE=/opt/{rng.choice(WORDS)}\nVERSION=v{rng.randint(1, 9)}.{rng.randint(0, 30)}\n"
             f"FULL_PATH=\"$BASE/releases/$VERSION\"\nVERSION={token(rng, 5)}\nLOG_DIR=${{BASE}}/log/$VERSION\n")
    var = rng.choice(["FULL_PATH", "LOG_DIR"])
    return TaskInstance(f"app.env is a shell file of variable assignments. Load it into a shell (source it) and "
                        f"answer with the value of the variable {var}.",
                        ws.run(f"bash -c '. ./app.env && echo \"${var}\"'"), "text",
                        solution=[f"source ./app.env && echo \"${var}\""])


@task("set_mtime", "system", "train", "set a file's modification time (touch -d), read it back as epoch seconds")
def set_mtime(ws, rng):
    t = f"{datetime.datetime(2001, 1, 1) + datetime.timedelta(seconds=rng.randint(0, 700_000_000)):%Y-%m-%d %H:%M:%S}"
    ws.write("stamp.txt", f"{token(rng, 8)}\n")
    want = ws.run(f"date -u -d '{t} UTC' +%s")
    return TaskInstance(f"Set the modification time of stamp.txt to {t} UTC. Then answer with the output of "
                        "`stat -c %Y stamp.txt` (that time in seconds since the epoch).", want, "int",
                        check=f"[ $(stat -c %Y stamp.txt) -eq {want} ]",
                        solution=[f"touch -d '{t} UTC' stamp.txt", "stat -c %Y stamp.txt"])
