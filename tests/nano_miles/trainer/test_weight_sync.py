"""Weight sync into the real engine server process (tiny-random-qwen2, CPU, float32), every CPU transport.

The check that matters: after a sync, the engine's log-probs of what it samples equal the trainer's
log-probs of the same tokens (<= 1e-5 in fp32), after several updates in a row.
"""
import psutil
import pytest
import torch

from nano_miles import cli
from nano_miles.engine.weights import NonFiniteWeights, checksums
from nano_miles.rollout.batch import Trajectory, build_rollout_batch
from nano_miles.trainer.trainer import OptimConfig, Trainer, TrainerConfig
from nano_miles.trainer.config import SyncConfig
from nano_miles.trainer.weight_sync import WeightSync, WeightSyncError, choose_transport


def engine_rollouts(client, seed, n=4, max_new=10):
    """n real rollouts from the engine, collated; rewards alternate so GRPO has a signal."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 1024, (5 + i,), generator=g).tolist() for i in range(n)]
    outs = client.generate_batch(prompts, {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True})
    trajs = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        lps = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        trajs.append(Trajectory(prompt_ids=p, response_ids=o["output_ids"], response_logprobs=lps,
                                response_mask=[True] * len(lps), reward=float(i % 2), group_id="g",
                                weight_versions=[o["meta_info"]["weight_version"]]))
    return build_rollout_batch(trajs)


def max_diff(trainer, batch):
    lp = trainer.logprobs(batch)
    return (lp - batch.rollout_logprobs)[batch.loss_mask].abs().max().item()


def test_trainer_logprobs_match_the_engine_server(engine_client, tiny_model_path):
    trainer = Trainer(TrainerConfig(model=str(tiny_model_path), micro_batch_size=2, logprob_chunk=7))
    batch = engine_rollouts(engine_client, seed=10)
    served = engine_client.weights_checksum()["checksums"]  # the folder's weights, as the trainer's
    assert served == {n: c for n, c in checksums(trainer.named_weights()).items() if n in served}
    assert max_diff(trainer, batch) <= 1e-5
    m = trainer.train_step(batch, torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    assert m["logprob_diff_max"] <= 1e-5 and m["logprob_diff_mean"] <= 1e-6


@pytest.mark.parametrize("transport", ["distributed", "disk", "ipc"])
def test_engine_serves_the_trainers_weights_after_each_update(transport, engine_server, engine_client,
                                                              tiny_model_path, restore_engine_weights):
    trainer = Trainer(TrainerConfig(model=str(tiny_model_path), micro_batch_size=2,
                                    optim=OptimConfig(lr=1e-3)))
    adv = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    # 0.1 MiB buckets: the ~0.4 MiB tiny model goes in several buckets, several calls per sync.
    with WeightSync(trainer, engine_server.url, transport=transport, bucket_mb=0.1, verify=True) as ws:
        assert ws.transport == transport
        for step in range(3):
            batch = engine_rollouts(engine_client, seed=step)
            m = trainer.train_step(batch, adv)
            # Rollouts sampled after the previous sync are scored identically by the trainer.
            assert m["logprob_diff_max"] <= 1e-5, (step, m["logprob_diff_max"])
            stats = ws.sync(f"{transport}-{step}")
            assert stats["verified"] and stats["transport"] == transport and stats["buckets"] > 1
            assert stats["bytes"] == sum(p.numel() * 4 for p in trainer.params)
            # The trainer's buckets follow HF order, as the engine packs its weights: each bucket of
            # ipc/distributed is one copy on the engine; disk goes through the per-tensor path.
            assert stats["fast_path"] is (transport != "disk")
            assert set(stats["phases_ms"]) == {"pause", "prepare", "pack", "send", "free", "resume"}
            assert stats["engine_ms"]["total"] <= stats["phases_ms"]["send"]
            assert sum(stats["phases_ms"].values()) <= stats["ms"] + 0.01  # no millisecond counted twice
            if transport == "ipc":  # its send, split by both sides' clocks (one machine): parts of the send
                split = stats["send_ms"]
                assert set(split) == {"wake", "to_engine", "engine", "from_engine"}
                assert split["engine"] == stats["engine_ms"]["total"]
                assert all(ms >= 0 for ms in split.values())
                # (the last bucket's send, within all buckets' send; two clocks read apart)
                assert sum(split.values()) <= stats["phases_ms"]["send"] * 1.05 + 0.5
            assert engine_client.weight_version() == f"{transport}-{step}"
        batch = engine_rollouts(engine_client, seed=99)
        assert batch.weight_versions[0] == [f"{transport}-2"]
        assert max_diff(trainer, batch) <= 1e-5


def test_a_bf16_trainer_lr_1e6_step_reaches_an_fp32_engine(engine_server, engine_client, tiny_model_path,
                                                           restore_engine_weights):
    trainer = Trainer(TrainerConfig(model=str(tiny_model_path), dtype="bfloat16", optim=OptimConfig(lr=1e-6)))
    before = engine_client.weights_checksum()["checksums"]
    with WeightSync(trainer, engine_server.url, transport="distributed", verify=True) as ws:
        trainer.train_step(engine_rollouts(engine_client, seed=3), torch.tensor([-1.0, 1.0, -1.0, 1.0]))
        ws.sync("bf16-1e-6")  # verify: the engine now holds exactly the FP32 masters
    after = engine_client.weights_checksum()["checksums"]
    assert sum(after[n] != before[n] for n in before) == len(before)  # every tensor moved
    # ...whereas the bf16 compute weights alone would have left most elements where they were.
    init = dict(Trainer(TrainerConfig(model=str(tiny_model_path), dtype="bfloat16")).named_weights())
    same = sum(int((t == init[n]).sum()) for n, t in trainer.named_weights())
    assert same > 0.5 * sum(t.numel() for t in init.values())


def listening_addresses(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_the_rendezvous_store_listens_on_master_address_only(engine_server, tiny_model_path, restore_engine_weights):
    """torch's TCPStore listens on every interface; anyone who reaches it could join the group."""
    trainer = Trainer(TrainerConfig(model=str(tiny_model_path)))
    with WeightSync(trainer, engine_server.url, transport="distributed", master_address="127.0.0.1") as ws:
        ws.sync("bound-1")
        assert ws.store_port and listening_addresses(ws.store_port) == {"127.0.0.1"}


