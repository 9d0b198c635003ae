#!/usr/bin/env bash
# Everything that needs a GPU, in one go, on a machine with torch+CUDA and no Ray.
#   tests/run_gpu.sh OUTDIR [STAGE...]   (default: every stage, in this order:
#   nixl-probe contract-cuda bench-gpu contract-cpu)
# Wheels in .whl/ (nixl, nixl-cu13, pytest-asyncio for that machine's Python) are
# installed first when present. Writes logs, JUnit XML and the GPU benchmark's JSON
# into OUTDIR, one file per stage, so a stage that hangs still leaves the others.
set -uo pipefail
out=${1:-gpu-out}
mkdir -p "$out"
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi; python3 -c "import torch, nixl, sys; print(sys.version, torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } >"$out/machine.txt" 2>&1

wanted=" ${*:2} "
stage() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    [ "$wanted" = "  " ] || [[ "$wanted" == *" $name "* ]] || return 0
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - t0)) s; $(grep -E '(passed|failed|error)' "$out/$name.log" | tail -1)" | tee -a "$out/summary.txt"
}

pytest=(python3 -m pytest -q -p no:cacheprovider -rfEs)
stage nixl-probe 80 python3 tests/gpu_nixl_probe.py "$out"
stage contract-cuda 150 env RDT_CONTRACT_DEVICE=cuda "${pytest[@]}" --junitxml="$out/contract-cuda.xml" tests/transports
stage bench-gpu 120 python3 -m rdt_async.bench.gpu --json "$out/bench-gpu.json"
stage contract-cpu 80 env RDT_CONTRACT_DEVICE=cpu RDT_CONTRACT_TRANSPORTS=shm,object_store,nixl "${pytest[@]}" --junitxml="$out/contract-cpu.xml" tests/transports
cat "$out/summary.txt"
