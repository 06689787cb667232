#!/usr/bin/env bash
# One GPU, one invocation: the kernels' tests with CUDA parameters (ring attention's flash
# blocks among them), then bench/step.py on GPT-2 124M and on the Llama-3.2-1B shape in bf16,
# with float8 (model.fp8) and with selective recomputation, one process after another on the
# same card (no GPU takes part in `make test`).
#
#   bash tests/gpu/step_variants.sh [OUT_DIR]
#
# The steps' output goes to OUT_DIR/all.log and its figures to OUT_DIR/NAME.json; the summary
# prints each variant's step time, MFU and peak memory, and the ratios against bf16.
set -u
OUT=$(mkdir -p "${1:-/tmp/step_variants}" && realpath "${1:-/tmp/step_variants}")
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
unset DS_ACCELERATOR
nvidia-smi -L
$PY -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"

step() {  # step NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" > "$OUT/step.log" 2>&1
    echo "=== $name rc=$? $((SECONDS - start)) s" | tee -a "$OUT/all.log"
    cat "$OUT/step.log" >> "$OUT/all.log" && rm "$OUT/step.log"
    sed -n '/=== '"$name"' rc/,$p' "$OUT/all.log" | grep -vE "^\[|Warning|warn" | tail -n "${TAIL:-6}"
}

TAIL=4 step kernels 80 $PY -m pytest -q -p no:cacheprovider tests/unit/test_attention_lse.py \
    tests/unit/test_loss.py tests/unit/test_hardware.py tests/unit/test_float8.py
LLAMA=(recipes/llama3.2-1b.yaml training.global_batch_size=64)
OPTS=(--synthetic --warmup 2 --steps 2 --breakdown 1 --no-baseline)
step llama_bf16 125 $PY bench/step.py "${LLAMA[@]}" "${OPTS[@]}" --json "$OUT/llama_bf16.json"
step llama_fp8 125 $PY bench/step.py "${LLAMA[@]}" model.fp8=true "${OPTS[@]}" --json "$OUT/llama_fp8.json"
step llama_selective 125 $PY bench/step.py "${LLAMA[@]}" model.activation_checkpointing=selective \
    "${OPTS[@]}" --json "$OUT/llama_selective.json"
step gpt2_bf16 110 $PY bench/step.py recipes/gpt2-124m.yaml model.vocab_size=50304 --synthetic \
    --warmup 2 --steps 3 --breakdown 1 --no-baseline --json "$OUT/gpt2_bf16.json"

$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
for name, r in rows.items():
    print(f"{name:<16} {r['step_ms']:9.1f} ms  {r['tokens_per_sec']:>10,.0f} tok/s  "
          f"MFU {100 * (r['mfu'] or 0):5.1f}%  peak {r['peak_memory_gib']:5.1f} GiB")
base = rows.get("llama_bf16")
for name in ("llama_fp8", "llama_selective"):
    if base and name in rows:
        print(f"{name} / llama_bf16 tokens/s: {rows[name]['tokens_per_sec'] / base['tokens_per_sec']:.3f}")
PYEOF
