"""The planner against hand-computed parameters, memory, FLOPs and step time."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lite.config import load_config
from megatron_lite.distributed.device import DEVICES, device_spec
from megatron_lite.model import build_model, count_parameters, resolve_model
from megatron_lite.planner import estimate, parameter_counts
from megatron_lite.planner.estimate import loss_bytes, step_time
from tests.conftest import RECIPE_ALLOCATION, REPO, _free_port, cpu_env, pretrain_main

LLAMA2_7B = 6_738_415_616  # huggyllama/llama-7b


def _cfg(recipe: str, *overrides: str):
    cfg = load_config(REPO / "recipes" / recipe, list(overrides))
    return cfg, resolve_model(cfg.model, None, cfg.data.seq_length, cfg.parallel.tensor)


@pytest.mark.parametrize("recipe, overrides", [
    ("llama2-7b.yaml", []), ("llama3-8b.yaml", []),
    ("gpt2-124m.yaml", ["model.vocab_size=50304"]),
    ("gpt2-124m.yaml", ["model.vocab_size=50304", "model.tie_embeddings=false"]),
    ("llama3-8b.yaml", ["model.qk_norm=true"]),
])
def test_parameter_count_matches_the_model(recipe, overrides):
    cfg, model = _cfg(recipe, *overrides)
    assert parameter_counts(model).total == count_parameters(build_model(model, "meta"))


def test_qk_norm_adds_two_head_widths_per_block_counted_as_norms():
    _, plain = _cfg("llama2-7b.yaml")
    _, qk = _cfg("llama2-7b.yaml", "model.qk_norm=true")
    more = 2 * 128 * 32  # a query and a key norm of head_dim 4096/32 in each of 32 blocks
    assert parameter_counts(qk).total - parameter_counts(plain).total == more
    assert parameter_counts(qk).block_norms - parameter_counts(plain).block_norms == 2 * 128


def test_llama2_7b_model_states():
    cfg, model = _cfg("llama2-7b.yaml", "parallel.zero_stage=0", "training.global_batch_size=8")
    assert parameter_counts(model).total == LLAMA2_7B
    one = estimate(cfg, model, 1, 1)
    # bf16 with Adam: 2 (weights) + 2 (gradients) + 12 (fp32 master, m, v) bytes per parameter.
    assert one.weights + one.grads + one.optimizer == 16 * LLAMA2_7B  # 107.8 GB
    assert round((one.weights + one.grads + one.optimizer) / 1e9, 1) == 107.8
    for stage, sharded in [(1, ("optimizer",)), (2, ("optimizer", "grads")),
                           (3, ("optimizer", "grads", "weights"))]:
        cfg_s, _ = _cfg("llama2-7b.yaml", f"parallel.zero_stage={stage}", "training.global_batch_size=8")
        eight = estimate(cfg_s, model, 8, 8)
        for part in ("weights", "grads", "optimizer"):
            want = getattr(one, part) / (8 if part in sharded else 1)
            assert getattr(eight, part) == pytest.approx(want, rel=1e-12), (stage, part)


def test_hsdp_shards_model_states_over_the_shard_group_only():
    cfg, model = _cfg("llama2-7b.yaml", "parallel.hsdp=true", "parallel.hsdp_shard_size=4",
                      "training.global_batch_size=16")
    plan = estimate(cfg, model, 16, 4)  # 4 nodes: 4 copies of a shard group of 4
    # bf16: 2 + 2 + 12 bytes per parameter, all divided by the 4 ranks of the shard group.
    assert (plan.weights, plan.grads, plan.optimizer) == (2 * LLAMA2_7B / 4, 2 * LLAMA2_7B / 4,
                                                          12 * LLAMA2_7B / 4)


def test_offload_moves_model_states_to_the_host_by_hand():
    from megatron_lite.planner import plan_report

    base = ["parallel.zero_stage=3", "training.global_batch_size=8"]
    cfg, model = _cfg("llama2-7b.yaml", *base, "parallel.offload_optimizer=cpu")
    plan = estimate(cfg, model, 8, 4)  # 2 nodes of 4
    # On the device: the bf16 weights' ZeRO-3 shard only. On the host: fp32 master (4), Adam
    # moments (8) and the fp32 gradient (4) of the shard.
    assert (plan.weights, plan.grads, plan.optimizer) == (2 * LLAMA2_7B / 8, 0, 0)
    assert plan.host == 16 * LLAMA2_7B / 8 and plan.nvme == 0
    cfg, _ = _cfg("llama2-7b.yaml", *base, "parallel.offload_optimizer=cpu", "parallel.offload_params=cpu")
    both = estimate(cfg, model, 8, 4)
    assert both.weights == 0 and both.host == 18 * LLAMA2_7B / 8
    cfg, _ = _cfg("llama2-7b.yaml", *base, "parallel.offload_optimizer=nvme", "parallel.nvme_path=/local")
    nvme = estimate(cfg, model, 8, 4)
    assert nvme.host == 0 and nvme.nvme == 16 * LLAMA2_7B / 8
    # One node of 4 holds 16 bytes per parameter: 107.8 GB of host memory.
    cfg, _ = _cfg("llama2-7b.yaml", *base, "parallel.offload_optimizer=cpu")
    lines, ok = plan_report(cfg, 4, 4, "A100-40GB", 0.4)  # a Polaris node: 512 GB
    assert ok and "107.81 per node of 512" in "\n".join(lines)
    lines, ok = plan_report(cfg, 4, 4, "A100-40GB", 0.4, host_memory_gb=100)
    assert not ok and "does NOT fit the host: 107.8 GB" in "\n".join(lines)


def test_tensor_and_pipeline_split_by_hand():
    cfg, model = _cfg("quickstart.yaml", "model.n_layers=4", "model.d_model=64", "model.n_heads=4",
                      "model.n_kv_heads=4", "model.ffn_hidden=128", "model.vocab_size=256",
                      "model.tie_embeddings=false", "parallel.tensor=2", "parallel.pipeline=2",
                      "parallel.pipeline_partition=type:Block", "parallel.zero_stage=1",
                      "training.precision=bf16", "training.micro_batch_size=2",
                      "training.global_batch_size=16", "data.seq_length=32")
    # block: q,k,v,o 4·64·64 + gate,up,down 3·64·128 + two RMSNorms 2·64 = 41,088
    # stage 1: blocks 2 and 3 + final norm (64) + output layer 256·64 = 98,624; tensor ranks
    # share all but the norms (2·128 + 64 = 320): (98,624 − 320) / 2 + 320 = 49,472
    plan = estimate(cfg, model, 8, 4)
    assert plan.stage_parameters == 49_472 and plan.stage_blocks == 2
    assert plan.dims.data == 2 and plan.grad_accumulation == 4 and plan.in_flight == 2
    assert plan.weights == 2 * 49_472 and plan.grads == 2 * 49_472
    assert plan.optimizer == 12 * 49_472 / 2  # ZeRO-1 over 2 data-parallel ranks


def test_activations_by_hand():
    cfg, model = _cfg("llama2-7b.yaml", "model.activation_checkpointing=false")
    # Per block, bf16, s = 4096, b = 1, h = 4096, h_kv = 4096, F = 11008:
    # 2 bytes · (4·s·h + s·(2h + 2h_kv + 3F)) = 538,968,064
    per_block = 2 * (4 * 4096 * 4096 + 4096 * (2 * 4096 + 2 * 4096 + 3 * 11008))
    assert per_block == 538_968_064
    plan = estimate(cfg, model, 4, 4)
    assert plan.activations == 32 * per_block
    # Recompute keeps each block's input (2·s·h bytes) plus one block's full set.
    assert plan.activations_if["full"] == 32 * 2 * 4096 * 4096 + per_block
    # Selective keeps the input, the matrix products' and attention's outputs:
    # 2 bytes · (3·s·h + s·(2h + 2h_kv + 2F)), plus one block's full set while recomputing.
    selective = 2 * (3 * 4096 * 4096 + 4096 * (2 * 4096 + 2 * 4096 + 2 * 11008))
    assert plan.activations_if["selective"] == 32 * selective + per_block
    assert plan.activations_if["none"] == plan.activations
    sp, _ = _cfg("llama2-7b.yaml", "model.activation_checkpointing=false", "parallel.tensor=4",
                 "parallel.sequence_parallel=true")
    assert estimate(sp, model, 4, 4).activations == 32 * per_block / 4


def test_flops_and_step_time_by_hand():
    cfg, model = _cfg("llama2-7b.yaml")
    plan = estimate(cfg, model, 8, 4)
    # 6 · (parameters − input embedding 32000·4096) + 12 · layers · d · seq
    fpt = 6 * (LLAMA2_7B - 32000 * 4096) + 12 * 32 * 4096 * 4096
    assert plan.flops_per_token == fpt
    seconds, tokens = step_time(plan, DEVICES["A100-40GB"], "bf16", 0.5)
    assert seconds == pytest.approx(fpt * 1024 * 4096 / (8 * 312e12 * 0.5))
    assert tokens == pytest.approx(1024 * 4096 / seconds)


@pytest.mark.parametrize("name, key", [
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"), ("GAUDI2", "GAUDI2"),
    ("gaudi3", "GAUDI3"), ("A100", "A100-40GB"), ("Intel(R) Data Center GPU Max 1550", "MAX1550"),
])
def test_device_names(name, key):
    assert device_spec(name) is DEVICES[key]
    assert device_spec("cpu") is None


def _plan(*args):
    return pretrain_main([*args, "--plan"])


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "recipes").glob("*.yaml")))
def test_plan_runs_on_every_recipe(recipe):
    out = _plan(f"recipes/{recipe}", *RECIPE_ALLOCATION.get(recipe, []))
    assert out.returncode == 0, out.stderr + out.stdout
    assert "memory per device" in out.stdout and "GFLOPs per token" in out.stdout


def test_plan_says_when_it_does_not_fit():
    out = _plan("recipes/llama2-7b.yaml", "parallel.zero_stage=0", "--world-size", "1",
                "--gpus-per-node=1", "--device", "A100-80GB")
    assert out.returncode == 1 and "does NOT fit" in out.stdout
    out = _plan("recipes/llama2-7b.yaml", "--device", "TPUv9")
    assert out.returncode == 2 and "unknown device 'TPUv9'" in out.stderr


# The loss's peak memory as the kernel sees it: with glibc's mmap threshold fixed low, every
# tensor of the sizes here is its own mapping, returned on free, so the process's peak resident
# set (VmHWM, reset through /proc/self/clear_refs) minus its size before the call is the peak
# of what the output layer and loss allocate over a forward and backward.
MEASURE = """
import ctypes, json, os, sys, torch, torch.distributed as dist
from megatron_lite.model.loss import linear_cross_entropy, softmax_xent_grad
from megatron_lite.parallel.tensor_parallel import VocabParallelLMHead
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD
libc.mallopt(-1, 64 << 10)  # M_TRIM_THRESHOLD
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
def peak(fn):
    fn()  # warm-up: kernels' own buffers, compilation
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
tensor_group = dist.new_group()  # an accelerator group, as the tensor-parallel one is
N, D, V = 1024, 16, 32768
gen = torch.Generator().manual_seed(0)
h0, w0 = torch.randn(N, D, generator=gen) * 0.05, torch.randn(V, D, generator=gen) * 0.05
t = torch.randint(0, V, (N,), generator=gen)
compiled = torch.compile(softmax_xent_grad)
def fused(dtype, kernel=None):
    h, w = h0.to(dtype).requires_grad_(), w0.to(dtype).requires_grad_()
    def run():
        linear_cross_entropy(h, w, t, kernel).backward()
        h.grad = w.grad = None
    return run
