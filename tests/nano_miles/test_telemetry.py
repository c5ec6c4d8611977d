"""metrics.jsonl, TensorBoard events, the live table and the PNG curves of a run directory."""
import json

import pytest

from nano_miles.telemetry import REQUIRED_KEYS, MetricsLog, format_header, format_row, read_metrics


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
    for name in ("reward_mean.png", "acc.png", "parity_mean.png"):
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
    for step in (1, 2, 3):
        log.log(_metrics(step))
    log.close()
    log = MetricsLog(tmp_path, resume_after_step=2, echo=lambda s: None)
    log.log(_metrics(3, reward_mean=9.0))
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["reward_mean"] == 9.0


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
