"""files: creating, finding, measuring and renaming files and directories (find, ls, du, ln, split)."""
import random

from nano_miles.tasks.api import TaskInstance, Workspace, q
from nano_miles.tasks.catalog.common import SHA, WORDS, ask, builtin, distinct_tokens, skill, token


@builtin("numbers_file", "files", "train", "create numbers.txt holding 1..N and count its lines", seed_task=True)
def numbers_file(ws: Workspace, rng: random.Random) -> TaskInstance:
    n = rng.randint(15, 120)
    return TaskInstance(
        f"Create a file numbers.txt in the current directory containing the integers 1 to {n}, one per "
        "line, then count its lines. Answer with the line count.",
        ws.run(f"seq 1 {n} | wc -l"), "int",
        check=f"seq 1 {n} | cmp -s - numbers.txt",
        solution=[f"seq 1 {n} > numbers.txt", "wc -l < numbers.txt"])


@builtin("count_ext", "files", "train", "count files with an extension in a tree (find)")
def count_ext(ws, rng):
    for i in range(rng.randint(10, 30)):
        d = "/".join(rng.sample(["logs", "app", "old", "tmp", "var"], rng.randint(1, 3)))
        ws.write(f"tree/{d}/{token(rng, 5)}.{rng.choice(['log', 'txt', 'log', 'cfg'])}", "x\n")
    return ask(ws, "How many files ending in .log are there anywhere under the directory tree/? Answer with the "
               "number.", "find tree -type f -name '*.log' | wc -l", "int")


@builtin("largest_file", "files", "train", "name of the largest file in a directory")
def largest_file(ws, rng):
    for s in rng.sample(range(10, 5000), rng.randint(4, 9)):
        ws.write(f"data/{token(rng, 6)}.bin", bytes(rng.getrandbits(8) for _ in range(s)))
    return ask(ws, "Which file in the directory data/ is the largest? Answer with its file name only.",
               "ls -S data | head -1")


@builtin("make_tree", "files", "train", "create nested directories and a file with given content")
def make_tree(ws, rng):
    a, b, c = rng.sample(WORDS, 3)
    secret = token(rng, 12)
    return TaskInstance(
        f"Create the directory path {a}/{b}/{c} and inside it a file named key.txt containing exactly the line "
        f"{secret}. Then answer with the output of `find {a} -type d | wc -l`.",
        ws.run(f"printf '%s\\n' {a} {a}/{b} {a}/{b}/{c} | wc -l"), "int",
        check=f"[ \"$(cat {a}/{b}/{c}/key.txt)\" = {secret} ]",
        solution=[f"mkdir -p {a}/{b}/{c} && echo {secret} > {a}/{b}/{c}/key.txt", f"find {a} -type d | wc -l"])


@builtin("files_over_size", "files", "train", "number of files larger than a size (find -size)")
def files_over_size(ws, rng):
    sizes = rng.sample(range(100, 6000), rng.randint(6, 14))
    for name, s in zip(distinct_tokens(rng, len(sizes)), sizes):
        ws.write(f"media/{name}.dat", "x" * s)
    limit = rng.randint(1000, 4000)
    while limit in sizes:
        limit += 1
    return TaskInstance(f"How many files in media/ are larger than {limit} bytes? Answer with the number.",
                        ws.run(f"stat -c %s media/* | awk '$1 > {limit}' | wc -l"), "int",
                        solution=[f"find media -type f -size +{limit}c | wc -l"])


@builtin("rename_ext", "files", "train", "rename files by pattern: .txt to .md (loop + mv)")
def rename_ext(ws, rng):
    for i, n in enumerate(distinct_tokens(rng, rng.randint(5, 12))):
        ws.write(f"notes/{n}.{'txt' if i == 0 else rng.choice(['txt', 'txt', 'md', 'cfg'])}", f"{n}\n")
    want = ws.run("ls notes | sed 's/\\.txt$/.md/' | sort | tr '\\n' ' '")
    return TaskInstance("Rename every file in notes/ whose name ends in .txt so that it ends in .md instead "
                        "(abc.txt becomes abc.md); leave the other files alone. Then answer with the number of "
                        ".md files in notes/.", ws.run("ls notes | grep -c '\\.\\(txt\\|md\\)$'"), "int",
                        check=f"[ \"$(ls notes | sort | tr '\\n' ' ')\" = {q(want)} ]",
                        solution=['for f in notes/*.txt; do mv "$f" "${f%.txt}.md"; done', "ls notes/*.md | wc -l"])


@builtin("symlink_current", "files", "train", "create a relative symlink to a directory and read through it")
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


# ---- held-out: training never sees these -----------------------------------------------------------

