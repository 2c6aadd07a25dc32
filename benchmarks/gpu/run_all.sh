#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md, on one machine, into OUT (default ./gpu-results):
# ResNet-50 AMP channels_last images/s of a raw PyTorch loop and of `hvdtrain bench` (with and
# without phase timing), side by side; and GPU utilization (nvidia-smi, every 0.5 s) during a real
# synthetic-data epoch of `python -P -m hvdtrain`. Run benchmarks/gpu/setup_device.sh first.
set -uo pipefail
out=${1:-gpu-results}; mkdir -p "$out"
py=${PYTHON:-python3}; bin=$(dirname "$(command -v "$py")")
batch=${BATCH:-256}; steps=${STEPS:-40}; warmup=${WARMUP:-15}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv >"$out/gpu.csv"
for round in $(seq 1 "${ROUNDS:-2}"); do
    "$py" benchmarks/torch_loop.py --arch resnet50 --batch-size "$batch" --image-size 224 --amp --channels-last \
        --warmup-steps "$warmup" --steps $((steps * 3)) --json "$out/raw-$round.json" 2>&1 | tail -1
    "$bin/horovodrun" -np 1 -H localhost:1 "$py" -P -m hvdtrain bench model.arch=resnet50 train.batch_size="$batch" \
        amp.enabled=true data.image_size=224 --warmup-steps "$warmup" --steps "$steps" --repeats 3 \
        --json "$out/hvdtrain-$round.json" 2>&1 | grep -E "bench: (total|rank)|phases" | sed 's/^\[[0-9,]*\]<stdout>://'
    "$bin/horovodrun" -np 1 -H localhost:1 "$py" -P -m hvdtrain bench model.arch=resnet50 train.batch_size="$batch" \
        amp.enabled=true data.image_size=224 runtime.phase_timing=false --warmup-steps "$warmup" --steps "$steps" \
        --repeats 3 --json "$out/hvdtrain-nophases-$round.json" 2>&1 | grep -E "bench: total" | sed 's/^\[[0-9,]*\]<stdout>://;s/$/ (phase_timing=false)/'
done
# A real epoch: synthetic data through the trainer, validation included; utilization sampled meanwhile.
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw --format=csv,noheader,nounits -lms 500 \
    >"$out/epoch-nvidia-smi.csv" &
smi=$!
"$bin/horovodrun" -np 1 -H localhost:1 "$py" -P -m hvdtrain model.arch=resnet50 train.batch_size="$batch" amp.enabled=true \
    data.synthetic=true data.synthetic_samples=${EPOCH_SAMPLES:-102400} train.epochs=1 checkpoint.resume=never \
    output.dir="$out/epoch-run" output.progress=false 2>&1 | sed 's/^\[[0-9,]*\]<stdout>://' | grep -vi warn | tail -6
kill $smi
"$py" - "$out/epoch-nvidia-smi.csv" <<'PY'
import sys
rows = [line.split(", ") for line in open(sys.argv[1]) if line.count(",") == 3]
util = [float(r[1]) for r in rows]
busy = [u for u in util if u > 5]
print(f"nvidia-smi: {len(util)} samples; utilization mean {sum(util)/len(util):.1f}% over the whole run, "
      f"{sum(busy)/max(1,len(busy)):.1f}% over the {len(busy)} samples above 5%; "
      f"{100*sum(u >= 95 for u in busy)/max(1,len(busy)):.0f}% of those at >= 95%")
PY
# Real JPEGs: the CPU pipeline at 4, 8 and 16 loader workers against GPU decoding (nvimgcodec),
# with the raw loop and bench again as references, utilization and CPU cores per contender.
"$py" benchmarks/gpu/input_pipeline.py --out "$out/input" --batch-size "$batch" --steps "${INPUT_STEPS:-150}" \
    2>&1 | grep -v "^\[" | tail -14
