"""Token-in-token-out (TITO) multi-turn rollouts over one or many engines.

Per episode the prefix is a list of token ids that only ever grows:

    prompt | act_1 | obs_1 | act_2 | obs_2 | ... | act_K

- act_k: the engine's output_ids exactly as returned (stop token included; no_stop_trim), with the
  engine's log-probs, loss mask True (generation stops at `</bash>` or `</answer>`: stop_at_action_end).
- obs_k: the observation turn (close the assistant turn if the model did not, the tool output, the
  next assistant header) encoded ON ITS OWN, log-prob 0.0, loss mask False.
The full history is never re-encoded: re-encoding the rendered text can merge BPE pieces across a
turn boundary and shift every later token away from the log-prob it was sampled with (a real case:
tests/nano_miles/rollout/test_tito.py). Engines are reached only through SGLang's /generate protocol;
a group goes to one engine (its shared prompt hits the prefix cache): engine/pool.py's GroupRouter.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import time
import uuid
from dataclasses import dataclass, field

from nano_miles.engine.client import EngineError, EngineUnavailable
from nano_miles.engine.pool import EnginePool, GroupRouter
from nano_miles.rollout.anatomy import EpisodeClock
from nano_miles.rollout.batch import Trajectory
from nano_miles.rollout.chat_format import ChatFormat
from nano_miles.rollout.env import ACTION_END_TAGS, EnvConfig, OpenShellEnv, answer_from
from nano_miles.tasks.api import SetupError, Task, TaskUnavailable


@dataclass
class RolloutConfig:
    group_size: int = 4              # samples per task (a GRPO group: same files, same ground truth)
    max_new_tokens: int = 256        # tokens the model may write per turn
    temperature: float = 1.0         # sampling temperature; train's log-probs are of softmax(logits / T), the distribution sampled (0 = greedy: eval only)
    top_p: float = 1.0               # nucleus sampling mass (1 = off)
    top_k: int = -1                  # sample among the k likeliest tokens (-1 = off)
    stop_at_action_end: bool = True  # a turn ends at </bash> or </answer>: text after an action is never sampled, run or trained on (a policy can drift into long tails there)
    max_concurrency: int = 64        # episodes in flight at once (each holds a sandbox)
    request_timeout: float = 600.0   # seconds per /generate call, queueing included (slow CPU engines)
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self):
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


class ScriptedPolicy:
    """An engine for guided groups (guidance.py): the task's scripted commands, then its answer (or the
    last output, as `nano-miles tasks check` does)."""

    def __init__(self, fmt: ChatFormat, env: OpenShellEnv):
        self.fmt, self.env = fmt, env
        self.commands = list(env.instance.solution)

    async def generate(self, input_ids=None, sampling_params=None, return_logprob=True, rid=None) -> dict:
        if self.commands:
            text = f"<bash>{self.commands.pop(0)}</bash>"
        else:
            answer = self.env.instance.solution_answer
            text = f"<answer>{answer_from(self.env.last_observation) if answer is None else answer}</answer>"
        ids = self.fmt.tokenizer.encode(text, add_special_tokens=False)
        meta = {"output_token_logprobs": [[0.0, i, None] for i in ids], "finish_reason": {"type": "stop"},
                "weight_version": "scripted"}  # (a scripted trajectory keeps no versions)
        return {"output_ids": ids, "meta_info": meta}


def sampling_params(cfg: RolloutConfig, fmt: ChatFormat, max_new_tokens: int) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p,
            "top_k": cfg.top_k, "stop_token_ids": fmt.stop_ids, "no_stop_trim": True,
            "stop": list(ACTION_END_TAGS) if cfg.stop_at_action_end else [],
            "skip_special_tokens": False, "spaces_between_special_tokens": False}


def parse_generate_response(resp: dict) -> tuple[list[int], list[float], str, str]:
    """Output ids, their log-probs, the finish type and the weight version."""
    try:
        meta = resp["meta_info"]
        ids = [int(i) for i in resp["output_ids"]]
        # SGLang: output_token_logprobs = [[logprob, token_id, text_or_null], ...]
        lps = [float(e[0]) for e in meta["output_token_logprobs"]]
        if [int(e[1]) for e in meta["output_token_logprobs"]] != ids:
            raise ValueError("output_token_logprobs token ids differ from output_ids")
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise ValueError(f"malformed /generate response ({e}): {str(resp)[:300]}") from e
    fr = meta.get("finish_reason") or {}
    # Staleness is measured on a turn's oldest tokens: our engine reports their weights when an update
    # landed mid-request (oldest_weight_version); SGLang reports only the version it finished with.
    version = meta.get("oldest_weight_version", meta.get("weight_version", ""))
    return ids, lps, (fr.get("type", "") if isinstance(fr, dict) else str(fr)), str(version)


def group_key(task: Task, seed: int, index: int) -> tuple[int, str]:
    """The task seed (shared by a group's samples: same files and ground truth) and the group id."""
    task_seed = seed * 100_003 + index
    return task_seed, f"{task.id}-s{task_seed}"


def _no_episode(task: Task, group_id: str, finish_reason: str, components: dict) -> Trajectory:
    """An episode that never started (its setup failed, or the task cannot run here)."""
    return Trajectory([], [], [], [], reward=0.0, reward_components=components, num_turns=0,
                      finish_reason=finish_reason, task_id=task.id, group_id=group_id)


async def run_episode(client, fmt: ChatFormat, task: Task, seed: int, group_id: str,
                      cfg: RolloutConfig, sandbox_factory=None, executor=None, scripted: bool = False,
                      clock: EpisodeClock | None = None) -> Trajectory:
    """Play one episode against one engine; sandbox work runs on `executor` (None: asyncio's default).
    scripted: no engine (client is None); the turns are the task's scripted solution (ScriptedPolicy),
    through the same environment and token path. clock, if given, gets where the episode's wall went."""
    env = OpenShellEnv(task, seed, cfg.env, sandbox_factory)
    loop = asyncio.get_running_loop()
    clock = clock or EpisodeClock()
    try:
        t = time.perf_counter()
        try:
            messages = await loop.run_in_executor(executor, env.reset)
        except TaskUnavailable as e:  # cannot run on this machine: skipped, with the reason
            return _no_episode(task, group_id, "unavailable", {"unavailable": str(e)})
        except SetupError as e:
            return _no_episode(task, group_id, "infra_error", {"infra_failures": 1, "error": str(e)})
        finally:
            clock.sandbox_s += time.perf_counter() - t
        if scripted:
            client = ScriptedPolicy(fmt, env)
        prompt = fmt.prompt_ids(messages)
        # prompt + resp_ids is the prefix: only ever appended to, so each turn extends the last exactly
        resp_ids, resp_lps, resp_mask, versions = [], [], [], []
        while not env.done:
            budget = cfg.env.max_total_tokens - len(prompt) - len(resp_ids)
            if budget <= 0:
                env.end("token_budget")
                break
            t = time.perf_counter()
            try:
                out = await client.generate(input_ids=prompt + resp_ids, sampling_params=sampling_params(
                    cfg, fmt, min(cfg.max_new_tokens, budget)), return_logprob=True,
                    rid=f"{group_id}-{seed}-t{env.turns}-{uuid.uuid4().hex[:8]}")
            except EngineError as e:
                if isinstance(e, EngineUnavailable) or (e.status or 0) < 500:
                    raise
                # HTTP 500: the engine failed in a step (an OOM, a bug) and dropped the request. An
                # infrastructure failure, like a sandbox's: never trained on, left out of scores
                env.infra_failed(f"engine: {e}")
                break
            finally:
                clock.generate_s += time.perf_counter() - t
                clock.turns += 1
            clock.answered(out.get("meta_info") or {})
            out_ids, out_lps, finish, version = parse_generate_response(out)
            versions.append(version)
            if finish == "abort":
                env.end("abort")  # the engine was asked to drop the request (a pause, a shutdown)
            resp_ids += out_ids
            resp_lps += out_lps
            resp_mask += [True] * len(out_ids)
            if env.done:
                break
            action = fmt.tokenizer.decode(out_ids, skip_special_tokens=True)
            step = await loop.run_in_executor(executor, env.step, action)  # commands and verifiers block
            clock.timed_out += step.kind == "timeout"
            if step.done:
                break
            obs = fmt.observation_ids(step.observation, out_ids[-1] if out_ids else None)
            if len(prompt) + len(resp_ids) + len(obs) >= cfg.env.max_total_tokens:
                env.end("token_budget")  # no room for the next turn: stop before the observation
                break
            resp_ids += obs
            resp_lps += [0.0] * len(obs)
            resp_mask += [False] * len(obs)
        components = dict(env.components)
        if env.infra_error:
            components["error"] = env.infra_error
        return Trajectory(
            prompt_ids=prompt, response_ids=resp_ids, response_logprobs=resp_lps, response_mask=resp_mask,
            reward=env.reward, reward_components=components, num_turns=len(versions),
            finish_reason=env.finish_reason, task_id=task.id, group_id=group_id,
            weight_versions=[] if scripted else versions, scripted=scripted)
    finally:
        # In a worker thread, after whatever setup or command is in flight (env.close waits for it).
        # Cancels that land meanwhile (rollout_groups cancels the rest on a first error, asyncio.run
        # cancels what is left) must not end the episode before its sandbox is gone.
        t = time.perf_counter()
        try:
            await wait_out(loop.run_in_executor(executor, env.close))
        finally:
            clock.sandbox_s += time.perf_counter() - t + env.exec_s
            clock.ended = time.perf_counter()


async def wait_out(future: asyncio.Future):
    """future's result, however many times we are cancelled while it runs; then the cancel is raised."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return future.result()


async def cancel_all(jobs) -> None:
    """Cancel `jobs` and wait until every one has ended (an episode closes its sandbox first)."""
    for j in jobs:
        j.cancel()
    await wait_out(asyncio.gather(*jobs, return_exceptions=True))


async def settle(jobs: list[asyncio.Future]) -> list:
    """The results of `jobs`, in order. On the first error or our own cancellation: cancel the rest,
    wait until every one has ended (each episode closes its sandbox first), then raise."""
    if not jobs:
        return []
    try:
        await asyncio.wait(jobs, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        if not all(j.done() for j in jobs):
            await cancel_all(jobs)
    errors = [j.exception() for j in jobs if not j.cancelled() and j.exception() is not None]
    if errors:
        raise errors[0]
    return [j.result() for j in jobs]


class GroupRunner:
    """Plays groups over `engines` (URLs, or an EnginePool), at most cfg.max_concurrency episodes at
    once, inside one running event loop (`await close()` when done). An episode whose engine dies runs
    again from its start on another engine; with none left its group fails with EngineUnavailable.
    on_episode_done() is called as each episode ends; clocks gets their EpisodeClocks (anatomy.py)."""

    def __init__(self, engines: list[str] | EnginePool, tokenizer, cfg: RolloutConfig, sandbox_factory=None,
                 on_episode_done=None):
        self.pool = engines if isinstance(engines, EnginePool) else EnginePool.of(list(engines))
        if not self.pool.replicas:
            raise ValueError("rollout_groups needs at least one engine URL")
        self.fmt = tokenizer if isinstance(tokenizer, ChatFormat) else ChatFormat(tokenizer)
        self.cfg, self.sandbox_factory = cfg, sandbox_factory
        self.on_episode_done, self.clocks = on_episode_done, []
        self.router = GroupRouter(self.pool, cfg.request_timeout)
        self.sem = asyncio.Semaphore(cfg.max_concurrency)
        # one worker per episode in flight (+ room for closes queued behind a cancelled episode's command)
        self.threads = concurrent.futures.ThreadPoolExecutor(max_workers=2 * cfg.max_concurrency,
                                                             thread_name_prefix="episode")

    async def episode(self, task: Task, task_seed: int, group_id: str) -> Trajectory:
        async with self.sem:
            while True:
                replica, generation = self.router.pick(group_id)
                clock = EpisodeClock(replica=replica.url)
                try:
                    traj = await run_episode(self.router.client(replica), self.fmt, task, task_seed, group_id,
                                             self.cfg, self.sandbox_factory, self.threads, clock=clock)
                    self.clocks.append(clock)
                    break
                except EngineUnavailable as e:  # its sandbox is closed; run it again elsewhere, if any
                    self.pool.fail(replica, generation, e)
                    if not self.pool.serving():
                        raise
                finally:
                    self.router.done(replica)
        if self.on_episode_done is not None:
            self.on_episode_done()
        return traj

    async def group(self, task: Task, task_seed: int, group_id: str) -> list[Trajectory]:
        """The group's episodes, those without a prompt (setup failed, unavailable) included."""
        return await settle([asyncio.ensure_future(self.episode(task, task_seed, group_id))
                             for _ in range(self.cfg.group_size)])

    async def scripted(self, task: Task, task_seed: int, group_id: str) -> Trajectory:
        async with self.sem:
            return await run_episode(None, self.fmt, task, task_seed, group_id, self.cfg, self.sandbox_factory,
                                     self.threads, scripted=True)

    def stats(self, tasks: list[Task], episodes: list[Trajectory]) -> dict:
        """rollout_groups' `stats` for the episodes the groups of `tasks` played; the losses on stderr."""
        failed = [t for t in episodes if t.broken and not t.prompt_ids]
        unavailable = {t.task_id: t.reward_components["unavailable"] for t in episodes
                       if t.finish_reason == "unavailable"}
        if failed:
            print(f"rollout: {len(failed)} episode(s) lost to sandbox setup failures, e.g. "
                  f"{failed[0].reward_components.get('error', '')}", file=sys.stderr)
        if unavailable:
            print(f"rollout: {len(unavailable)} of {len({t.id for t in tasks})} task(s) cannot run here and are left "
                  "out of every score:\n" + "\n".join(f"  {why}" for why in unavailable.values()), file=sys.stderr)
        return {"engine_requests": self.router.counts(), "setup_failures": len(failed), "unavailable": unavailable,
                "setup_errors": [t.reward_components.get("error", "") for t in failed[:3]]}

    async def close(self) -> None:
        self.threads.shutdown(wait=False)  # queued closes still run; the threads finish before the process exits
        await self.router.close()


async def rollout_groups(engines: list[str] | EnginePool, tokenizer, tasks: list[Task], cfg: RolloutConfig,
                         seed: int = 0, sandbox_factory=None, stats: dict | None = None,
                         on_episode_done=None) -> list[Trajectory]:
    """G samples of every task, all episodes concurrently, grouped in task order; with no engine left,
    EngineUnavailable (the caller decides whether to retry). stats, if given, gets engine_requests
    (/generate calls per engine), setup_failures and the first setup_errors, unavailable ({task id:
    reason}): such episodes have no prompt and are left out. Later sandbox or engine failures stay in,
    with finish_reason "infra_error" and reward 0: training and evaluation leave them out and count them."""
    runner = GroupRunner(engines, tokenizer, cfg, sandbox_factory, on_episode_done)
    try:
        groups = await settle([asyncio.ensure_future(runner.group(task, *group_key(task, seed, g)))
                               for g, task in enumerate(tasks)])
        episodes = [t for group in groups for t in group]
        (stats if stats is not None else {}).update(runner.stats(tasks, episodes))
        return [t for t in episodes if t.prompt_ids]
    finally:
        await runner.close()
