"""hashing: digests, checksums, encodings and raw bytes (sha256sum, md5sum, base64, od)."""
import random

from nano_miles.tasks.api import TaskInstance, Workspace, q
from nano_miles.tasks.catalog.common import WORDS, ask, builtin, distinct_tokens, lines_of_words, skill, token


@builtin("sha256_string", "hashing", "train", "SHA-256 of a given string", seed_task=True)
def sha256_string(ws: Workspace, rng: random.Random) -> TaskInstance:
    s = f"{rng.choice(WORDS)}-{token(rng, 8)}"
    return ask(ws, f"Compute the SHA-256 hex digest of the string '{s}' (exactly those bytes, no trailing newline). "
               "Answer with the 64-character hex digest.", f"printf %s {q(s)} | sha256sum | cut -d' ' -f1", "hex")


@builtin("sha1_created_file", "hashing", "train", "create a file with a given line, then its SHA-1")
def sha1_created_file(ws, rng):
    s = f"{rng.choice(WORDS)} {token(rng, 8)}"
    return TaskInstance(f"Create a file greeting.txt whose content is exactly the line '{s}' followed by a "
                        "newline. Then answer with the SHA-1 hex digest of greeting.txt (40 hex characters).",
                        ws.run(f"printf '%s\\n' {q(s)} | sha1sum | cut -d' ' -f1"), "hex",
                        check=f"printf '%s\\n' {q(s)} | cmp -s - greeting.txt",
                        solution=[f"echo {q(s)} > greeting.txt", "sha1sum greeting.txt | cut -d' ' -f1"])


@builtin("checksum_mismatch", "hashing", "train", "the file that fails a SHA-256 checksum list (sha256sum -c)")
def checksum_mismatch(ws, rng):
    names = distinct_tokens(rng, rng.randint(4, 10))
    for n in names:
        ws.write(f"data/{n}.txt", " ".join(lines_of_words(rng, rng.randint(5, 20))) + "\n")
    ws.run("sha256sum data/*.txt > SHA256SUMS")
    ws.write(f"data/{rng.choice(names)}.txt", token(rng, 24) + "\n")
    return ask(ws, "SHA256SUMS lists the SHA-256 sums of the files in data/, but one file was changed after the "
               "list was made. Which one? Answer with its file name only (like name.txt).",
               "sha256sum -c SHA256SUMS 2>/dev/null | grep ': FAILED$' | cut -d: -f1 | xargs basename")


# ---- held-out: training never sees these -----------------------------------------------------------

@builtin("md5_file", "hashing", "heldout", "MD5 of a file")
def md5_file(ws, rng):
    ws.write("payload.bin", bytes(rng.getrandbits(8) for _ in range(rng.randint(50, 500))))
    return ask(ws, "What is the MD5 hex digest of payload.bin? Answer with the 32-character hex digest.",
               "md5sum payload.bin | cut -d' ' -f1", "hex")


@builtin("base64_decode", "hashing", "heldout", "decode a base64 string")
def base64_decode(ws, rng):
    s = f"{rng.choice(WORDS)}:{token(rng, 10)}"
    enc = ws.run(f"printf %s {q(s)} | base64")
    return ask(ws, f"Decode the base64 string {enc} and answer with the decoded text.", f"echo {q(enc)} | base64 -d")


# ---- the opt-in skills set (nano_miles.tasks.catalog_skills) --------------------------------------

@skill("identical_files", "hashing", "train", "the two files with the same content (sha1sum | uniq -w)")
def identical_files(ws, rng):
    names = distinct_tokens(rng, rng.randint(5, 9))
    blobs = [rng.randbytes(rng.randint(100, 400)) for _ in names]
    for n, data in zip(names, blobs[:-1] + [rng.choice(blobs[:-1])]):  # the last file copies another one
        ws.write(f"photos/{n}.jpg", data)
    return TaskInstance("Exactly two files in photos/ have the same content. Which ones? Answer with their two file "
                        "names in alphabetical order, separated by a comma (like a.jpg,b.jpg).",
                        ws.run("md5sum photos/* | sort | uniq -w32 -D | cut -d/ -f2 | sort | paste -sd,"), "text",
                        solution=["sha1sum photos/* | sort | uniq -w40 -D | cut -d/ -f2 | sort | paste -sd,"])


@skill("magic_bytes", "hashing", "train", "the first bytes of a binary file in hex (od -tx1)")
def magic_bytes(ws, rng):
    n = rng.randint(3, 8)
    ws.write("blob.bin", rng.randbytes(rng.randint(64, 512)))
    return TaskInstance(f"What are the first {n} bytes of blob.bin in hexadecimal? Answer with two hex digits per "
                        "byte and no spaces (like 7f454c46).", ws.run(f"od -An -tx1 -N{n} blob.bin | tr -d ' \\n'"),
                        "hex", solution=[f"head -c {n} blob.bin | od -An -tx1 | tr -d ' \\n'"])


@skill("byte_at_offset", "hashing", "train", "the value of the byte at an offset of a file (od -j -N)")
def byte_at_offset(ws, rng):
    size = rng.randint(200, 2000)
    ws.write("blob.bin", rng.randbytes(size))
    k = rng.randint(1, size - 1)
    return TaskInstance(f"What is the value (0 to 255) of the byte at offset {k} of blob.bin (the first byte is at "
                        "offset 0)? Answer with the number in decimal.",
                        ws.run(f"od -An -tu1 -j{k} -N1 blob.bin | tr -d ' '"), "int",
                        solution=[f"tail -c +{k + 1} blob.bin | head -c 1 | od -An -tu1"])
