"""text: reading and editing text files (grep, sort, uniq, sed, awk, cut, paste, join, diff)."""
import random

from nano_miles.tasks.api import TaskInstance, Workspace, q
from nano_miles.tasks.catalog.common import SHA, WORDS, ask, builtin, distinct_tokens, lines_of_words, skill, token


@builtin("count_word", "text", "train", "occurrences of a word in a file (grep -o)")
def count_word(ws: Workspace, rng: random.Random) -> TaskInstance:
    words = lines_of_words(rng, rng.randint(30, 80))
    target = rng.choice(words)
    ws.write("story.txt", "\n".join(" ".join(words[i:i + 5]) for i in range(0, len(words), 5)) + "\n")
    return ask(ws, f"How many times does the word '{target}' occur in story.txt? Answer with the number.",
               f"grep -ow {q(target)} story.txt | wc -l", "int")


@builtin("unique_lines", "text", "train", "number of distinct lines (sort -u)")
def unique_lines(ws, rng):
    ws.write("names.txt", "\n".join(lines_of_words(rng, rng.randint(20, 60), vocab=rng.randint(5, 15))) + "\n")
    return ask(ws, "How many distinct lines does names.txt contain? Answer with the number.",
               "sort -u names.txt | wc -l", "int")


@builtin("most_frequent", "text", "train", "most frequent line (sort | uniq -c)")
def most_frequent(ws, rng):
    words = lines_of_words(rng, rng.randint(20, 50))
    winner = rng.choice(words)
    top = max(words.count(w) for w in set(words))
    words += [winner] * (top - words.count(winner) + 1)  # make the maximum unique
    rng.shuffle(words)
    ws.write("votes.txt", "\n".join(words) + "\n")
    return ask(ws, "Which line occurs most often in votes.txt? Answer with that line.",
               "sort votes.txt | uniq -c | sort -rn | head -1 | awk '{print $2}'")


@builtin("sed_replace", "text", "train", "replace a word in place (sed -i), report occurrences of the new one")
def sed_replace(ws, rng):
    old, new = rng.sample(WORDS, 2)
    words = [old if rng.random() < 0.3 else rng.choice(WORDS[:10]) for _ in range(40)]
    words = [w for w in words if w != new]
    ws.write("notes.txt", "\n".join(" ".join(words[i:i + 4]) for i in range(0, len(words), 4)) + "\n")
    want = ws.run(f"sed 's/\\b{old}\\b/{new}/g' notes.txt | {SHA}")
    return TaskInstance(
        f"In notes.txt, replace every occurrence of the word '{old}' with '{new}' (edit the file in place). "
        f"Then answer with the number of times '{new}' now occurs in the file.",
        ws.run(f"sed 's/\\b{old}\\b/{new}/g' notes.txt | grep -ow {new} | wc -l"), "int",
        check=f"[ \"$(sha256sum < notes.txt | cut -d' ' -f1)\" = {want} ]",
        solution=[f"sed -i 's/\\b{old}\\b/{new}/g' notes.txt", f"grep -ow {new} notes.txt | wc -l"])


@builtin("csv_column_sum", "text", "train", "sum of a CSV column (awk)")
def csv_column_sum(ws, rng):
    rows = ["item,qty,price"] + [f"{rng.choice(WORDS)},{rng.randint(1, 20)},{rng.randint(1, 500)}"
                                 for _ in range(rng.randint(8, 25))]
    ws.write("sales.csv", "\n".join(rows) + "\n")
    return ask(ws, "sales.csv has a header row and columns item,qty,price. What is the sum of the price column? "
               "Answer with the number.", "awk -F, 'NR>1 {s+=$3} END {print s}' sales.csv", "int")


