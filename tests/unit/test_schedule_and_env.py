import pytest

from megatron_lite.config.schema import OptimizerConfig, ScheduleConfig
from megatron_lite.distributed.launcher_env import detect
from megatron_lite.optim.schedule import LRSchedule, lr_at, schedule_to_follow

OPT = OptimizerConfig(lr=1.0, min_lr=0.1)


def test_warmup_then_cosine_to_min():
    s = ScheduleConfig(warmup_iters=10, decay_style="cosine")
    assert lr_at(0, OPT, s, 110) == pytest.approx(1 / 11)
    assert lr_at(9, OPT, s, 110) == pytest.approx(10 / 11)
    assert lr_at(10, OPT, s, 110) == pytest.approx(1.0)
    assert lr_at(60, OPT, s, 110) == pytest.approx(0.55)  # half-way: mean of lr and min_lr
    assert lr_at(110, OPT, s, 110) == pytest.approx(0.1)
    assert lr_at(500, OPT, s, 110) == pytest.approx(0.1)


def test_linear_and_constant():
    assert lr_at(5, OPT, ScheduleConfig(decay_style="linear"), 10) == pytest.approx(0.55)
    assert lr_at(7, OPT, ScheduleConfig(decay_style="constant"), 10) == 1.0


@pytest.mark.parametrize("env, expected", [
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"},
     (3, 1, 8, "h0", 1234, "torchrun")),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
     (5, 2, 6, "127.0.0.1", 29500, "openmpi")),
    ({"PMI_RANK": "7", "PMI_SIZE": "8", "PALS_LOCAL_RANKID": "3", "MASTER_ADDR": "x3001"},
     (7, 3, 8, "x3001", 29500, "mpich")),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"},
     (1, 1, 2, "127.0.0.1", 29500, "slurm")),
])
def test_launcher_environments(env, expected):
    e = detect(env)
    assert (e.rank, e.local_rank, e.world_size, e.master_addr, e.master_port, e.launcher) == expected


@pytest.mark.parametrize("env, expected", [
    # Cray PALS (Polaris mpiexec)
    ({"PMI_RANK": "6", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "2", "PMI_LOCAL_SIZE": "4"}, (6, 2, 8, 4, "mpich")),
    # MPICH's Hydra mpiexec
    ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
     (3, 1, 4, 2, "mpich")),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "5",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, (5, 5, 16, 8, "openmpi")),
    ({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "8(x2)"},
     (9, 1, 16, 8, "slurm")),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (1, 1, 2, 2, "torchrun")),
])
def test_local_rank_and_ranks_per_node(env, expected):
    e = detect(env)
    assert (e.rank, e.local_rank, e.world_size, e.local_world_size, e.launcher) == expected


@pytest.mark.parametrize("nodelist, first", [
    ("nid[0012-0015,0020]", "nid0012"), ("gpu7,gpu9", "gpu7"), ("x1000c0s0b0n0", "x1000c0s0b0n0"),
    ("a[3,5-7],b[1-2]", "a3"),
])
def test_master_address_from_slurm_nodelist(nodelist, first):
    e = detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": nodelist})
    assert e.master_addr == first


def test_master_address_from_pbs_nodefile(tmp_path):
    (tmp_path / "nodes").write_text("x3001c0s1b0n0\nx3001c0s1b0n0\nx3002c0s1b0n0\n")
    e = detect({"PMI_RANK": "0", "PMI_SIZE": "8", "PBS_NODEFILE": str(tmp_path / "nodes")})
    assert e.master_addr == "x3001c0s1b0n0"


def test_single_process_defaults():
    # Port 0: the store's server binds a free port itself. A port chosen here and bound later
    # could be taken meanwhile by another process (EADDRINUSE, seen with two runs side by side).
    e = detect({})
    assert (e.rank, e.world_size, e.launcher, e.master_port) == (0, 1, "none", 0)


