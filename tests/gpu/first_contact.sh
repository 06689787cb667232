#!/usr/bin/env bash
# One GPU over NCCL, end to end, in one invocation (no GPU takes part in `make test`):
# tools/check_dist.py; a run that evaluates, samples and saves in the background; its exact
# resume from the middle checkpoint (bf16, and fp16 on a GPU); ZeRO-1 beside ZeRO-0; a rollback after injected bad samples; a NaN step skipped on
# the device; a ZeRO-3 build; and bench/checkpoint_speed.py's blocked-time figure on the GPU.
# The bad data and the NaN come from the tests' fault injection (tests/faults.py), loaded
# through a sitecustomize of this script's own: the accelerator-semantics harness is not
# loaded, since the groups here are real NCCL groups.
#
#   bash tests/gpu/first_contact.sh TINYSHAKESPEARE.txt [OUT_DIR]
#
# DEVICE=cpu runs the same steps on the CPU (gloo), to try the script itself.
# Prints each step's exit status and time, the end of its output, and a summary; every step's
# whole output goes to OUT_DIR/all.log. Exit status: the number of failed checks.
set -u
TEXT=$(realpath "${1:?usage: first_contact.sh TINYSHAKESPEARE.txt [OUT_DIR]}")
OUT=$(mkdir -p "${2:-/tmp/first_contact}" && realpath "${2:-/tmp/first_contact}")
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
W=$(mktemp -d)
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
unset DS_ACCELERATOR  # training.device decides
mkdir -p "$W/faults"
echo 'from tests.faults import install; install()' > "$W/faults/sitecustomize.py"
FAULTS="$W/faults:$REPO${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME TIMEOUT_S COMMAND...: the command's output to OUT/all.log, its tail here
    local name=$1 limit=$2 start rc
    shift 2
    echo "=== $name: $*" | tee -a "$OUT/all.log"
    start=$SECONDS
    timeout "$limit" "$@" > "$W/$name.log" 2>&1
    rc=$?
    echo "$rc" > "$W/$name.rc"
    cat "$W/$name.log" >> "$OUT/all.log"
    echo "=== $name rc=$rc $((SECONDS - start)) s" | tee -a "$OUT/all.log"
    grep -v "^\[" "$W/$name.log" | tail -n 12
}

RUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node 1 pretrain.py recipes/shakespeare-char.yaml
     "data.prefix=$W/data/tiny_text_document" "data.build_from=$TEXT"
     "data.tokenizer.model=$W/data/chars.json" "training.device=$DEVICE" training.precision=bf16)

[ "$DEVICE" != cuda ] || nvidia-smi -L
$PY -c "import torch, deepspeed, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)"

step check_dist 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 tools/check_dist.py --size-mb 64

# 200 steps, evaluation and a sample at 100 and 200, background saves at 100 and 200; the
# host reads and host collectives of every step recorded (tests/faults.py RECORD_STEP_SYNCS).
LONG=(training.iters=200 training.log_interval=10 training.eval_interval=100 training.eval_iters=20
      training.sample_tokens=64 checkpoint.save_interval=100 checkpoint.keep_last=0 checkpoint.async_save=true)
step full 150 env PYTHONPATH="$FAULTS" RECORD_STEP_SYNCS="$W/syncs" "${RUN[@]}" "${LONG[@]}" \
    "checkpoint.dir=$W/ck" "logging.dir=$W/full"
# The same run resumed from step 100: a copy of its checkpoints with `latest` at step 100.
cp -r "$W/ck" "$W/ck2" && rm -rf "$W/ck2/step_00000200" && echo step_00000100 > "$W/ck2/latest"
step resumed 150 "${RUN[@]}" "${LONG[@]}" "checkpoint.dir=$W/ck2" "logging.dir=$W/resumed"

# The same 200 steps under ZeRO-1 (DeepSpeed's bf16 optimizer instead of its unfused fp16/bf16
# wrapper): the host reads per step and the step time beside ZeRO-0's.
step zero1 150 env PYTHONPATH="$FAULTS" RECORD_STEP_SYNCS="$W/syncs1" "${RUN[@]}" "${LONG[@]}" \
    parallel.zero_stage=1 "checkpoint.dir=$W/ck1" "logging.dir=$W/z1"
