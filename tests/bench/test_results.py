"""bench/results.py: every bench records one line in bench/results.jsonl, or, with --dry-run, none."""
import argparse
import json

from bench import results


def test_a_dry_run_records_nothing_and_a_run_appends_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", str(tmp_path / "results.jsonl"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    ap = argparse.ArgumentParser()
    results.add_dry_run(ap)
    record = {"bench": "x", "value": 1}

    line = results.save(record, "x.json", dry_run=ap.parse_args(["--dry-run"]).dry_run)
    assert json.loads(line) == record
    assert not (tmp_path / "results.jsonl").exists() and not list((tmp_path / "out").iterdir())

    results.save(record, "x.json", dry_run=ap.parse_args([]).dry_run)
    assert [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()] == [record]
    assert json.loads((tmp_path / "out" / "x.json").read_text()) == record