def test_schedules_that_differ_only_in_the_past_give_the_same_rates_from_here():
    from megatron_lite.optim.schedule import LRSchedule

    short = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=100, decay_style="cosine", decay_end=200)
    longer = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=100, decay_style="cosine", decay_end=400)
    assert short.differences(longer) == ["decay_end 200 -> 400"]
    assert not short.same_rates_from(longer, 50)  # the decays differ after the warm-up
    # 3 or 6 steps inside a 100-step warm-up (then min_lr in both): the same rates throughout.
    in_warmup = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=100, decay_style="cosine", decay_end=6)
    assert in_warmup.same_rates_from(LRSchedule(1.0, 0.1, 100, "cosine", 3), 3)
    # Flat at min_lr from step 10 on in both: only the past differs.
    a = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=2, decay_style="linear", decay_end=8)
    b = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=2, decay_style="cosine", decay_end=8)
    assert not a.same_rates_from(b, 3) and a.same_rates_from(b, 8)


def test_the_console_line_ends_with_the_eta_and_the_time_to_the_limit():
    from megatron_lite.logging.metrics import console_line, duration

    record = {"step": 100, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "step_time_ms": 250.0,
              "tokens_per_sec": 1.0, "tokens_per_sec_per_device": 1.0, "tflops_per_device": 0.0,
              "mfu": None, "memory_gib": 1.0}
    # 900 steps left at 0.25 s: 225 s.
    assert console_line(record, 1000).endswith(" | ETA 3m45s")
    assert console_line(record, 1000, time_left=4000.4).endswith(" | ETA 3m45s (time limit in 1h06m)")
    assert [duration(s) for s in (0, 59.6, 61, 3600, -5)] == ["0s", "1m00s", "1m01s", "1h00m", "0s"]


def test_a_console_line_reaches_the_shared_pipe_in_one_write():
    """Ranks share one stdout pipe and batch jobs often run unbuffered (PYTHONUNBUFFERED=1):
    a line written as text and newline separately lets another rank's line in between."""
    import io

    from megatron_lite.logging.console import emit_line

    class Unbuffered(io.StringIO):
        def __init__(self):
            super().__init__()
            self.writes = []

        def write(self, s):
            self.writes.append(s)
            return super().write(s)

    out = Unbuffered()
    emit_line("[rank 1] step      1/5 | loss 4.1960", out)
    emit_line("error: the reason", out)
    assert out.writes == ["[rank 1] step      1/5 | loss 4.1960\n", "error: the reason\n"]


@pytest.mark.parametrize("shape, middle", [("linear", 0.55), ("cosine", 0.55),
                                           ("sqrt", 0.1 + (1 - 0.5**0.5) * 0.9),
                                           ("minus_sqrt", 0.1 + (1 - 0.5**0.5) * 0.9)])
def test_warmup_stable_decay_holds_the_rate_then_cools_down(shape, middle):
    """lr 1 → 0.1, 10 warm-up steps, decay end 110, a 0.2 cooldown: steps 90..110, rates by hand."""
    wsd = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=10, decay_style="wsd", decay_end=110,
                     decay_fraction=0.2, decay_shape=shape)
    assert wsd.at(0) == pytest.approx(1 / 11) and wsd.at(10) == 1.0
    assert wsd.at(50) == 1.0 and wsd.at(90) == 1.0  # stable, up to the cooldown's first step
    assert wsd.at(100) == pytest.approx(middle)
    assert wsd.at(95) > wsd.at(100) > wsd.at(105) > 0.1
    assert wsd.at(110) == 0.1 and wsd.at(500) == 0.1


def test_a_checkpoint_schedule_from_before_wsd_still_loads():
    saved = {"lr": 1.0, "min_lr": 0.1, "warmup_iters": 2, "decay_style": "cosine", "decay_end": 8}
    running = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=2, decay_style="cosine", decay_end=8)
    assert schedule_to_follow(saved, running, 4, "step 4", "check", print) == running
