"""OpenShellEnv: protocol parsing, observations, reward components, limits.

Everything runs in the real sandbox.
"""
import pytest

from nano_miles.rollout.env import FORMAT_ERROR, PROMPT_EXAMPLES, EnvConfig, OpenShellEnv, format_output, parse_action
from nano_miles.tasks import get_task


@pytest.fixture
def make_env():
    envs = []

    def make(task_id="kernel_name", seed=0, **cfg):
        env = OpenShellEnv(get_task(task_id), seed, EnvConfig(**cfg))
        env.reset()
        envs.append(env)
        return env
    yield make
    for e in envs:
        e.close()


def test_parse_action():
    assert parse_action("let me look\n<bash> ls -la </bash> then") == ("bash", "ls -la")
    assert parse_action("<answer>42</answer><bash>rm x</bash>") == ("answer", "42")
    assert parse_action("<bash>echo a</bash> <answer>1</answer>") == ("bash", "echo a")
    assert parse_action("<bash>ls") is None            # unclosed
    assert parse_action("I think the answer is 4") is None
    assert parse_action("<bash>printf 'a\nb'</bash>") == ("bash", "printf 'a\nb'")


def test_format_output_truncates_with_marker():
    class R:
        exit_code, timed_out, truncated = 0, False, False
        stdout, stderr = "x" * 5000, "warn\n"
    cfg = EnvConfig(max_observation_chars=100)
    out = format_output(R, cfg)
    assert out.startswith("x" * 100) and "more characters cut]" in out and out.endswith("[exit code 0]")
    assert len(out) < 200


def test_exec_observation_and_shaping_cap(make_env):
    env = make_env(max_turns=10)
    step = env.step("<bash>echo hello; echo oops >&2; exit 3</bash>")
    assert not step.done and step.kind == "exec"
    assert step.observation == "hello\n[stderr]\noops\n[exit code 3]"
    assert env.components["exec_ok"] == 0.0           # exit 3 earns no shaping
    for _ in range(4):                                 # repeating `true` pays once
        env.step("<bash>true</bash>")
    assert env.components["exec_ok"] == pytest.approx(0.1)
    step = env.step("<answer>wrong</answer>")
    assert step.done and env.components["correct"] == 0.0
    assert env.reward == pytest.approx(0.1) and env.finish_reason == "answer"
    with pytest.raises(RuntimeError, match="is over"):
        env.step("<bash>ls</bash>")
    wider = make_env(max_turns=10, exec_ok_cap=0.2)    # a wider cap: distinct commands pay up to it
    for cmd in ("pwd", "ls", "date", "id"):
        wider.step(f"<bash>{cmd}</bash>")
    assert wider.components["exec_ok"] == pytest.approx(0.2)


def test_padding_a_solved_episode_with_more_commands_earns_nothing(make_env):
    """The exploit policies found under a two-command cap: solve, then run a harmless second command
    for another +0.1. By default one working command is all the shaping pays."""
    solved, padded = make_env("kernel_name"), make_env("kernel_name")
    for env, commands in ((solved, ["uname -s"]), (padded, ["uname -s", "echo 'no more to do'; exit 0"])):
        for cmd in commands:
            env.step(f"<bash>{cmd}</bash>")
        env.step(f"<answer>{env.instance.expected}</answer>")
    assert solved.reward == padded.reward == pytest.approx(1.1)


def test_an_episode_without_an_answer_forfeits_the_shaping(make_env):
    """Running commands until the turn limit or the token budget never pays more than answering."""
    env = make_env(max_turns=3, exec_ok_cap=0.2)
    for cmd in ("pwd", "ls"):
        env.step(f"<bash>{cmd}</bash>")
    assert env.components["exec_ok"] == pytest.approx(0.2)
    step = env.step("<bash>id</bash>")
    assert step.done and env.finish_reason == "max_turns"
    assert env.components["exec_ok"] == 0.0 and env.reward == 0.0
    budget = make_env(max_turns=10)
    budget.step("<bash>pwd</bash>")
    budget.end("token_budget")
    assert budget.finish_reason == "token_budget" and budget.components["exec_ok"] == 0.0


