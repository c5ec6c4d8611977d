"""system: the machine, the clock and the shell's environment (uname, date, touch, source)."""
import datetime
import random

from nano_miles.tasks.api import TaskInstance, Workspace
from nano_miles.tasks.catalog.common import WORDS, ask, builtin, skill, token


@builtin("kernel_name", "system", "train", "kernel name from uname -s, lower-cased", seed_task=True)
def kernel_name(ws: Workspace, rng: random.Random) -> TaskInstance:
    return ask(ws, "What is the kernel name reported by `uname -s`? Answer with it in lower case.",
               "uname -s | tr A-Z a-z")


@builtin("epoch_to_date", "system", "train", "a Unix timestamp as a UTC date (date -d @N -u)")
def epoch_to_date(ws, rng):
    e = rng.randint(0, 2_000_000_000)
    return ask(ws, f"Convert the Unix timestamp {e} (seconds since 1970-01-01 00:00:00 UTC) to a calendar date in "
               "UTC. Answer in the form YYYY-MM-DD.", f"date -u -d @{e} +%Y-%m-%d")


@builtin("days_between", "system", "train", "days between two dates (date +%s arithmetic)")
def days_between(ws, rng):
    d1 = datetime.date(2000, 1, 1) + datetime.timedelta(days=rng.randint(0, 9000))
    d2 = d1 + datetime.timedelta(days=rng.randint(1, 3000))
    return ask(ws, f"How many days are there from {d1} to {d2} (the later date minus the earlier one)? Answer with "
               "the number.", f"echo $(( ($(date -u -d {d2} +%s) - $(date -u -d {d1} +%s)) / 86400 ))", "int")


# ---- the opt-in skills set (nano_miles.tasks.catalog_skills) --------------------------------------

@skill("date_add_days", "system", "train", "the date N days after a date (date -d 'D + N days')")
def date_add_days(ws, rng):
    d, n = datetime.date(1990, 1, 1) + datetime.timedelta(days=rng.randint(0, 15000)), rng.randint(1, 2000)
    return TaskInstance(f"What date is {n} days after {d}? Answer in the form YYYY-MM-DD.",
                        ws.run(f"date -u -d '{d} + {n} days' +%Y-%m-%d"), "text",
                        solution=[f"date -u -d @$(( $(date -u -d {d} +%s) + {n} * 86400 )) +%F"])


@skill("env_file", "system", "train", "source a file of variable assignments and read one back")
def env_file(ws, rng):
    ws.write("app.env", f"BASE=/opt/{rng.choice(WORDS)}\nVERSION=v{rng.randint(1, 9)}.{rng.randint(0, 30)}\n"
             f"FULL_PATH=\"$BASE/releases/$VERSION\"\nVERSION={token(rng, 5)}\nLOG_DIR=${{BASE}}/log/$VERSION\n")
    var = rng.choice(["FULL_PATH", "LOG_DIR"])
    return TaskInstance(f"app.env is a shell file of variable assignments. Load it into a shell (source it) and "
                        f"answer with the value of the variable {var}.",
                        ws.run(f"bash -c '. ./app.env && echo \"${var}\"'"), "text",
                        solution=[f"source ./app.env && echo \"${var}\""])


@skill("set_mtime", "system", "train", "set a file's modification time (touch -d), read it back as epoch seconds")
def set_mtime(ws, rng):
    t = f"{datetime.datetime(2001, 1, 1) + datetime.timedelta(seconds=rng.randint(0, 700_000_000)):%Y-%m-%d %H:%M:%S}"
    ws.write("stamp.txt", f"{token(rng, 8)}\n")
    want = ws.run(f"date -u -d '{t} UTC' +%s")
    return TaskInstance(f"Set the modification time of stamp.txt to {t} UTC. Then answer with the output of "
                        "`stat -c %Y stamp.txt` (that time in seconds since the epoch).", want, "int",
                        check=f"[ $(stat -c %Y stamp.txt) -eq {want} ]",
                        solution=[f"touch -d '{t} UTC' stamp.txt", "stat -c %Y stamp.txt"])