def test_verify_catches_weights_the_engine_does_not_serve(engine_server, engine_client, tiny_model_path,
                                                          restore_engine_weights):
    trainer = Trainer(TrainerConfig(model=str(tiny_model_path)))
    with WeightSync(trainer, engine_server.url, transport="disk") as ws:
        ws.sync("v-ok")
        ws.verify("v-ok")
        with torch.no_grad():
            trainer.params[-1].add_(1e-3)  # changed on the trainer, never synced
        with pytest.raises(WeightSyncError, match="1 tensor"):
            ws.verify()
        with pytest.raises(WeightSyncError, match="weight_version"):
            ws.verify("v-other")
        ws.sync("v-fixed")
        ws.verify("v-fixed")


def test_a_refused_update_raises_and_the_engine_keeps_its_weights(engine_server, engine_client):
    before = engine_client.weights_checksum()
    bad = [("model.norm.weight", torch.ones(3))]  # wrong shape
    for transport in ["ipc", "distributed"]:
        with WeightSync(bad, engine_server.url, transport=transport) as ws:
            with pytest.raises(WeightSyncError, match="shape"):
                ws.sync("never")
    assert engine_client.weights_checksum() == before
    with pytest.raises(ValueError, match="transport"):
        SyncConfig(transport="nccl")
    with pytest.raises(ValueError, match="bucket_mb"):
        SyncConfig(bucket_mb=0)


@pytest.mark.parametrize("key,value,use", [("transport", "staged", "sync.transport=distributed"),
                                           ("pause_mode", "drain", "sync.pause_mode=in_place"),
                                           ("pause_mode", "retract", "sync.pause_mode=in_place"),
                                           ("pause_mode", "abort", "sync.pause_mode=in_place")])