def test_format_errors_are_penalised_and_explained(make_env):
    env = make_env(max_turns=3)
    for text in ("no tags at all", "<bash>ls -la"):
        step = env.step(text)
        assert step.kind == "format_error" and step.observation == FORMAT_ERROR and not step.done
    step = env.step("")                                # third turn: the limit ends it
    assert step.done and env.finish_reason == "max_turns"
    assert env.components["format"] == pytest.approx(-0.3)
    assert env.reward == pytest.approx(-0.3)


def test_empty_and_refused_commands_are_the_policys_fault(make_env):
    env = make_env(max_turns=5)
    step = env.step("<bash>  </bash>")
    assert step.kind == "format_error" and step.observation == FORMAT_ERROR
    step = env.step("<bash>echo a\x00b</bash>")   # a NUL byte: the sandbox refuses it
    assert step.kind == "format_error" and step.observation.startswith("Command refused:") and "NUL" in step.observation
    assert env.components["format"] == pytest.approx(-0.2) and env.components["infra_failures"] == 0


def test_timeout_is_penalised(make_env):
    env = make_env(command_timeout=0.5)
    step = env.step("<bash>sleep 30</bash>")
    assert step.kind == "timeout" and "[timed out after 0.5s]" in step.observation
    assert env.components["timeout"] == pytest.approx(-0.1)


def test_garbage_output_from_the_sandbox(make_env):
    env = make_env(max_observation_chars=1000)
    step = env.step(r"<bash>printf 'ok\xff\xfe\x00end'</bash>")   # invalid UTF-8 and a NUL byte
    assert step.observation.startswith("ok") and "\ufffd" in step.observation
    step = env.step("<bash>seq 1 200000</bash>")                 # ~1.3 MB of output
    assert "more characters cut]" in step.observation or "output cut by the sandbox" in step.observation
    assert len(step.observation) < 1200


def test_correct_answer_and_seed_task(make_env):
    env = make_env("kernel_name")
    env.step("<bash>uname -s</bash>")
    step = env.step(f"<answer> {env.instance.expected} </answer>")
    assert step.done and env.components["correct"] == 1.0
    assert env.reward == pytest.approx(1.1)


def test_infra_failure_earns_nothing(make_env):
    env = make_env(max_turns=5)
    env.step("<bash>true</bash>")
    env.sandbox.close()            # the sandbox is gone under the episode: infrastructure, not policy
    step = env.step("<bash>ls</bash>")
    assert step.done and step.kind == "infra_error" and env.finish_reason == "infra_error"
    assert env.components["infra_failures"] == 1
    assert env.reward == 0.0


@pytest.mark.parametrize("example", list(PROMPT_EXAMPLES))
def test_the_prompt_example_is_what_the_sandbox_really_shows(make_env, example):
    """rollout.env.prompt_example picks the exchange before the task; replayed in a real sandbox,
    each of its commands gives exactly the observation the example shows."""
    env = make_env(max_turns=10, prompt_example=example)
    messages = env.messages()
    shots = messages[1:-1]
    assert messages[0]["role"] == "system" and messages[-1] == {"role": "user", "content": env.instance.instruction}
    assert [m["role"] for m in shots] == [r for r, _ in PROMPT_EXAMPLES[example]]
    assert shots[-1]["content"].startswith("<answer>")
    # the example's files: greeting.txt and notes/todo.txt, three lines each
    env.step("<bash>mkdir notes && printf 'a\\nb\\nc\\n' | tee greeting.txt > notes/todo.txt</bash>")
    for said, shown in zip(shots, shots[1:]):
        if said["role"] == "assistant" and shown["role"] == "tool":
            assert env.step(said["content"]).observation == shown["content"]


def test_an_unknown_prompt_example_is_one_clear_error():
    with pytest.raises(ValueError, match="prompt_example must be one of one_step, multi_step, got 'few_shot'"):
        EnvConfig(prompt_example="few_shot")
