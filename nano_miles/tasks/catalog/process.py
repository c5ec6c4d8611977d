"""process: running programs: exit statuses, environment, standard streams, pipelines, retries."""
import random

from nano_miles.tasks.api import TaskInstance, Workspace
from nano_miles.tasks.catalog.common import WORDS, ask, builtin, distinct_tokens, skill, token


@builtin("exit_status", "process", "train", "exit status of a script")
def exit_status(ws: Workspace, rng: random.Random) -> TaskInstance:
    ws.write("probe.sh", f"#!/bin/sh\necho probing\nexit {rng.randint(2, 120)}\n", mode=0o755)
    return ask(ws, "Run ./probe.sh and answer with its exit status (a number).", "./probe.sh >/dev/null; echo $?",
               "int")


@builtin("env_script", "process", "train", "run a script with an environment variable set")
def env_script(ws, rng):
    val = token(rng, 8)
    ws.write("greet.sh", '#!/bin/sh\n[ -n "$GREETING" ] || { echo "GREETING is not set" >&2; exit 1; }\n'
             'echo "$GREETING" | rev\n', mode=0o755)
    return ask(ws, f"Run ./greet.sh with the environment variable GREETING set to {val} and answer with what it "
               "prints.", f"GREETING={val} ./greet.sh")


@builtin("pipe_status", "process", "train", "exit status of every stage of a pipeline (PIPESTATUS)")
def pipe_status(ws, rng):
    a, b, c = (rng.randint(0, 60) for _ in range(3))
    ws.write("produce.sh", f"#!/bin/sh\necho {token(rng, 8)}\nexit {a}\n", mode=0o755)
    ws.write("filter.sh", f"#!/bin/sh\ncat\nexit {b}\n", mode=0o755)
    ws.write("consume.sh", f"#!/bin/sh\ncat >/dev/null\nexit {c}\n", mode=0o755)
    return ask(ws, "Run the pipeline `./produce.sh | ./filter.sh | ./consume.sh` in bash. What is the exit status "
               "of each of its three commands? Answer with the three numbers in pipeline order, separated by single "
               "spaces (like 0 1 2).", "./produce.sh | ./filter.sh | ./consume.sh; echo ${PIPESTATUS[@]}")


@builtin("stdin_script", "process", "train", "feed a file to a script on standard input")
def stdin_script(ws, rng):
    m, p = rng.randint(3, 97), rng.choice([10007, 65521, 99991])
    ws.write("digest.sh", f"#!/bin/sh\nawk '{{s = (s * {m} + $1) % {p}}} END {{print s + 0}}'\n", mode=0o755)
    ws.write("input.txt", "".join(f"{rng.randint(0, 9999)}\n" for _ in range(rng.randint(10, 40))))
    return ask(ws, "./digest.sh reads numbers from its standard input. Run it with the contents of input.txt as its "
               "standard input and answer with what it prints.", "./digest.sh < input.txt", "int")


# ---- held-out: training never sees these -----------------------------------------------------------

@builtin("script_stdout_lines", "process", "heldout", "run a script, count lines on stdout only")
def script_stdout_lines(ws, rng):
    n_out, n_err = rng.randint(3, 12), rng.randint(2, 9)
    body = "".join(rng.sample([f"echo out{i}\n" for i in range(n_out)] +
                              [f"echo err{i} >&2\n" for i in range(n_err)], n_out + n_err))
    ws.write("noisy.sh", "#!/bin/sh\n" + body, mode=0o755)
    return ask(ws, "Run ./noisy.sh. How many lines does it print to standard output (ignore standard error)? "
               "Answer with the number.", "./noisy.sh 2>/dev/null | wc -l", "int")


@builtin("env_default", "process", "heldout", "value a script derives from an environment variable")
def env_default(ws, rng):
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    ws.write("calc.sh", '#!/bin/sh\necho $(( ${FACTOR:-1} * ' + str(a) + ' ))\n', mode=0o755)
    return ask(ws, f"Run ./calc.sh with the environment variable FACTOR set to {b}, and answer with what it prints.",
               f"FACTOR={b} ./calc.sh", "int")


# ---- the opt-in skills set (nano_miles.tasks.catalog_skills) --------------------------------------

@skill("and_or_chain", "process", "train", "what a && / || command list runs, from the exit statuses")
def and_or_chain(ws, rng):
    for name, w in zip(["check", "build", "fallback"], distinct_tokens(rng, 3, 5)):
        ws.write(f"{name}.sh", f"#!/bin/sh\necho {w}\nexit {rng.choice([0, 0, 1, 2])}\n", mode=0o755)
    return ask(ws, "Run the command list `./check.sh && ./build.sh || ./fallback.sh`. What does it print? Answer "
               "with the printed words in order, separated by single spaces.",
               "{ ./check.sh && ./build.sh || ./fallback.sh; } | paste -sd' '")


@skill("stderr_last_line", "process", "train", "the last line a script writes to standard error (2>&1 >/dev/null)")
def stderr_last_line(ws, rng):
    ws.write("job.sh", "#!/bin/sh\n" + "".join(f"echo warn-{token(rng, 6)} >&2\n" if i == 0 or rng.random() < 0.5 else
                                               f"echo out-{token(rng, 6)}\n" for i in range(rng.randint(4, 12))), 0o755)
    return TaskInstance("Run ./job.sh. What is the last line it writes to standard error? Answer with that line.",
                        ws.run("./job.sh 2>&1 1>/dev/null | tail -n 1"), "text",
                        solution=["./job.sh 2>err.txt >/dev/null; tail -n 1 err.txt"])


@skill("count_passing", "process", "train", "run every script of a directory and count those exiting 0")
def count_passing(ws, rng):
    for i, n in enumerate(distinct_tokens(rng, rng.randint(4, 10))):
        ws.write(f"checks/{n}.sh", f"#!/bin/sh\necho {n}\nexit {i % 2 if i < 2 else rng.choice([0, 1, 3])}\n", 0o755)
    return TaskInstance("Run each of the scripts in checks/. How many of them exit with status 0? Answer with the "
                        "number.", ws.run('n=0; for f in checks/*.sh; do "$f" >/dev/null 2>&1 && n=$((n + 1)); done; '
                                          'echo $n'), "int",
                        solution=['for f in checks/*.sh; do "$f" >/dev/null 2>&1; echo $?; done | grep -cx 0'])


@skill("retry_until_ok", "process", "train", "run a flaky script until it succeeds (until loop)")
def retry_until_ok(ws, rng):
    k, word = rng.randint(3, 9), f"{rng.choice(WORDS)}-{token(rng, 6)}"
    ws.write("flaky.sh", "#!/bin/sh\nn=$(cat .attempts 2>/dev/null || echo 0); n=$((n + 1)); echo $n > .attempts\n"
             f"if [ $n -lt {k} ]; then echo \"attempt $n failed\" >&2; exit 1; fi\necho ready {word}\n", mode=0o755)
    return TaskInstance("./flaky.sh fails the first few times it is run. Run it again and again until it exits with "
                        "status 0, then answer with what it printed on that run.",
                        ws.run("d=$(mktemp -d) && cp flaky.sh $d && cd $d && until ./flaky.sh 2>/dev/null; do :; "
                               "done && rm -rf $d"), "text", solution=["until ./flaky.sh 2>/dev/null; do :; done"])