if [ "$DEVICE" = cuda ]; then  # fp16 (a GPU's alone): the same resume, 60 steps from step 30
    F16=(training.precision=fp16 training.iters=60 training.log_interval=10 training.eval_interval=30
         training.eval_iters=20 training.sample_tokens=32 checkpoint.save_interval=30 checkpoint.keep_last=0)
    step fp16_full 150 "${RUN[@]}" "${F16[@]}" "checkpoint.dir=$W/ckh" "logging.dir=$W/fp16_full"
    cp -r "$W/ckh" "$W/ckh2" && rm -rf "$W/ckh2/step_00000060" && echo step_00000030 > "$W/ckh2/latest"
    step fp16_resumed 150 "${RUN[@]}" "${F16[@]}" "checkpoint.dir=$W/ckh2" "logging.dir=$W/fp16_resumed"
fi

# tests/distributed/test_spikes.py's rollback case: bad samples at steps 45-46, rollback to 30.
SHORT=(training.log_interval=1 training.eval_interval=0 training.eval_iters=1 training.global_batch_size=8
       training.micro_batch_size=4 training.sample_tokens=0 schedule.warmup_iters=10 spikes.warmup_steps=30
       spikes.window=20)
step rollback 150 env PYTHONPATH="$FAULTS" FAULT_BAD_SAMPLES=352:368 "${RUN[@]}" "${SHORT[@]}" \
    training.iters=60 spikes.policy=rollback "checkpoint.dir=$W/ckr" checkpoint.save_interval=10 \
    checkpoint.keep_last=0 spikes.rollback.min_steps_back=10 spikes.rollback.skip_batches=3 "logging.dir=$W/rb"
# A NaN loss at step 3: skipped on the device (fused AdamW's found_inf), the verdict read late.
step nan 150 env PYTHONPATH="$FAULTS" FAULT_NAN_LOSS=3 "${RUN[@]}" "${SHORT[@]}" training.iters=6 \
    "logging.dir=$W/nan"
step zero3 150 "${RUN[@]}" "${SHORT[@]}" training.iters=20 parallel.zero_stage=3 "logging.dir=$W/z3"
step checkpoint_speed 200 $PY bench/checkpoint_speed.py --device "$DEVICE" --precision bf16 --rounds 3 \
    --dir "$W/ckbench"

$PY - "$W" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json, re, sys
from pathlib import Path

w = Path(sys.argv[1])
failed = 0


def verdict(ok, what):
    global failed
    failed += not ok
    print(("ok   " if ok else "FAIL ") + what)


def metrics(run):
    f = w / run / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []


def events(run):
    f = w / run / "spikes.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []


log = (w / "check_dist.log").read_text()
verdict((w / "check_dist.rc").read_text().strip() == "0", "check_dist: exit 0")
for line in log.splitlines():
    if "GB/s" in line:
        print("     " + line.strip())

def compare(name, full, resumed, first):
    trained = {r["step"]: r for r in full if "loss" in r}
    again = {r["step"]: r for r in resumed if "loss" in r}
    verdict(bool(again) and sorted(again) == [s for s in sorted(trained) if s > first],
            f"{name}: resumed at {first + 1}, steps {sorted(again)[:3]}...")
    common = [s for s in again if s in trained]
    for key in ("loss", "grad_norm", "lr", "consumed_samples"):
        diff = max((abs(again[s][key] - trained[s][key]) for s in common), default=float("nan"))
        exact = all(again[s][key] == trained[s][key] for s in common)
        print(f"     {name} resume vs full, {key}: max |diff| {diff:.3g} over {len(common)} steps "
              f"({'bitwise equal' if exact else 'not bitwise'})")
        verdict(diff < 5e-2 if key in ("loss", "grad_norm") else exact, f"{name}: resume follows the full run in {key}")


def syncs(directory, name):
    f = w / directory / "rank0.json"
    if not f.exists():
        return
    per_step = json.loads(f.read_text())
    quiet = [s for s in per_step if not s.get("reads") and not s.get("host_collectives")]
    reads = sorted(len(s["reads"]) for s in per_step)
    where = sorted({r.split(" at ")[1].rsplit("/", 3)[-1] for s in per_step[5:6] for r in s["reads"]})
    print(f"     {name}: {len(quiet)} of {len(per_step)} steps with no host read and no host collective; "
          f"reads per step median {reads[len(reads) // 2] if reads else None}, at {where}")