@builtin("join_total", "text", "train", "join two files on a key and sum the matches (join/awk)")
def join_total(ws, rng):
    names = rng.sample(WORDS, rng.randint(5, 10))
    ids = [f"u{n:03d}" for n in rng.sample(range(1000), len(names))]
    ws.write("users.txt", "".join(f"{i} {n}\n" for i, n in zip(ids, names)))
    who = rng.randrange(len(ids))
    orders = [rng.choice(ids) for _ in range(rng.randint(10, 30))] + [ids[who]]
    rng.shuffle(orders)
    ws.write("orders.txt", "".join(f"{i} {rng.randint(1, 500)}\n" for i in orders))
    name = names[who]
    return TaskInstance(
        "users.txt has lines 'id name' and orders.txt has lines 'id amount' (the same ids). What is the total "
        f"amount of all the orders of the user named {name}? Answer with the number.",
        ws.run(f"awk 'NR == FNR {{if ($2 == \"{name}\") id = $1; next}} $1 == id {{s += $2}} END {{print s}}' "
               "users.txt orders.txt"), "int",
        solution=["sort users.txt > users.sorted && sort orders.txt > orders.sorted",
                  f"join users.sorted orders.sorted | awk '$2 == \"{name}\" {{s += $3}} END {{print s}}'"])


@builtin("top_k_sum", "text", "train", "sum of the K largest values of a column (sort -n | head)")
def top_k_sum(ws, rng):
    ws.write("scores.txt", "".join(f"{n} {rng.randint(1, 999)}\n" for n in rng.sample(WORDS, rng.randint(8, 20))))
    k = rng.randint(2, 5)
    return ask(ws, f"scores.txt has lines 'name score'. What is the sum of the {k} highest scores? Answer with the "
               "number.", f"sort -k2,2nr scores.txt | head -n {k} | awk '{{s += $2}} END {{print s}}'", "int")


@builtin("diff_count", "text", "train", "number of lines that differ between two files (diff)")
def diff_count(ws, rng):
    old = distinct_tokens(rng, rng.randint(20, 50), 8)
    new = list(old)
    for i in rng.sample(range(len(old)), rng.randint(1, 8)):
        new[i] = token(rng, 9)  # 9 characters: never equal to an old line
    ws.write("old.txt", "\n".join(old) + "\n")
    ws.write("new.txt", "\n".join(new) + "\n")
    return TaskInstance("new.txt is a copy of old.txt in which some lines were replaced by others (no line was "
                        "added or removed). How many lines were replaced? Answer with the number.",
                        ws.run("awk 'NR == FNR {a[FNR] = $0; next} a[FNR] != $0' old.txt new.txt | wc -l"), "int",
                        solution=["diff old.txt new.txt | grep -c '^<'"])


# ---- held-out: training never sees these -----------------------------------------------------------

@builtin("grep_count_lines", "text", "heldout", "lines matching a pattern (grep -c)")
def grep_count_lines(ws, rng):
    levels = [rng.choice(["INFO", "WARN", "ERROR", "DEBUG"]) for _ in range(rng.randint(20, 60))]
    ws.write("app.log", "".join(f"2024-01-{i % 28 + 1:02d} {lv} {token(rng, 6)}\n" for i, lv in enumerate(levels)))
    lv = rng.choice(["WARN", "ERROR"])
    return ask(ws, f"How many lines of app.log have the level {lv}? Answer with the number.",
               f"grep -c ' {lv} ' app.log", "int")


@builtin("nth_line", "text", "heldout", "the N-th line of a file (sed -n)")
def nth_line(ws, rng):
    ws.write("list.txt", "".join(f"{token(rng, 8)}\n" for _ in range(rng.randint(20, 40))))
    n = rng.randint(3, 19)
    return ask(ws, f"What is line number {n} of list.txt? Answer with that line.", f"sed -n '{n}p' list.txt")


@builtin("reverse_sort_first", "text", "heldout", "first line after a reverse sort")
def reverse_sort_first(ws, rng):
    ws.write("words.txt", "\n".join(lines_of_words(rng, 15, vocab=12)) + "\n")
    return ask(ws, "Sort words.txt in reverse alphabetical order and answer with the first line.",
               "sort -r words.txt | head -1")


