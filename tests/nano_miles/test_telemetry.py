"""metrics.jsonl, TensorBoard events, W&B, the live table, the PNG curves and the summary of a run."""
import importlib.util
import json
import struct

import pytest

from nano_miles.config import ConfigError
from nano_miles.telemetry import (REQUIRED_KEYS, MetricsLog, format_header, format_row, parse_report_to, read_metrics,
                                  run_summary)


def _metrics(step, **extra):
    m = dict(step=step, reward_mean=0.1 * step, acc=0.125 * step, pg_loss=0.5, clip_frac=0.1,
             parity_mean=1e-3, parity_max=2e-3, sync_ms=12.5, mem_gb=3.7, step_s=2.0,
             weight_version=str(step), tokens_per_s=1000.0, turns_mean=1.5, staleness_max=0)
    m.update(extra)
    return m


def test_run_directory_contents(tmp_path):
    printed = []
    log = MetricsLog(tmp_path, echo=printed.append)
    for step in (1, 2, 3):
        log.log(_metrics(step))
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(set(REQUIRED_KEYS) <= set(r) for r in rows)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    for name in ("reward_mean.png", "acc.png", "entropy.png", "parity_mean.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert printed[0] == format_header() and len(printed) == 4
    assert "12.5%" in printed[1]


def test_missing_keys_are_refused(tmp_path):
    log = MetricsLog(tmp_path, echo=lambda s: None)
    with pytest.raises(ValueError, match="lack keys"):
        log.log({"step": 1})
    log.close()


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    log = MetricsLog(tmp_path, echo=lambda s: None)
    log.log_eval({"eval_pass_at_1": 0.125})
    for step in (1, 2, 3):
        log.log(_metrics(step))
    log.close()
    MetricsLog(tmp_path, resume_after_step=0, echo=lambda s: None).close()  # no checkpoint: the run starts over
    assert read_metrics(tmp_path / "metrics.jsonl") == []
    log = MetricsLog(tmp_path, echo=lambda s: None)
    log.log_eval({"eval_pass_at_1": 0.125})
    for step in (1, 2, 3):
        log.log(_metrics(step))
    log.close()
    log = MetricsLog(tmp_path, resume_after_step=2, echo=lambda s: None)
    log.log(_metrics(3, reward_mean=9.0))
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[-1]["reward_mean"] == 9.0


def test_row_formats_missing_values_as_dash():
    row = format_row({"step": 1, "reward_mean": None, "acc": float("nan")})
    assert row.split()[:3] == ["1", "-", "-"]


def test_true_on_policy_parity_that_is_not_zero_is_an_error_line(tmp_path):
    printed = []
    log = MetricsLog(tmp_path, echo=printed.append)
    log.log(_metrics(1, true_on_policy=True, parity_mean=0.0, parity_max=0.0))
    log.log(_metrics(2, true_on_policy=True, parity_mean=1e-9, parity_max=2e-7))  # one token off: not averaged away
    log.log(_metrics(3, parity_max=2e-3))                                          # normal mode: parity is noise
    log.close()
    errors = [line for line in printed if line.startswith("ERROR")]
    assert len(errors) == 1 and "step 2" in errors[0] and "2.000e-07" in errors[0]
    assert printed.index(errors[0]) == 3  # right under step 2's row
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r.get("parity_error") for r in rows] == [False, True, None]


def test_the_live_table_shows_the_whole_runs_elapsed_time_and_eta():
    row = format_row(_metrics(3, elapsed_s=75.4, eta_s=3723.0)).split()
    assert row[-2:] == ["1:15", "1:02:03"] and format_header().split()[-2:] == ["elapsed", "ETA"]


def test_the_run_ends_with_a_summary_of_what_it_did_and_where_the_files_are(tmp_path):
    log = MetricsLog(tmp_path, echo=lambda s: None)
    for step, reward, acc in ((1, -0.05, 0.125), (2, 0.2, 0.25), (3, 0.31, 0.5)):
        log.log(_metrics(step, reward_mean=reward, acc=acc))
    log.close()
    (tmp_path / "final").mkdir()
    assert run_summary(read_metrics(tmp_path / "metrics.jsonl"), 245.0, tmp_path) == [
        "summary: 3 steps, 4:05 wall time",
        "  reward    -0.050 (step 1) -> +0.310 (step 3)",
        "  accuracy  12.5% (step 1) -> 50.0% (step 3)",
        f"  files     {tmp_path}/: metrics.jsonl, tensorboard/, reward_mean.png, acc.png, entropy.png, parity_mean.png, final/",
        f"  policy    nano-miles eval --model {tmp_path / 'final'}   (or: nano-miles serve --model {tmp_path / 'final'})"]
    assert run_summary([], 3.0, tmp_path) == [f"no step completed in 0:03; run directory {tmp_path}"]