def step_ms(run):
    times = sorted(r["step_time_ms"] for r in metrics(run) if "step_time_ms" in r and r["step"] > 20)
    return times[len(times) // 2] if times else float("nan")


full, resumed = metrics("full"), metrics("resumed")
trained = {r["step"]: r for r in full if "loss" in r}
verdict(sorted(trained)[-1:] == [200], f"full run: {len(trained)} logged steps, last {sorted(trained)[-1:]}")
ev = [r for r in full if "val_loss" in r]
verdict([r["step"] for r in ev] == [100, 200], f"full run: evaluations {[(r['step'], r['val_loss']) for r in ev]}")
again = {r["step"]: r for r in resumed if "loss" in r}
verdict(sorted(again) == [s for s in sorted(trained) if s > 100], f"resumed at 101: steps {sorted(again)[:3]}...")
common = [s for s in again if s in trained]
for key in ("loss", "grad_norm", "lr", "consumed_samples"):
    diff = max((abs(again[s][key] - trained[s][key]) for s in common), default=float("nan"))
    exact = all(again[s][key] == trained[s][key] for s in common)
    print(f"     resume vs full, {key}: max |diff| {diff:.3g} over {len(common)} steps ({'bitwise equal' if exact else 'not bitwise'})")
    verdict(diff < 5e-2 if key in ("loss", "grad_norm") else exact, f"resume follows the full run in {key}")
ev2 = [(r["step"], r["val_loss"]) for r in resumed if "val_loss" in r]
print(f"     resumed evaluations {ev2}")
samples = [re.findall(r"sample at step (\d+):\n(.*?)\n-{40}", (w / f"{r}.log").read_text(), re.S)
           for r in ("full", "resumed")]
verdict(len(samples[0]) == 2, f"full run sampled at {[s for s, _ in samples[0]]}")
print(f"     sample at 200 equal after resume: {samples[0][-1:] == samples[1][-1:]}")
syncs("syncs", "full run (ZeRO-0, bf16)")
syncs("syncs1", "ZeRO-1, bf16")
z1 = [r for r in metrics("z1") if "loss" in r]
verdict(sorted(r["step"] for r in z1)[-1:] == [200], "zero1: 200 steps")
print(f"     median step time after step 20: ZeRO-0 {step_ms('full'):.2f} ms, ZeRO-1 {step_ms('z1'):.2f} ms")
if (w / "fp16_full").exists():
    compare("fp16", metrics("fp16_full"), metrics("fp16_resumed"), 30)

rb = events("rb")
verdict([e["event"] for e in rb] == ["spike", "rollback"] and rb[1].get("to_step") == 30,
        f"rollback: events {[(e['event'], e.get('step'), e.get('to_step')) for e in rb]}")
nan = events("nan")
verdict([(e["event"], e["step"], e["action"]) for e in nan] == [("nonfinite", 3, "skip")],
        f"nan: events {[(e['event'], e.get('step'), e.get('action')) for e in nan]}")
nm = [r for r in metrics("nan") if "loss" in r]
verdict(len(nm) == 6 and all(r["loss"] == r["loss"] for r in nm if r["step"] != 3),
        f"nan: losses {[(r['step'], round(r['loss'], 4), r.get('skipped_steps')) for r in nm]}")
z3 = [r for r in metrics("z3") if "loss" in r]
verdict(len(z3) == 20 and z3[-1]["loss"] < z3[0]["loss"], f"zero3: loss {z3[0]['loss'] if z3 else None} -> {z3[-1]['loss'] if z3 else None}")
bench = (w / "checkpoint_speed.log").read_text()
verdict("blocked time async / sync" in bench, "checkpoint_speed ran")
print("\n".join("     " + line for line in bench.splitlines() if re.match(r"(model|sync|async|load|blocked)", line)))
print(f"{failed} failed")
sys.exit(failed)
EOF
exit "${PIPESTATUS[0]}"
