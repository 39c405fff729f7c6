#!/usr/bin/env bash
# Everything that needs a GPU, in one run that fits a few minutes of one GPU: build the fused kernels with
# their CUDA code for this GPU, run the `gpu` tests, then the throughput benchmark. Logs and results go to
# OUTPUT_DIR (default gpu-results/).
#
#   bash benchmarks/gpu_checks.sh [OUTPUT_DIR]
#
# On a machine without a package registry, put the wheels it lacks (megatron-core, for one) in .whl/ first;
# they are installed into /tmp/site. Each stage runs even when an earlier one failed; the exit status is
# the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
status=0
stage() {  # stage NAME SECONDS COMMAND...: run it for at most SECONDS, log to $out/NAME.log, remember the first failure
    local name=$1 limit=$2; shift 2
    echo "== $name: $*"
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    tail -n 40 "$out/$name.log"
    [ $rc -eq 0 ] || [ $status -ne 0 ] || status=$rc
}

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi > "$out/machine.log" 2>&1
python3 -c "import torch, megatron.core; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
    | tee -a "$out/machine.log"
# The extension for this GPU only (the Docker image builds sm_80 and sm_90).
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
stage build 300 python3 setup.py build_ext --inplace
gpu_tests=$(grep -l "pytest.mark.gpu" tests/test_*.py)
stage tests 180 python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors -o addopts="-ra" $gpu_tests
stage throughput 300 python3 benchmarks/gpu_throughput.py --json "$out/throughput.json"
# What FlashAttention gives over megatron's unfused attention, and where the GPU time of a step goes.
stage attention-unfused 120 python3 benchmarks/gpu_throughput.py --shapes 0.5b --families gptplus angpt --precisions bf16 \
    --attention-backend unfused
stage profile 150 python3 benchmarks/gpu_throughput.py --shapes 0.5b --families gptplus angpt ngpt --precisions bf16 \
    --warmup 2 --steps 3 --profile "$out/profile.txt"
exit $status