def test_a_removed_transport_or_pause_mode_is_one_line_naming_what_to_use(key, value, use, capsys):
    assert cli.main(["train", "--set", f"sync.{key}={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"sync.{key}={value} is no longer offered: use {use}" + (
        " (NCCL: what auto picks for a GPU without P2P)" if value == "staged" else "")), err
    assert len(err.splitlines()) == 1
    assert SyncConfig(pause_mode="auto").pause_mode == "auto"  # what configs saved before hold: in place


@pytest.mark.parametrize("transport", ["ipc", "distributed", "disk", "shared"])
def test_non_finite_weights_are_never_sent(transport, engine_server, engine_client, tiny_model_path,
                                           restore_engine_weights):
    """Weights holding a NaN (here in the LAST tensor, past several buckets) are a training failure:
    sync sends none of them, on any transport, and the engine keeps its weights and version."""
    trainer = Trainer(TrainerConfig(model=str(tiny_model_path)))
    with torch.no_grad():
        trainer.masters[-1].view(-1)[0] = float("nan")
    before, version = engine_client.weights_checksum(), engine_client.weight_version()
    with WeightSync(trainer, engine_server.url, transport=transport, bucket_mb=0.1) as ws:
        with pytest.raises(NonFiniteWeights, match=f"version nan-1 hold NaN or infinite values in {trainer.names[-1]}"):
            ws.sync("nan-1")
    assert engine_client.weights_checksum() == before and engine_client.weight_version() == version
    assert engine_client.server_info()["internal_states"][0]["paused"] is False  # the pause asked at the sync's start is undone


def test_a_trainers_buckets_are_checked_as_they_come(engine_server, engine_client, tiny_model_path,
                                                     restore_engine_weights):
    """A trainer's weights come a bucket at a time (iter_full_weights: with N ranks each is gathered as
    it is needed): each is checked before it is sent, the first one here."""
    trainer = Trainer(TrainerConfig(model=str(tiny_model_path)))
    with torch.no_grad():
        trainer.masters[0].view(-1)[0] = float("inf")
    before, version = engine_client.weights_checksum(), engine_client.weight_version()
    with WeightSync(trainer, engine_server.url, transport="distributed", bucket_mb=0.1) as ws:
        with pytest.raises(NonFiniteWeights, match=f"NaN or infinite values in {trainer.names[0]}"):
            ws.sync("inf-1")
    assert engine_client.weights_checksum() == before and engine_client.weight_version() == version
    # It failed before the sync waited for the engine's pause: the engine is continued all the same.
    assert engine_client.server_info()["internal_states"][0]["paused"] is False
    assert engine_client.generate_batch([[5, 6, 7]], {"max_new_tokens": 2, "ignore_eos": True})[0]["output_ids"]


def test_auto_transport_follows_the_layout():
    cpu, local = torch.device("cpu"), ["http://127.0.0.1:30000"]
    assert choose_transport(cpu, [{"device": "cpu"}], local) == "distributed"
    cuda = torch.device("cuda:0")
    assert choose_transport(cuda, [{"device": "cpu"}], local) == "disk"
    assert choose_transport(cuda, [{"device": "cuda:0"}, {"device": "cuda:1"}], local * 2) == "distributed"
    assert choose_transport(cuda, [{"device": "cuda:1"}], ["http://10.0.0.7:30000"]) == "distributed"
    if torch.cuda.device_count() == 0:  # the engine's GPU is not visible here: only a collective reaches it
        assert choose_transport(cuda, [{"device": "cuda:1"}], local) == "distributed"


def test_one_broadcast_updates_two_engines(engine_server, engine_client, tiny_model_path, restore_engine_weights):
    """The distributed transport is the path to many engines: one group, one broadcast per bucket."""
    from nano_miles.engine.process import start_engine_process

    trainer = Trainer(TrainerConfig(model=str(tiny_model_path), optim=OptimConfig(lr=1e-3)))
    with start_engine_process(str(tiny_model_path), device="cpu", dtype="float32",
                              extra_args=("--num-kv-blocks", "256", "--dist-timeout", "30")) as second:
        with WeightSync(trainer, [engine_server.url, second.url], transport="auto", verify=True) as ws:
            assert ws.transport == "distributed"
            for step in range(2):
                trainer.train_step(engine_rollouts(engine_client, seed=20 + step), torch.tensor([-1.0, 1.0, -1.0, 1.0]))
                ws.sync(f"two-{step}")  # verify: both engines hold exactly the trainer's weights
        client = second.client(timeout=60)
        batch = engine_rollouts(client, seed=30)
        assert batch.weight_versions[0] == ["two-1"] and max_diff(trainer, batch) <= 1e-5
        client.close()


