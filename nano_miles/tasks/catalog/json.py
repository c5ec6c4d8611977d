"""json: reading and editing JSON and JSON-lines files (python3 -c)."""
import json
import random

from nano_miles.tasks.api import TaskInstance, Workspace, q
from nano_miles.tasks.catalog.common import SHA, WORDS, ask, builtin, skill, token


@builtin("json_field", "json", "train", "a nested field of a JSON file (python3 -c)")
def json_field(ws: Workspace, rng: random.Random) -> TaskInstance:
    port, host = rng.randint(1024, 65535), f"{rng.choice(WORDS)}.internal"
    cfg = {"service": {"name": rng.choice(WORDS), "net": {"host": host, "port": port}},
           "debug": rng.random() < 0.5, "workers": rng.randint(1, 16)}
    ws.write("config.json", json.dumps(cfg, indent=2))
    return ask(ws, "What is the value of service.net.port in config.json? Answer with the number.",
               "python3 -c 'import json; print(json.load(open(\"config.json\"))[\"service\"][\"net\"][\"port\"])'",
               "int")


@builtin("json_keys", "json", "train", "top-level keys of a JSON object, sorted (python3 -c)")
def json_keys(ws, rng):
    keys = rng.sample(WORDS, rng.randint(3, 8))
    obj = {k: rng.choice([rng.randint(0, 999), token(rng, 5), rng.random() < 0.5,
                          {w: rng.randint(0, 9) for w in rng.sample(WORDS, 2)}]) for k in keys}
    ws.write("meta.json", json.dumps(obj, indent=2))
    return ask(ws, "meta.json holds one JSON object. What are its top-level keys? Answer with them in alphabetical "
               "order, separated by commas with no spaces (like a,b,c).",
               "python3 -c 'import json; print(\",\".join(sorted(json.load(open(\"meta.json\")))))'")


@builtin("json_lookup", "json", "train", "a field of the JSON record with a given id")
def json_lookup(ws, rng):
    ids = rng.sample(range(100, 999), rng.randint(5, 15))
    users = [{"id": i, "name": rng.choice(WORDS),
              "email": f"{token(rng, 5)}@{rng.choice(WORDS)}.{rng.choice(['com', 'org', 'net'])}"} for i in ids]
    ws.write("users.json", json.dumps(users, indent=1))
    uid = rng.choice(ids)
    return ask(ws, f"users.json is a JSON list of user records. What is the email address of the user whose id is "
               f"{uid}? Answer with the address.", "python3 -c 'import json; print([u[\"email\"] for u in "
               f"json.load(open(\"users.json\")) if u[\"id\"] == {uid}][0])'")


# ---- held-out: training never sees these -----------------------------------------------------------

@builtin("json_count", "json", "heldout", "number of items in a JSON list matching a condition")
def json_count(ws, rng):
    users = [{"name": token(rng, 6), "active": rng.random() < 0.5, "age": rng.randint(18, 80)}
             for _ in range(rng.randint(8, 30))]
    ws.write("users.json", json.dumps({"users": users}))
    return ask(ws, "users.json has a list under the key \"users\"; how many users have \"active\": true? Answer "
               "with the number.", "python3 -c 'import json; print(sum(u[\"active\"] for u in "
               "json.load(open(\"users.json\"))[\"users\"]))'", "int")


@builtin("json_sum", "json", "heldout", "sum of a numeric field across JSON records")
def json_sum(ws, rng):
    items = [{"sku": token(rng, 4), "stock": rng.randint(0, 300)} for _ in range(rng.randint(5, 20))]
    ws.write("inventory.json", json.dumps(items, indent=1))
    return ask(ws, "inventory.json is a list of records with a \"stock\" field. What is the total stock? Answer "
               "with the number.", "python3 -c 'import json; print(sum(i[\"stock\"] for i in "
               "json.load(open(\"inventory.json\"))))'", "int")


@builtin("json_write", "json", "heldout", "write a JSON file with given keys")
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


# ---- the opt-in skills set (nano_miles.tasks.catalog_skills) --------------------------------------

@skill("json_top_value", "json", "train", "the JSON record with the largest price times stock (python3 -c)")
def json_top_value(ws, rng):
    names = rng.sample(WORDS, rng.randint(4, 12))
    items: list[dict] = []
    while len({i["price"] * i["stock"] for i in items}) < len(names):  # no two values alike: no tie
        items = [{"name": n, "price": rng.randint(1, 200), "stock": rng.randint(1, 50)} for n in names]
    ws.write("products.json", json.dumps(items, indent=2))
    return ask(ws, "products.json is a list of products with a price and a stock. Which product has the largest "
               "stock value (price times stock)? Answer with its name.", "python3 -c 'import json; print(max("
               "json.load(open(\"products.json\")), key=lambda p: p[\"price\"] * p[\"stock\"])[\"name\"])'")


@skill("json_bump", "json", "train", "change one nested value of a JSON file in place")
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


@skill("jsonl_ids", "json", "train", "filter a JSON-lines file into a file of ids")
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