@builtin("count_dirs", "files", "heldout", "number of directories in a tree")
def count_dirs(ws, rng):
    for _ in range(rng.randint(5, 15)):
        ws.write("proj/" + "/".join(rng.sample(WORDS[:8], rng.randint(1, 3))) + "/f.txt", "x\n")
    return ask(ws, "How many directories are there under proj/ (not counting proj itself)? Answer with the number.",
               "find proj -mindepth 1 -type d | wc -l", "int")


@builtin("file_with_token", "files", "heldout", "which file contains a token (grep -l)")
def file_with_token(ws, rng):
    secret = token(rng, 12)
    names = rng.sample(WORDS, 8)
    holder = rng.choice(names)
    for n in names:
        body = "\n".join(token(rng, 12) for _ in range(20))
        ws.write(f"docs/{n}.txt", body + (f"\n{secret}" if n == holder else "") + "\n")
    return ask(ws, f"Which file in docs/ contains the string {secret}? Answer with its file name only (like "
               "name.txt).", f"grep -l {secret} docs/*.txt | xargs -n1 basename")


@builtin("total_bytes", "files", "heldout", "total size in bytes of the files in a directory")
def total_bytes(ws, rng):
    for _ in range(rng.randint(3, 8)):
        ws.write(f"blobs/{token(rng, 5)}.dat", bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 3000))))
    return ask(ws, "What is the total size in bytes of all files in blobs/ added together? Answer with the number.",
               "cat blobs/* | wc -c", "int")


@builtin("copy_rename", "files", "heldout", "copy files matching a pattern into a new directory")
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


# ---- the opt-in skills set (nano_miles.tasks.catalog_skills) --------------------------------------

@skill("delete_empty_files", "files", "train", "delete the empty files of a tree, keep its directories")
def delete_empty_files(ws, rng):
    for i, n in enumerate(distinct_tokens(rng, rng.randint(5, 14))):
        ws.write(f"cache/{rng.choice(['img', 'css', 'js/lib'])}/{n}.tmp", "" if i % 3 == 0 else token(rng, 30))
    keep = ws.run("find cache -type d -o ! -empty | sort")  # everything but the empty files
    return TaskInstance("Delete every empty file under cache/ (in all its subdirectories), keeping the directories "
                        "and the other files. Then answer with the number of files left under cache/.",
                        ws.run("find cache -type f ! -empty | wc -l"), "int",
                        check=f"[ \"$(find cache | sort)\" = {q(keep)} ]",
                        solution=["find cache -type f -empty -delete", "find cache -type f | wc -l"])


@skill("newer_than_marker", "files", "train", "files modified after a reference file (find -newer)")
def newer_than_marker(ws, rng):
    paths = [f"src/{n}.c" for n in distinct_tokens(rng, rng.randint(5, 12))] + ["last_build"]
    base = rng.randint(1_000_000_000, 1_600_000_000)
    for p, day in zip(paths, rng.sample(range(500), len(paths))):  # whole days apart: no ties, no zones
        ws.write(p, f"{token(rng, 10)}\n")
        ws.run(f"touch -d @{base + day * 86400} {p}")
    return ask(ws, "How many files in src/ were modified more recently than the file last_build? Answer with the "
               "number.", "find src -type f -newer last_build | wc -l", "int")


@skill("heaviest_subdir", "files", "train", "the subdirectory whose files add up to the most bytes (du)")
def heaviest_subdir(ws, rng):
    for d, total in zip(rng.sample(WORDS, rng.randint(3, 6)), rng.sample(range(2, 40), 6)):  # >= 1000 bytes apart
        parts = rng.randint(1, 4)
        for _ in range(parts):
            ws.write(f"data/{d}/{token(rng, 6)}.bin", "z" * (total * 1000 // parts + rng.randint(0, 99)))
    return TaskInstance("Which subdirectory of data/ holds the most data (the sizes of its files added up)? Answer "
                        "with the directory's name only.",
                        ws.run("find data -type f -printf '%s %h\\n' | awk '{s[$2] += $1} END {for (d in s) print "
                               "s[d], d}' | sort -n | tail -1 | cut -d/ -f2"), "text",
                        solution=["du -sb data/* | sort -n | tail -1 | cut -d/ -f2"])


@skill("broken_symlink", "files", "train", "the one symbolic link whose target is missing")
def broken_symlink(ws, rng):
    names = distinct_tokens(rng, rng.randint(4, 9))
    bad = rng.choice(names)
    for n in names:
        ws.write(f"targets/{n}.conf", "k=v\n")
        ws.run(f"mkdir -p links && ln -s ../targets/{n}.conf{'.old' if n == bad else ''} links/{n}")
    return TaskInstance("Exactly one symbolic link in links/ is broken (what it points to does not exist). Which "
                        "one? Answer with the link's name only.", ws.run("find links -xtype l -printf '%f\\n'"),
                        "text", solution=['for f in links/*; do [ -e "$f" ] || basename "$f"; done'])


@skill("split_pieces", "files", "train", "split a file into pieces of N lines (split -l)")
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
