"""scripts: shell arithmetic and writing small scripts (arguments, loops, here-documents, substrings)."""
import random

from nano_miles.tasks.api import TaskInstance, Workspace, q
from nano_miles.tasks.catalog.common import WORDS, ask, builtin, distinct_tokens, skill, token


@builtin("python_product", "scripts", "train", "a product computed with python3 -c from bash", seed_task=True)
def python_product(ws: Workspace, rng: random.Random) -> TaskInstance:
    a, b = rng.randint(1000, 99999), rng.randint(1000, 99999)
    return ask(ws, f"Use `python3 -c` from bash to compute {a} * {b}. Answer with the number.",
               f"python3 -c 'print({a} * {b})'", "int")


@builtin("sum_args_script", "scripts", "train", "write a script that adds its two arguments")
def sum_args_script(ws, rng):
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    x, y = rng.randint(1000, 9999), rng.randint(1000, 9999)
    return TaskInstance(
        f"Write an executable shell script add.sh that prints the sum of its two integer arguments. "
        f"Then answer with the output of `./add.sh {a} {b}`.",
        ws.run(f"echo $(({a} + {b}))"), "int",
        check=f"[ \"$(./add.sh {x} {y})\" = {x + y} ]",
        solution=["printf '#!/bin/sh\\necho $(($1 + $2))\\n' > add.sh && chmod +x add.sh", f"./add.sh {a} {b}"])


@builtin("squares_script", "scripts", "train", "write a script with a loop, then sum its output")
def squares_script(ws, rng):
    n, m = rng.randint(5, 60), rng.randint(3, 12)
    return TaskInstance(
        "Write an executable bash script squares.sh that takes one argument N and prints the squares "
        f"1, 4, 9, ..., N*N, one per line. Then answer with the sum of the numbers that `./squares.sh {n}` "
        "prints.", ws.run(f"seq 1 {n} | awk '{{s += $1 * $1}} END {{print s}}'"), "int",
        check=f"[ \"$(./squares.sh {m} | tr '\\n' ' ')\" = \"$(seq 1 {m} | awk '{{printf \"%d \", $1 * $1}}')\" ]",
        solution=["printf '#!/bin/bash\\nfor ((i = 1; i <= $1; i++)); do echo $((i * i)); done\\n' > squares.sh "
                  "&& chmod +x squares.sh", f"./squares.sh {n} | awk '{{s += $1}} END {{print s}}'"])


@builtin("divmod", "scripts", "train", "integer quotient and remainder with shell arithmetic")
def divmod_task(ws, rng):
    a, b = rng.randint(10000, 999999), rng.randint(7, 997)
    return TaskInstance(f"Using shell arithmetic, compute the integer quotient and the remainder of {a} divided by "
                        f"{b}. Answer with both numbers, quotient first, separated by one space (like 12 5).",
                        ws.run(f"echo $(({a} / {b})) $(({a} % {b}))"), "text",
                        solution=[f"echo $(expr {a} / {b}) $(expr {a} % {b})"])


# ---- held-out: training never sees these -----------------------------------------------------------

@builtin("loop_sum", "scripts", "heldout", "sum of multiples computed with a shell loop")
def loop_sum(ws, rng):
    n, k = rng.randint(50, 400), rng.randint(3, 9)
    return TaskInstance(f"Compute the sum of all integers from 1 to {n} that are divisible by {k}. Answer with "
                        "the number.", ws.run(f"seq {k} {k} {n} | awk '{{s+=$1}} END {{print s}}'"), "int",
                        solution=[f"s=0; for i in $(seq 1 {n}); do [ $((i % {k})) -eq 0 ] && s=$((s+i)); done; echo $s"])


# ---- the opt-in skills set (nano_miles.tasks.catalog_skills) --------------------------------------

@skill("heredoc_config", "scripts", "train", "write a multi-line file exactly (here-document)")
def heredoc_config(ws, rng):
    lines = [f"host={rng.choice(WORDS)}.internal", f"port={rng.randint(1024, 65535)}",
             f"user={token(rng, 6)}"] + [f"{w}={token(rng, 4)}" for w in rng.sample(WORDS, rng.randint(0, 3))]
    body, printed = "\n".join(lines), f"printf '%s\\n' {' '.join(q(x) for x in lines)}"
    return TaskInstance(f"Create the file app.conf containing exactly these {len(lines)} lines (each ending with a "
                        f"newline):\n{body}\nThen answer with the size of app.conf in bytes.",
                        ws.run(f"{printed} | wc -c"), "int", check=f"{printed} | cmp -s - app.conf",
                        solution=[f"cat > app.conf <<'EOF'\n{body}\nEOF", "wc -c < app.conf"])


@skill("max_arg_script", "scripts", "train", "write a script that loops over its arguments (max)")
def max_arg_script(ws, rng):
    args = " ".join(str(rng.randint(-500, 999)) for _ in range(rng.randint(3, 7)))
    other = " ".join(str(rng.randint(-999, -1)) for _ in range(3)) + f" {rng.randint(-50, 50)}"
    return TaskInstance("Write an executable bash script max.sh that prints the largest of its integer arguments (any "
                        f"number of them, possibly negative). Then answer with the output of `./max.sh {args}`.",
                        ws.run(f"printf '%s\\n' {args} | sort -n | tail -1"), "int",
                        check=f"[ \"$(./max.sh {other})\" = \"$(printf '%s\\n' {other} | sort -n | tail -1)\" ]",
                        solution=["printf '#!/bin/bash\\nm=$1\\nfor x in \"$@\"; do [ $x -gt $m ] && m=$x; done\\n"
                                  "echo $m\\n' > max.sh && chmod +x max.sh", f"./max.sh {args}"])


@skill("substring", "scripts", "train", "characters i..j of a string (${s:off:len} / cut -c)")
def substring(ws, rng):
    s, i = token(rng, rng.randint(18, 30)), rng.randint(2, 10)
    j = i + rng.randint(2, 7)
    return TaskInstance(f"What are the characters at positions {i} to {j} (both included) of the string {s}, the "
                        "first character being position 1? Answer with them.",
                        ws.run(f"printf '%s\\n' {s} | cut -c {i}-{j}"), "text",
                        solution=[f"s={s}; echo \"${{s:{i - 1}:{j - i + 1}}}\""])


@skill("count_ext_script", "scripts", "train", "write a script with two arguments: a directory and an extension")
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