def test_the_summary_says_which_training_tasks_still_teach_the_policy_anything(tmp_path):
    """train_by_task ([solved, samples] a task rolled out) summed over the last 10 steps: a task always
    solved or never solved gives dynamic sampling nothing to keep."""
    rows = [_metrics(1, train_by_task={"a": [0, 8], "old": [8, 8]})] + \
           [_metrics(step, train_by_task={"a": [8, 8], "b": [0, 8], "c": [step % 2 * 8, 8]}) for step in range(2, 12)]
    summary = run_summary(rows, 60.0, tmp_path)
    assert summary[3] == "  tasks     steps 2-11: of 3 training tasks rolled out, 1 always solved, 1 never, 1 sometimes"
    assert not any(line.startswith("  tasks") for line in run_summary([_metrics(1)], 6.0, tmp_path))  # none recorded


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} from a run's TensorBoard event files, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_evaluations_get_their_curve_their_scalars_and_a_summary_line(tmp_path):
    """eval_* columns (eval_every) are in the rows of the steps that evaluated; TensorBoard gets them as
    scalars at those steps, eval_pass_at_1.png draws them, and the summary shows first -> last."""
    printed = []
    log = MetricsLog(tmp_path, echo=printed.append)
    log.log_eval({"eval_pass_at_1": 0.125, "eval_seconds": 4.0})  # the base policy, before step 1
    log.log(_metrics(1))
    log.log(_metrics(2, eval_pass_at_1=0.25, eval_alfa_pass_at_1=0.1, eval_seconds=3.5))
    log.log(_metrics(3))
    log.log(_metrics(4, eval_pass_at_1=0.5, eval_alfa_pass_at_1=0.2, eval_seconds=3.0))
    log.close()
    assert len(printed) == 5  # the header and one row a training step: step 0 is no table row
    scalars = tensorboard_scalars(tmp_path)
    assert scalars["eval_pass_at_1"] == [(0, 0.125), (2, 0.25), (4, 0.5)]
    assert [s for s, _ in scalars["eval_seconds"]] == [0, 2, 4]
    assert (tmp_path / "eval_pass_at_1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = run_summary(read_metrics(tmp_path / "metrics.jsonl"), 10.0, tmp_path)
    assert summary[:3] == ["summary: 4 steps, 0:10 wall time", "  reward    +0.100 (step 1) -> +0.400 (step 4)",
                           "  accuracy  12.5% (step 1) -> 50.0% (step 4)"]
    assert "  eval      pass@1 on eval_tasks: 0.125 (step 0) -> 0.500 (step 4)" in summary
    assert "  eval      pass@1 on ALFA subset: 0.100 (step 2) -> 0.200 (step 4)" in summary
    assert "eval_pass_at_1.png" in summary[-1]
    # A run that never evaluated draws no eval curve.
    quiet = tmp_path / "quiet"
    log = MetricsLog(quiet, echo=lambda s: None, report_to="none")
    log.log(_metrics(1))
    log.close()
    assert not (quiet / "eval_pass_at_1.png").exists()


def test_report_to_none_writes_metrics_jsonl_alone(tmp_path):
    log = MetricsLog(tmp_path, echo=lambda s: None, report_to="none")
    log.log(_metrics(1))
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]
    assert not (tmp_path / "tensorboard").exists()
    with pytest.raises(ValueError, match="report_to: unknown 'mlflow'"):
        parse_report_to("tensorboard,mlflow")


def _wandb_history(run_dir) -> list[dict]:
    """The history rows of an offline W&B run: its run-*.wandb file is a LevelDB-style log (32 KiB
    blocks of records: crc32, length, type) of protobuf Records, after a 7-byte ':W&B' header."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, pending, rows = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length, kind) == (0, 0):  # block padding
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_report_to_wandb_logs_every_step_offline_or_says_how_to_get_it(tmp_path, monkeypatch):
    """With wandb installed, WANDB_MODE=offline writes the run under run_dir/wandb/ with every step's
    metrics, no account and no network needed. Without it, one line says what to install."""
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ConfigError, match=r"report_to=wandb needs the wandb package: `pip install wandb`"):
            MetricsLog(tmp_path, echo=lambda s: None, report_to="tensorboard,wandb")
        assert not (tmp_path / "metrics.jsonl").exists()
        return
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLog(tmp_path, echo=lambda s: None, report_to="tensorboard,wandb", config={"optim": {"lr": 1e-6}})
    for step in (1, 2, 3):
        log.log(_metrics(step, infra_errors=["not a scalar"]))
    log.close()
    rows = [r for r in _wandb_history(tmp_path) if "reward_mean" in r]
    assert [(r["_step"], r["reward_mean"], r["acc"], r["sync_ms"]) for r in rows] == [
        (s, 0.1 * s, 0.125 * s, 12.5) for s in (1, 2, 3)]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))  # both reporters
    assert (tmp_path / "wandb_id").read_text() in {p.name.rsplit("-", 1)[-1] for p in tmp_path.glob("wandb/offline-run-*")}