@pytest.fixture(scope="module")
def bf16_engine(tiny_model_path):
    """A second real server, in bfloat16 on CPU: the GPU setting's dtype, where parity is fragile."""
    from nano_miles.engine.process import start_engine_process

    with start_engine_process(str(tiny_model_path), device="cpu", dtype="bfloat16",
                              extra_args=("--num-kv-blocks", "512", "--dist-timeout", "30")) as engine:
        yield engine


def test_bf16_trainer_matches_a_bf16_engine_at_long_positions(bf16_engine, tiny_model_path):
    """Casting the whole model to bf16 also rounds RoPE's inv_freq; the rotation angles then drift
    with the position (about 2e-2 nats of mismatch here). The trainer keeps buffers in FP32."""
    client = bf16_engine.client(timeout=120)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (20, 300, 900)]
    outs = client.generate_batch(prompts, {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True})
    batch = build_rollout_batch([Trajectory(
        prompt_ids=p, response_ids=o["output_ids"], response_mask=[True] * len(o["output_ids"]),
        response_logprobs=[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for p, o in zip(prompts, outs)])
    trainer = Trainer(TrainerConfig(model=str(tiny_model_path), dtype="bfloat16", micro_batch_size=3))
    assert all(b.dtype == torch.float32 for n, b in trainer.model.named_buffers() if "inv_freq" in n)
    diff = (trainer.logprobs(batch) - batch.rollout_logprobs)[batch.loss_mask].abs()
    assert diff.mean().item() <= 5e-3, diff.mean().item()
    with pytest.raises(ValueError, match="inv_freq"):
        Trainer(TrainerConfig(dtype="bfloat16"), model=trainer.model.to(torch.bfloat16))
    client.close()


def test_bf16_trainer_syncs_its_bf16_weights_into_a_bf16_engine(bf16_engine, tiny_model_path):
    trainer = Trainer(TrainerConfig(model=str(tiny_model_path), dtype="bfloat16", optim=OptimConfig(lr=1e-3)))
    client = bf16_engine.client(timeout=120)
    with WeightSync(trainer, bf16_engine.url, transport="auto", verify=True) as ws:
        for step in range(2):
            trainer.train_step(engine_rollouts(client, seed=step), torch.tensor([-1.0, 1.0, -1.0, 1.0]))
            assert ws.sync(f"bf16-{step}")["verified"]  # the engine holds exactly the bf16 compute weights
        batch = engine_rollouts(client, seed=5)
        assert (trainer.logprobs(batch) - batch.rollout_logprobs)[batch.loss_mask].abs().mean() <= 5e-3
    client.close()


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["auto"])
def test_gpu_sync_and_bf16_parity(transport, tiny_model_path):
    """On the device: a bf16 engine on the trainer's GPU (auto -> CUDA IPC; NCCL refuses two ranks on
    one GPU, see the next test); the bf16 trainer scores the engine's samples within 5e-3 nats on
    average, after every sync."""
    from nano_miles.engine.process import start_engine_process

    with start_engine_process(str(tiny_model_path), device="cuda:0", dtype="bfloat16",
                              extra_args=("--num-kv-blocks", "256")) as engine:
        client = engine.client(timeout=120)
        trainer = Trainer(TrainerConfig(model=str(tiny_model_path), device="cuda:0", dtype="bfloat16",
                                        micro_batch_size=4, optim=OptimConfig(lr=1e-4)))
        with WeightSync(trainer, engine.url, transport=transport, verify=True) as ws:
            assert ws.transport == ("ipc" if transport == "auto" else transport)
            for step in range(3):
                m = trainer.train_step(engine_rollouts(client, seed=step), torch.tensor([-1.0, 1.0, -1.0, 1.0]))
                assert m["logprob_diff_mean"] <= 5e-3, (step, m["logprob_diff_mean"])
                stats = ws.sync(f"gpu-{step}")
                assert stats["verified"] and stats["fast_path"]  # one copy on the engine
        client.close()


@pytest.mark.gpu
def test_gpu_distributed_to_the_trainers_own_gpu_is_a_clear_error(tiny_model_path):
    from nano_miles.engine.process import start_engine_process

    with start_engine_process(str(tiny_model_path), device="cuda:0", dtype="bfloat16",
                              extra_args=("--num-kv-blocks", "64")) as engine:
        trainer = Trainer(TrainerConfig(model=str(tiny_model_path), device="cuda:0", dtype="bfloat16"))
        with pytest.raises(ValueError, match="NCCL refuses two ranks on one device"):
            WeightSync(trainer, engine.url, transport="distributed")


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["ipc", "distributed"])
def test_gpu_sync_to_an_engine_on_another_gpu(transport, tiny_model_path):
    """Trainer on cuda:0, engine process on cuda:1 (P2P IPC, or NCCL)."""
    from nano_miles.engine.process import start_engine_process

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    with start_engine_process(str(tiny_model_path), device="cuda:1", dtype="bfloat16",
                              extra_args=("--num-kv-blocks", "256", "--dist-timeout", "60")) as engine:
        client = engine.client(timeout=120)
        trainer = Trainer(TrainerConfig(model=str(tiny_model_path), device="cuda:0", dtype="bfloat16",
                                        micro_batch_size=4, optim=OptimConfig(lr=1e-4)))
        with WeightSync(trainer, engine.url, transport=transport, verify=True, timeout_s=60) as ws:
            for step in range(2):
                trainer.train_step(engine_rollouts(client, seed=step), torch.tensor([-1.0, 1.0, -1.0, 1.0]))
                stats = ws.sync(f"{transport}-{step}")
                assert stats["verified"] and stats["fast_path"]  # one (cross-GPU for ipc) copy on the engine
            batch = engine_rollouts(client, seed=9)
            assert (trainer.logprobs(batch) - batch.rollout_logprobs)[batch.loss_mask].abs().mean() <= 5e-3
        client.close()