@builtin("uppercase_file", "text", "heldout", "upper-case a file into another (tr)")
def uppercase_file(ws, rng):
    ws.write("quiet.txt", " ".join(lines_of_words(rng, 12)) + "\n")
    want = ws.run(f"tr a-z A-Z < quiet.txt | {SHA}")
    return TaskInstance("Write an upper-case copy of quiet.txt to loud.txt, then answer with the first word "
                        "of loud.txt.", ws.run("tr a-z A-Z < quiet.txt | awk '{print $1}'"), "text",
                        check=f"[ \"$(sha256sum < loud.txt | cut -d' ' -f1)\" = {want} ]",
                        solution=["tr a-z A-Z < quiet.txt > loud.txt", "awk '{print $1}' loud.txt"])


@builtin("column_max", "text", "heldout", "maximum of a whitespace column (awk/sort -n)")
def column_max(ws, rng):
    ws.write("temps.txt", "".join(f"{rng.choice(WORDS)} {rng.randint(-30, 45)}\n" for _ in range(rng.randint(10, 30))))
    return ask(ws, "temps.txt has lines 'city temperature'. What is the highest temperature? Answer with the "
               "number.", "awk '{print $2}' temps.txt | sort -n | tail -1", "int")


@builtin("dedupe_file", "text", "heldout", "remove duplicate lines keeping first occurrences")
def dedupe_file(ws, rng):
    ws.write("dups.txt", "\n".join(lines_of_words(rng, 30, vocab=10)) + "\n")
    want = ws.run(f"awk '!seen[$0]++' dups.txt | {SHA}")
    return TaskInstance("Write the lines of dups.txt to uniq.txt with duplicates removed, keeping the first "
                        "occurrence of each line in its original order. Answer with the number of lines in "
                        "uniq.txt.", ws.run("awk '!seen[$0]++' dups.txt | wc -l"), "int",
                        check=f"[ \"$(sha256sum < uniq.txt | cut -d' ' -f1)\" = {want} ]",
                        solution=["awk '!seen[$0]++' dups.txt > uniq.txt", "wc -l < uniq.txt"])


@builtin("word_count_total", "text", "heldout", "total number of words over several files (wc -w)")
def word_count_total(ws, rng):
    for _ in range(rng.randint(2, 5)):
        ws.write(f"chapters/{token(rng, 4)}.txt", " ".join(lines_of_words(rng, rng.randint(5, 40))) + "\n")
    return ask(ws, "How many words are there in all the .txt files in chapters/ together? Answer with the number.",
               "cat chapters/*.txt | wc -w", "int")


# ---- the opt-in skills set (nano_miles.tasks.catalog_skills) --------------------------------------

@skill("passwd_home", "text", "train", "a field of the passwd line with a given uid (awk -F:)")
def passwd_home(ws, rng):
    names, uids = rng.sample(WORDS, rng.randint(5, 12)), rng.sample(range(1000, 3000), 12)
    ws.write("accounts.txt", "".join(
        f"{n}:x:{u}:{rng.choice(uids)}:{n.title()}:{rng.choice(['/home', '/srv', '/var/lib'])}/{n}:"
        f"{rng.choice(['/bin/bash', '/bin/sh', '/usr/sbin/nologin'])}\n" for n, u in zip(names, uids)))
    uid = uids[rng.randrange(len(names))]
    return TaskInstance("accounts.txt is in /etc/passwd format (name:password:uid:gid:gecos:home:shell). What is "
                        f"the home directory of the account whose uid is {uid}? Answer with the path.",
                        ws.run(f"awk -F: '$3 == {uid} {{print $6}}' accounts.txt"), "text",
                        solution=[f"grep -E '^[^:]*:[^:]*:{uid}:' accounts.txt | cut -d: -f6"])