def vocab_parallel(dtype):
    x, w = h0.to(dtype).requires_grad_(), torch.nn.Parameter(w0[:V // 4].to(dtype))
    head = VocabParallelLMHead(w, 0, tensor_group, False)
    def run():
        head(x.view(1, N, D), t.view(1, N)).backward()
        x.grad = w.grad = None
    return run
print(json.dumps({
    "fp32": peak(fused(torch.float32)), "bf16": peak(fused(torch.bfloat16)),
    "fp32-compiled": peak(fused(torch.float32, compiled)),
    "bf16-compiled": peak(fused(torch.bfloat16, compiled)),
    "fp32-vocab-parallel": peak(vocab_parallel(torch.float32)),
    "bf16-vocab-parallel": peak(vocab_parallel(torch.bfloat16)),
}))
"""


def test_loss_memory_is_what_the_loss_allocates():
    if not os.path.exists("/proc/self/clear_refs") or platform.libc_ver()[0] != "glibc":
        pytest.skip("measures through Linux's /proc/self/clear_refs and glibc's mallopt")
    out = subprocess.run([sys.executable, "-c", MEASURE, str(_free_port())], cwd=REPO, env=cpu_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.splitlines()[-1])
    # 1024 tokens, d 16 (small matmuls: bf16 is slow on CPUs), vocab 32,768: on CPU the fused
    # loss takes chunks of 512 rows (two chunks); the vocabulary-parallel path, on one rank
    # here, holds all 1024 rows of its quarter of the vocabulary, as with 4 tensor ranks.
    planned = {
        "fp32": loss_bytes(1024, 16, 32768, 4, device_type="cpu"),
        "bf16": loss_bytes(1024, 16, 32768, 2, device_type="cpu"),
        "fp32-compiled": loss_bytes(1024, 16, 32768, 4, compiled=True, device_type="cpu"),
        "bf16-compiled": loss_bytes(1024, 16, 32768, 2, compiled=True, device_type="cpu"),
        "fp32-vocab-parallel": loss_bytes(1024, 16, 32768, 4, tensor=4),
        "bf16-vocab-parallel": loss_bytes(1024, 16, 32768, 2, tensor=4),
    }
    if not _cpu_has_bf16():
        # Without bf16 instructions inductor's CPU code keeps an fp32 copy of each chunk (6 bytes
        # a logit, measured): the compiled pass runs on GPUs only (compiles_softmax_pass), where
        # no such copy exists, so this CPU cannot stand in for one there.
        del planned["bf16-compiled"]
    for case, want in planned.items():
        assert 0.9 * want <= measured[case] <= 1.1 * want, (case, measured[case], want)


def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def test_tiling_shrinks_what_zero3_gathers_by_hand():
    from megatron_lite.planner import plan_report

    base = ["parallel.zero_stage=3", "training.global_batch_size=64", "model.ffn_hidden=131072"]
    cfg, model = _cfg("llama2-7b.yaml", *base)
    # bf16: 2 bytes of weight and 2 of gradient for the largest parameter gathered whole: an MLP
    # weight of 131,072 x 4,096 (the vocabulary layers are 32,000 x 4,096).
    assert estimate(cfg, model, 64, 4).gathered == 4 * 131072 * 4096
    cfg2, _ = _cfg("llama2-7b.yaml", *base, "parallel.tile_factor=2")
    assert estimate(cfg2, model, 64, 4).gathered == 4 * 131072 * 4096 / 4  # one of 2 x 2 tiles
    cfg4, _ = _cfg("llama2-7b.yaml", *base, "parallel.tile_factor=4")
    assert estimate(cfg4, model, 64, 4).gathered == 4 * 32000 * 4096  # now the output layer
    tp, _ = _cfg("llama2-7b.yaml", *base, "parallel.tile_factor=2", "parallel.tensor=4")
    assert estimate(tp, model, 64, 4).gathered == 4 * 131072 * 4096 / 4 / 4  # a tile of a slice
    no_zero3, _ = _cfg("llama2-7b.yaml", "parallel.zero_stage=2", "training.global_batch_size=64",
                       "model.ffn_hidden=131072")
    assert estimate(no_zero3, model, 64, 4).gathered == 0  # the weights are all there already

    # A layer larger than the device: 2,097,152 x 4,096 x 4 bytes = 34.4 GB gathered at once; in
    # 8 x 8 tiles, 0.54 GB.
    big = ["parallel.zero_stage=3", "training.global_batch_size=512", "model.ffn_hidden=2097152",
           "data.seq_length=512"]
    cfg, _ = _cfg("llama2-7b.yaml", *big)
    lines, ok = plan_report(cfg, 512, 4, "A100-40GB", 0.4)
    assert not ok and "tile it (parallel.tile_factor)" in "\n".join(lines)
    cfg, _ = _cfg("llama2-7b.yaml", *big, "parallel.tile_factor=8")
    lines, ok = plan_report(cfg, 512, 4, "A100-40GB", 0.4)
    text = "\n".join(lines)
    assert ok and f"{'gathered by ZeRO-3':<34} {0.54:8.2f}" in text and "(tiles of 1/64)" in text


def test_suggested_step_time_by_hand():
    from megatron_lite.planner.suggest import step_seconds

    cfg, model = _cfg("gpt2-124m.yaml", "model.vocab_size=50304", "parallel.zero_stage=1",
                      "model.activation_checkpointing=false")
    plan = estimate(cfg, model, 4, 4)
    seconds, parts = step_seconds(plan, cfg, DEVICES["A100-40GB"], 4, 0.4)
    # One node of 4 data-parallel ranks: the FLOPs at 40% of 312 TFLOP/s each, plus one ring
    # all-reduce of the bf16 gradients (2 · 3/4 of them) at 200 GB/s within the node.
    compute = plan.flops_per_token * plan.tokens_per_step / (4 * 312e12 * 0.4)
    data = plan.stage_parameters * 2 * 2 * 3 / 4 / 200e9
    assert parts == pytest.approx({"compute": compute, "data": data}, rel=1e-12)
    assert seconds == pytest.approx(compute + data, rel=1e-12)
    # Two nodes: the data-parallel ring crosses Polaris's network, 12.5 GB/s per GPU.
    _, across = step_seconds(estimate(cfg, model, 8, 4), cfg, DEVICES["A100-40GB"], 4, 0.4)
    assert across["data"] == pytest.approx(plan.stage_parameters * 2 * 2 * 7 / 8 / 12.5e9, rel=1e-12)


def test_hsdp_replica_traffic_counts_only_what_the_backward_pass_does_not_cover():
    from megatron_lite.planner.suggest import step_seconds

    def replicas(seq: int) -> tuple[float, float, dict]:
        cfg, model = _cfg("llama2-7b.yaml", "parallel.hsdp=true", "parallel.hsdp_shard_size=4",
                          "training.global_batch_size=16", "training.micro_batch_size=1",
                          f"data.seq_length={seq}")
        plan = estimate(cfg, model, 16, 4)  # 4 copies of a node's shard group of 4
        _, parts = step_seconds(plan, cfg, DEVICES["A100-40GB"], 4, 0.4)
        # The whole exchange: each rank's bf16 shard all-reduced over 4 replicas across nodes.
        whole = plan.stage_parameters * 2 / 4 * 2 * 3 / 4 / 12.5e9
        return whole, parts["compute"] * 2 / 3 / plan.grad_accumulation, parts

    # A micro-batch of 4096 tokens: its backward pass (0.9 s) hides the exchange (0.4 s) but
    # for the last of the 32 blocks' share, reduced after the backward has ended.
    whole, backward, parts = replicas(4096)
    assert backward > whole and parts["hsdp replicas"] == pytest.approx(whole / 32, rel=1e-9)
    # Of 512 tokens: the backward, all the exchange has beside it, is short; the rest of the
    # exchange stays exposed.
    whole, backward, parts = replicas(512)
    assert whole / 32 < whole - backward
    assert parts["hsdp replicas"] == pytest.approx(whole - backward, rel=1e-9)


def test_suggest_ranks_the_layouts_that_fit():
    from megatron_lite.planner.suggest import HEADROOM, suggest

    cfg, _ = _cfg("llama2-7b.yaml")
    spec = DEVICES["A100-40GB"]
    found = suggest(cfg, None, 8, 4, spec, 0.4)
    assert len(found) > 10
    assert [s.seconds for s in found] == sorted(s.seconds for s in found)
    assert all(s.plan.total <= HEADROOM * 40e9 for s in found)
    layouts = {s.overrides for s in found}
    # Plain data parallelism with ZeRO-1 holds 2 + 2 + 12/8 bytes per parameter: 37 GB, no fit.
    assert not any("parallel.zero_stage=1" in o and "parallel.tensor=1" in o and "parallel.ulysses=1" in o
                   and "parallel.context=1" in o and "parallel.pipeline=1" in o for o in layouts)
    # On one A100-80GB the 7B model fits only with the optimizer state in host memory.
    alone = suggest(cfg, None, 1, 1, DEVICES["A100-80GB"], 0.4)
    assert alone and all("parallel.offload_optimizer=cpu" in s.overrides for s in alone)


def test_a_64k_context_is_split_and_the_ring_costs_only_what_attention_does_not_hide():
    from megatron_lite.planner.suggest import step_seconds, suggest

    cfg, model = _cfg("llama3-8b-64k-polaris.yaml")
    spec = DEVICES["A100-40GB"]
    found = suggest(cfg, None, 16, 4, spec, 0.4)
    # Every layout that fits 65,536 tokens splits the sequence; the fastest uses the ring.
    assert found and all("parallel.ulysses=1" not in s.overrides or "parallel.context=1" not in s.overrides
                         for s in found)
    assert "parallel.context=1" not in found[0].overrides
    # The recipe's own layout (tensor 2, Ulysses 2, context 4 across 4 nodes): a context rank
    # attends for 16,384 tokens with 8/4 KV heads of 128, its keys and values 2·16,384·256 bf16
    # values = 16.8 MB a transfer at 12.5 GB/s (1.3 ms), beside a block of 4·16,384²/2·32·128/4
    # FLOPs (4.4 ms at 40% of 312 TFLOP/s): hidden forward and backward. Exposed: the last fp32
    # gradient transfer of each block's backward (2.7 ms), 32 blocks × 64 micro-batches.
    plan = estimate(cfg, model, 16, 4)
    _, parts = step_seconds(plan, cfg, spec, 4, 0.4)
    kv = 2 * 16_384 * 8 * 128 / 4
    assert parts["context"] == pytest.approx(32 * 64 * kv * 4 / 12.5e9, rel=1e-12)


def test_plan_suggest_on_the_command_line():
    out = _plan("recipes/llama2-7b.yaml", "--suggest", "--world-size", "8")
    assert out.returncode == 0, out.stderr
    assert "fastest first" in out.stdout
    assert "run the first with: python pretrain.py recipes/llama2-7b.yaml parallel." in out.stdout
    out = _plan("recipes/llama2-7b.yaml", "model.n_layers=400", "--suggest", "--world-size", "1")
    assert out.returncode == 1 and "none fits" in out.stdout


def test_a_plan_notes_a_pipeline_this_machines_deepspeed_refuses(monkeypatch):
    """A plan is made for the machine that will train, often from another one: where this
    install's DeepSpeed would refuse the planned pipeline, the plan says so and still exits 0."""
    from packaging.version import Version

    from megatron_lite.engine import versions

    args = ("recipes/llama2-7b.yaml", "parallel.pipeline=2", "parallel.zero_stage=1", "--world-size", "8")
    monkeypatch.setattr(versions, "deepspeed_version", lambda: Version("0.19.5"))
    out = _plan(*args)
    assert out.returncode == 0, out.stderr
    note = out.stdout.splitlines()[-1]
    assert note.startswith("note: this machine's DeepSpeed refuses this layout: parallel.pipeline=2 does "
                           "not train correctly on DeepSpeed 0.19.5"), out.stdout
    suggested = _plan("recipes/llama2-7b.yaml", "--suggest", "--world-size", "8")
    assert "parallel.pipeline=2" in suggested.stdout
    assert "refuses layouts with parallel.pipeline > 1 above" in suggested.stdout.splitlines()[-1]
    assert "note:" not in _plan("recipes/llama2-7b.yaml", "--world-size", "8").stdout  # no pipeline
    monkeypatch.setattr(versions, "deepspeed_version", lambda: Version("0.19.6"))
    assert "note:" not in _plan(*args).stdout
