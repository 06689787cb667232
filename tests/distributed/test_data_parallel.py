"""Two gloo processes train exactly like one process with the same global batch."""

import torch

from tests.conftest import char_overrides, check, read_metrics, run_pretrain


def _losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def test_two_process_data_parallel_matches_single_process(tmp_path):
    common = ["recipes/shakespeare-char.yaml", *char_overrides(tmp_path)[:3], "training.iters=5",
              "training.log_interval=1", "training.eval_interval=0", "training.eval_iters=2",
              "training.global_batch_size=8", "training.micro_batch_size=4", "training.sample_tokens=0"]
    # One process accumulates 2 micro-batches; two processes take one each, read by a
    # data-loader worker process (which must not change the batches either).
    check(run_pretrain([*common, f"logging.dir={tmp_path}/one"]))
    proc = check(run_pretrain([*common, f"logging.dir={tmp_path}/two", "data.num_workers=1",
                               "logging.all_ranks=true"], nproc=2))
    # logging.all_ranks: both ranks print, each line marked with its rank.
    assert "[rank 0] model: " in proc.stdout and "[rank 1] model: " in proc.stdout
    for rank in (0, 1):
        assert sum(line.startswith(f"[rank {rank}] step ") for line in proc.stdout.splitlines()) == 5
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(one) == len(two) == 5
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=0, atol=1e-5)
    val = [[r["val_loss"] for r in read_metrics(tmp_path / d) if "val_loss" in r] for d in ("one", "two")]
    torch.testing.assert_close(torch.tensor(val[1]), torch.tensor(val[0]), rtol=0, atol=1e-5)


def test_missing_dataset_fails_every_rank_quickly(tmp_path):
    proc = run_pretrain(["recipes/shakespeare-char.yaml", f"data.prefix={tmp_path}/none_text_document",
                         "data.build_from=null", "training.micro_batch_size=6",
                         f"logging.dir={tmp_path}/run"], nproc=2, timeout=180)
    assert proc.returncode != 0
    assert "preprocess_data.py" in proc.stderr


def test_resume_with_a_different_data_parallel_size_continues_the_same_stream(tmp_path):
    common = ["recipes/shakespeare-char.yaml", *char_overrides(tmp_path)[:3], "training.log_interval=1",
              "training.eval_interval=0", "training.eval_iters=1", "training.global_batch_size=8",
              "training.micro_batch_size=4", "training.sample_tokens=0"]
    check(run_pretrain([*common, "training.iters=6", f"logging.dir={tmp_path}/full"]))
    # Interrupted at step 3 on one process, resumed on two.
    ck = [f"checkpoint.dir={tmp_path}/ck", "checkpoint.save_interval=3"]
    check(run_pretrain([*common, *ck, "training.iters=3", f"logging.dir={tmp_path}/a"]))
    check(run_pretrain([*common, *ck, "training.iters=6", f"logging.dir={tmp_path}/b"], nproc=2))
    full = _losses(tmp_path / "full")
    resumed = [r for r in read_metrics(tmp_path / "b") if "loss" in r]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in resumed]), torch.tensor(full[3:]),
                               rtol=0, atol=1e-5)


def test_node_local_index_cache_is_built_on_every_node(tmp_path, sp_data):
    """Two single-process 'nodes' (torchrun --nnodes 2 on one machine), each with its own cache
    directory: with data.cache_shared=false each node's local rank 0 builds its indices."""
    import subprocess
    import sys

    from tests.conftest import NO_TENSORBOARD, REPO, _free_port, cpu_env

    def launch(shared: bool, run: str) -> list[str]:
        port = _free_port()
        args = ["recipes/quickstart.yaml", f"data.prefix={sp_data}/works_text_document",
                f"data.tokenizer.model={sp_data}/sp.model", "model.n_layers=1", "data.seq_length=32",
                "training.micro_batch_size=2", "training.global_batch_size=4", "training.iters=1",
                "training.eval_iters=1", "training.sample_tokens=0", f"data.cache_shared={shared}",
                f"logging.dir={tmp_path}/{run}", NO_TENSORBOARD]
        procs = []
        for node in range(2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   str(REPO / "pretrain.py"), *args,
                   f"data.cache_dir={tmp_path}/cache-{run}-{node}"]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=300)[0] for p in procs]
        caches = [sorted(x.name for x in (tmp_path / f"cache-{run}-{n}").glob("*.json")) for n in range(2)]
        return [p.returncode for p in procs], outs, caches

    codes, outs, caches = launch(False, "local")
    assert codes == [0, 0], outs
    assert len(caches[0]) == 2 and caches[0] == caches[1]
    # Claiming a shared cache that is not shared: the second node finds no index and says why.
    codes, outs, caches = launch(True, "shared")
    assert codes[1] != 0 and "data.cache_shared=false" in outs[1]
    assert len(caches[0]) == 2 and caches[1] == []
