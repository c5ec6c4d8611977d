"""The run's data order (nano_miles/rollout/task_stream.py): seeded, resumable, passing over
saturated tasks, and handing out first the tasks a checkpoint left pending."""
from nano_miles.rollout.task_stream import TaskStream
from nano_miles.tasks import select_tasks


def test_task_stream_is_seeded_and_resumable():
    tasks = select_tasks("train")
    a, b = TaskStream(tasks, seed=1), TaskStream(tasks, seed=1)
    first = [t.id for t in a.take(len(tasks) + 3)]  # across an epoch boundary
    assert sorted(first[:len(tasks)]) == sorted(t.id for t in tasks)  # each task once per epoch
    resumed = TaskStream(tasks, seed=1)
    resumed.restore({"position": 5, "passes": {}})  # a checkpoint's state after 5 tasks
    assert [t.id for t in resumed.take(4)] == first[5:9] and [t.id for t in b.take(3)] == first[:3]
    assert [t.id for t in TaskStream(tasks, seed=2).take(len(tasks))] != first[:len(tasks)]


def test_a_task_without_a_signal_is_passed_over_at_its_next_appearances_and_the_state_resumes():
    tasks = select_tasks("kernel_name,md5_file,nth_line,word_count_total")
    plain = [t.id for t in TaskStream(tasks, seed=3).take(16)]
    stream = TaskStream(tasks, seed=3, pass_over=2)
    assert [t.id for t in stream.take(4)] == plain[:4]  # nothing seen yet: the plain order
    saturated, taught = plain[0], plain[1]
    stream.saw(saturated, signal=False)
    stream.saw(taught, signal=False)
    stream.saw(taught, signal=True)  # a group with a signal clears the pass over
    assert stream.state() == {"position": 4, "passes": {saturated: 2}}
    saved = stream.state()
    taken = [t.id for t in stream.take(6)]  # epochs 1 and 2 pass it over, epoch 3 has it again
    assert taken == [t for t in plain[4:12] if t != saturated] and stream.position == 12
    assert stream.state() == {"position": 12, "passes": {}}
    assert [t.id for t in stream.take(4)] == plain[12:16]
    resumed = TaskStream(tasks, seed=3, pass_over=2)
    resumed.restore(saved)
    assert [t.id for t in resumed.take(6)] == taken
    old = TaskStream(tasks, seed=3, pass_over=2)
    old.restore(7)  # a checkpoint from before pass_over: its position, nothing to pass over
    assert old.state() == {"position": 7, "passes": {}}
    everything = TaskStream(tasks, seed=3, pass_over=1)  # every task saturated: each is passed over once
    for t in tasks:
        everything.saw(t.id, signal=False)
    assert [t.id for t in everything.take(2)] == plain[4:6] and everything.position == 6
    off = TaskStream(tasks, seed=3)  # pass_over 0: outcomes change nothing
    off.saw(plain[0], signal=False)
    assert [t.id for t in off.take(8)] == plain[:8]


def test_a_restored_stream_hands_out_its_pending_tasks_first_and_keeps_them_until_taken():
    tasks = select_tasks("kernel_name,md5_file,nth_line,word_count_total")
    plain = [t.id for t in TaskStream(tasks, seed=3).take(6)]
    stream = TaskStream(tasks, seed=3)
    stream.take(4)
    saved = stream.state(pending=[plain[1], "a_task_no_longer_in_the_set", plain[3]])
    assert saved == {"position": 4, "passes": {}, "pending": [plain[1], "a_task_no_longer_in_the_set", plain[3]]}
    resumed = TaskStream(tasks, seed=3)
    resumed.restore(saved)
    assert resumed.state() == {"position": 4, "passes": {}, "pending": [plain[1], plain[3]]}  # until taken
    assert [t.id for t in resumed.take(3)] == [plain[1], plain[3], plain[4]] and resumed.state()["position"] == 5
    assert "pending" not in resumed.state()