@skill("repeated_lines", "text", "train", "number of different lines that occur more than once (uniq -d)")
def repeated_lines(ws, rng):
    ws.write("tags.txt", "\n".join(lines_of_words(rng, rng.randint(12, 40), vocab=rng.randint(8, 20))) + "\n")
    return ask(ws, "How many different lines of tags.txt occur more than once in the file? Answer with the number.",
               "sort tags.txt | uniq -d | wc -l", "int")


@skill("extract_range", "text", "train", "save a range of lines to a file (sed -n 'a,bp'), count its words")
def extract_range(ws, rng):
    ws.write("book.txt", "".join(" ".join(lines_of_words(rng, rng.randint(1, 9), 12)) + "\n"
                                 for _ in range(rng.randint(30, 60))))
    a = rng.randint(2, 20)
    b = a + rng.randint(3, 9)
    return TaskInstance(f"Write lines {a} to {b} of book.txt (both included) to a new file excerpt.txt. Then answer "
                        "with the number of words in excerpt.txt.", ws.run(f"sed -n '{a},{b}p' book.txt | wc -w"),
                        "int", check=f"sed -n '{a},{b}p' book.txt | cmp -s - excerpt.txt",
                        solution=[f"head -n {b} book.txt | tail -n +{a} > excerpt.txt", "wc -w < excerpt.txt"])


@skill("strip_comments", "text", "train", "delete comment and empty lines in place (sed -i '/re/d')")
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


@skill("group_mean", "text", "train", "average of a column over the rows matching a condition (awk)")
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


@skill("distinct_ips", "text", "train", "distinct IPv4 addresses in a log (grep -oE | sort -u)")
def distinct_ips(ws, rng):
    ips = [".".join(str(rng.randint(1, 254)) for _ in range(4)) for _ in range(rng.randint(2, 9))]
    ws.write("server.log", "".join(
        f"[{rng.randint(0, 86399)}] client={rng.choice(ips)} {rng.choice(['GET', 'POST'])} /{rng.choice(WORDS)} "
        f"build {rng.randint(1, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 99)}\n" for _ in range(rng.randint(10, 40))))
    return ask(ws, "How many different IPv4 addresses appear in server.log? Answer with the number.",
               "grep -oE '[0-9]+(\\.[0-9]+){3}' server.log | sort -u | wc -l", "int")


@skill("paste_oldest", "text", "train", "pair two files line by line (paste) and pick the maximum")
def paste_oldest(ws, rng):
    names = rng.sample(WORDS, rng.randint(5, 15))
    ws.write("names.txt", "\n".join(names) + "\n")
    ws.write("ages.txt", "\n".join(map(str, rng.sample(range(18, 99), len(names)))) + "\n")
    return TaskInstance("Line i of ages.txt is the age of the person named on line i of names.txt. Who is the "
                        "oldest? Answer with the name.",
                        ws.run("awk 'NR == FNR {n[FNR] = $0; next} {print $1, n[FNR]}' names.txt ages.txt | sort -n "
                               "| tail -1 | cut -d' ' -f2"), "text",
                        solution=["paste ages.txt names.txt | sort -n | tail -1 | cut -f2"])


@skill("nth_cheapest", "text", "train", "sort a ';'-separated file on a numeric field (sort -t -k)")
def nth_cheapest(ws, rng):
    n, k = rng.randint(6, 15), rng.randint(2, 4)
    ws.write("parts.txt", "".join(f"P{s};{rng.choice(WORDS)};{p}\n"
                                  for s, p in zip(rng.sample(range(1000, 9999), n), rng.sample(range(5, 5000), n))))
    return ask(ws, f"parts.txt has lines 'sku;name;price'. Which part has the {['2nd', '3rd', '4th'][k - 2]} lowest "
               "price? Answer with its sku.", f"sort -t';' -k3,3n parts.txt | sed -n '{k}p' | cut -d';' -f1")
