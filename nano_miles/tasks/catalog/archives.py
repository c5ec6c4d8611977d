"""archives: tar and gzip: listing, extracting, creating, appending, checking."""
import random

from nano_miles.tasks.api import TaskInstance, Workspace, q
from nano_miles.tasks.catalog.common import WORDS, ask, builtin, distinct_tokens, skill, token


@builtin("tar_count", "archives", "train", "number of files in a .tar.gz (tar -t)")
def tar_count(ws: Workspace, rng: random.Random) -> TaskInstance:
    for i in range(rng.randint(3, 15)):
        ws.write(f"pkg/{rng.choice(['src', 'doc', 'bin'])}/{token(rng, 5)}.txt", token(rng, 20))
    ws.run("tar -czf bundle.tar.gz pkg && rm -rf pkg")
    return ask(ws, "How many regular files (not directories) does the archive bundle.tar.gz contain? Answer with "
               "the number.", "tar -tzf bundle.tar.gz | grep -v '/$' | wc -l", "int")


@builtin("tar_extract_read", "archives", "train", "extract an archive and read a file inside")
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


@builtin("gzip_logs", "archives", "train", "gzip every .log file of a directory in place")
def gzip_logs(ws, rng):
    n_txt = 0
    for i, n in enumerate(distinct_tokens(rng, rng.randint(4, 10))):
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


@builtin("tar_newest_member", "archives", "train", "the most recently modified file in a .tar.gz (tar -tv)")
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


# ---- held-out: training never sees these -----------------------------------------------------------

@builtin("make_tarball", "archives", "heldout", "create a .tar.gz of a directory")
def make_tarball(ws, rng):
    for _ in range(rng.randint(2, 6)):
        ws.write(f"site/{token(rng, 5)}.html", f"<p>{token(rng, 10)}</p>\n")
    return TaskInstance("Create a gzip-compressed tar archive backup.tar.gz containing the directory site/ (paths "
                        "inside should start with site/). Answer with the number of .html files it contains.",
                        ws.run("ls site/*.html | wc -l"), "int",
                        check="[ \"$(tar -tzf backup.tar.gz | grep '\\.html$' | sort)\" = "
                              "\"$(find site -name '*.html' | sort)\" ]",
                        solution=["tar -czf backup.tar.gz site", "tar -tzf backup.tar.gz | grep -c '\\.html$'"])


@builtin("gunzip_count", "archives", "heldout", "decompress a .gz file and count its lines")
def gunzip_count(ws, rng):
    ws.write("events.txt", "".join(f"{token(rng, 8)}\n" for _ in range(rng.randint(40, 200))))
    ws.run("gzip events.txt")
    return ask(ws, "How many lines does the compressed file events.txt.gz contain once decompressed? Answer with "
               "the number.", "gunzip -c events.txt.gz | wc -l", "int")


# ---- the opt-in skills set (nano_miles.tasks.catalog_skills) --------------------------------------

@skill("tar_extract_one", "archives", "train", "extract a single member of an archive (tar -x MEMBER)")
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


@skill("tar_append", "archives", "train", "add a file to an existing archive (tar -r)")
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


@skill("tar_member_size", "archives", "train", "size of one member of a .tar.gz (tar -tv)")
def tar_member_size(ws, rng):
    names = distinct_tokens(rng, rng.randint(3, 8))
    for n in names:
        ws.write(f"site/{n}.html", "<p>" + "x" * rng.randint(10, 9000) + "</p>\n")
    ws.run("tar -czf site.tar.gz site && rm -rf site")
    m = f"site/{rng.choice(names)}.html"
    return TaskInstance(f"What is the size in bytes of the member {m} of the archive site.tar.gz? Answer with the "
                        "number.", ws.run(f"tar -xzOf site.tar.gz {m} | wc -c"), "int",
                        solution=[f"tar -tvzf site.tar.gz | awk '$6 == \"{m}\" {{print $3}}'"])


@skill("gzip_damaged", "archives", "train", "the damaged .gz file of a directory (gzip -t)")
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