def test_a_dead_engine_is_unavailable_not_a_reason_to_change_transport(engine_server, tiny_model_path,
                                                                         restore_engine_weights):
    """An engine killed before a shared sync used to make `auto` fall back to 'distributed', whose
    rendezvous then waited minutes for the dead engine, instead of the loop restarting it."""
    import socket

    from nano_miles.engine.client import EngineClient, EngineUnavailable

    trainer = Trainer(TrainerConfig(model=tiny_model_path, device="cpu"))
    with WeightSync(trainer, engine_server.url, transport="auto", allow_shared=True) as ws:
        assert ws.transport == "shared"
        with socket.socket() as s:  # a port nobody listens on: the engine is gone
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        ws.urls, ws.clients = [dead], [EngineClient(dead, timeout=5)]
        with pytest.raises(EngineUnavailable, match="unavailable"):
            ws.sync("1")
        assert ws.transport == "shared"


def test_an_engine_that_paused_is_resumed_when_another_could_not_pause(engine_server, engine_client,
                                                                        tiny_model_path, restore_engine_weights):
    """With several engines, one unreachable at a sync's pause must not leave the others paused: the
    loop restarts the dead one, and a live one left paused would park every request sent to it."""
    import socket

    from nano_miles.engine.client import EngineClient, EngineUnavailable

    trainer = Trainer(TrainerConfig(model=tiny_model_path, device="cpu"))
    with WeightSync(trainer, engine_server.url, transport="disk") as ws:
        with socket.socket() as s:  # a port nobody listens on: that engine is gone
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        ws.urls, ws.clients = [engine_server.url, dead], [ws.clients[0], EngineClient(dead, timeout=5)]
        with pytest.raises(EngineUnavailable, match="unavailable"):
            ws.sync("1")
    assert engine_client.server_info()["internal_states"][0]["paused"] is False
