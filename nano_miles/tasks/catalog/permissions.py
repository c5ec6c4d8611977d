"""permissions: reading and setting file modes (stat, chmod, find -perm, umask)."""
import random

from nano_miles.tasks.api import TaskInstance, Workspace, q
from nano_miles.tasks.catalog.common import ask, builtin, distinct_tokens, skill, token


@builtin("make_executable", "permissions", "train", "chmod +x a script and run it")
def make_executable(ws: Workspace, rng: random.Random) -> TaskInstance:
    ws.write("hello.sh", f"#!/bin/sh\necho {token(rng, 10)}\n", mode=0o644)
    return TaskInstance("Make hello.sh executable, run it as ./hello.sh and answer with what it prints.",
                        ws.run("sh hello.sh"), "text", check="[ -x hello.sh ]",
                        solution=["chmod +x hello.sh", "./hello.sh"])


@builtin("octal_mode", "permissions", "train", "octal permission bits of a file (stat)")
def octal_mode(ws, rng):
    ws.write("report.txt", "data\n", mode=rng.choice([0o600, 0o640, 0o644, 0o700, 0o750, 0o755, 0o444, 0o664]))
    return ask(ws, "What are the permission bits of report.txt in octal (like 644)? Answer with them.",
               "stat -c %a report.txt")


@builtin("world_writable_file", "permissions", "train", "the one file writable by others (find -perm)")
def world_writable_file(ws, rng):
    names = distinct_tokens(rng, rng.randint(4, 10))
    holder = rng.choice(names)
    for n in names:
        mode = rng.choice([0o666, 0o646, 0o777, 0o602]) if n == holder else \
            rng.choice([0o644, 0o640, 0o600, 0o755, 0o664, 0o775, 0o700])
        ws.write(f"shared/{n}.cfg", "k=v\n", mode=mode)
    return ask(ws, "Exactly one file in shared/ can be written by others (the world-write permission bit). Which "
               "one? Answer with its file name only (like name.cfg).",
               "find shared -type f -perm -o+w | xargs -n1 basename")


@builtin("strip_other_perms", "permissions", "train", "remove all permissions for others (chmod o-rwx)")
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


# ---- held-out: training never sees these -----------------------------------------------------------

@builtin("set_mode", "permissions", "heldout", "set a file's permission bits (chmod)")
def set_mode(ws, rng):
    mode = rng.choice(["640", "600", "750", "444", "711"])
    ws.write("secret.key", token(rng, 32), mode=0o666)
    return TaskInstance(f"Set the permissions of secret.key to {mode} (octal), then answer with the output of "
                        "`stat -c %A secret.key`.", ws.run(f"f=$(mktemp) && chmod {mode} $f && stat -c %A $f; rm -f $f"),
                        "text", check=f"[ $(stat -c %a secret.key) = {mode} ]",
                        solution=[f"chmod {mode} secret.key", "stat -c %A secret.key"])


@builtin("count_executables", "permissions", "heldout", "number of executable files in a directory")
def count_executables(ws, rng):
    for _ in range(rng.randint(4, 12)):
        ws.write(f"bin/{token(rng, 5)}", "#!/bin/sh\n", mode=rng.choice([0o755, 0o644, 0o700, 0o600]))
    return ask(ws, "How many files in bin/ have the owner-execute permission bit set? Answer with the number.",
               "find bin -type f -perm -u+x | wc -l", "int")


# ---- the opt-in skills set (nano_miles.tasks.catalog_skills) --------------------------------------

@skill("umask_create", "permissions", "train", "the mode a new file gets under a umask")
def umask_create(ws, rng):
    u = rng.choice(["027", "077", "022", "007", "037", "002", "033", "026"])
    mode = ws.run(f"d=$(mktemp -d) && umask {u} && touch $d/f && stat -c %a $d/f && rm -rf $d")
    return TaskInstance(f"With the umask set to {u}, create a new empty file private.log in the current directory "
                        "(do not chmod it). Then answer with the output of `stat -c %a private.log`.", mode, "text",
                        check=f"[ -f private.log ] && [ ! -s private.log ] && [ $(stat -c %a private.log) = {mode} ]",
                        solution=[f"umask {u} && touch private.log", "stat -c %a private.log"])


@skill("find_exact_mode", "permissions", "train", "the file with given symbolic permissions (find -perm MODE)")
def find_exact_mode(ws, rng):
    modes = rng.sample(["600", "640", "644", "660", "664", "700", "750", "755", "444", "400", "711"], rng.randint(4, 8))
    for n, m in zip(distinct_tokens(rng, len(modes)), modes):
        ws.write(f"etc/{n}.conf", "k=v\n", mode=int(m, 8))
    m = rng.choice(modes)
    sym = ws.run(f"find etc -type f -perm {m} -exec stat -c %A {{}} + | cut -c2-")
    return TaskInstance(f"Which file in etc/ has exactly the permissions {sym} (as `ls -l` shows them)? Answer with "
                        "its file name only (like name.conf).", ws.run(f"find etc -type f -perm {m} -printf '%f\\n'"),
                        "text", solution=[f"cd etc && stat -c '%A %n' * | awk '$1 == \"-{sym}\" {{print $2}}'"])


@skill("normalize_modes", "permissions", "train", "755 for every directory, 644 for every file (find -exec chmod)")
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
