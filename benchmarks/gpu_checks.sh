#!/usr/bin/env bash
# Everything that needs a GPU, in one run of under 8 minutes on one H200 (issue 13): build the fused kernels
# with their CUDA code for this GPU, run the `gpu` tests, then the throughput benchmark: 0.5B, GPT+, anGPT and
# nGPT, micro-batch 4 and 16 and a global batch of 128 x 2048 tokens, before and after the speed-ups that
# `angpt.pretrain --help` offers as flags, and after them with CUDA graphs, in one process; then 1B at
# micro-batch 4 and 8 and the global batch, after and with graphs; with a 1-step profile of each (GPU busy
# fraction, kernels per step, the top kernels). FAMILIES="gptplus angpt" limits the families. Logs, JSON and Markdown go
# to OUTPUT_DIR (default $OUT, which the device tool returns, else gpu-results/); a summary ends the output. Before
# the `gpu` tests, stage gpu-flags runs those of --cuda-graph-scope full_iteration and --batch-invariant-mode.
#
#   bash benchmarks/gpu_checks.sh [--no-gpu] [--te | --recompute | --race] [OUTPUT_DIR]
#
# --te checks Transformer Engine and FP8 instead (issue 14): it installs Transformer Engine from a bundle in .whl/
# (tools/te_bundle.py; the compiled transformer_engine_torch wheel is kept in OUTPUT_DIR/te-wheel, and a copy
# of it put beside the bundle is reused next time) unless it is installed, builds the kernels, runs the
# Transformer Engine `gpu` tests, BF16 against FP8 on a real corpus (benchmarks/fp8_training.py on
# data/shakespeare, carried along) and the throughput rows of both precisions, 0.5B and 1B, every family.
#
# --recompute measures activation recompute instead (issue 30): after the build, step time and peak memory of
# 0.5B at its largest micro-batch, every family, with no recompute, each family-neutral selective choice
# (--recompute-activations: core_attn; mlp; core_attn,mlp; qk_norm) and --recompute-granularity full (stage
# recompute-0.5b), then the choices of one family (GPT+'s layernorm; anGPT's and nGPT's residual_update and
# qk_norm,residual_update) beside none (stage recompute-norms). The kept bytes and recompute FLOPs per layer are
# benchmarks/activation_memory.py --recompute's (docs/results.md).
#
# --race runs the convergence race instead (issue 50, docs/race.md): after the build, the corpus that
# tools/race_corpus.py built and packed (RACE_CORPUS, default data/race, carried with .whl/) is tokenized here
# into RACE_DATA (default /tmp/race-data; stage race-data), then benchmarks/race.py trains GPT+, anGPT and nGPT
# at d=768 on the same tokens, as many as fit the time left (stage race; its report in OUTPUT_DIR/race/). Its
# BUDGET_S defaults to 540. With --no-gpu: a tiny shape, at most RACE_TOKENS (default 12288) tokens per family.
#
# --no-gpu runs the same stages on a CPU (no CUDA build; the `gpu` tests skip; a tiny model stands in for
# 0.5B and 1B), to check this script. Missing prerequisites stop it at once (exit 2). Each stage has a time
# limit, cut further so that all of them end within BUDGET_S (default 480) seconds; a stage that fails does
# not stop the next; the exit status is the first failure's. Set BEFORE_FLAGS / AFTER_FLAGS to choose the
# compared `angpt.pretrain` flags yourself. On a machine without a package registry, put the wheels it lacks
# (megatron-core, for one) in .whl/ first; they are installed into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
gpu=1 te=0 recompute=0 race=0
while [ $# -gt 0 ]; do
    case $1 in
        --no-gpu) gpu=0; shift ;;
        --te) te=1; shift ;;
        --recompute) recompute=1; shift ;;
        --race) race=1; shift ;;
        *) break ;;
    esac
done
[ $((te + recompute + race)) -le 1 ] || { echo "gpu_checks.sh: give one of --te, --recompute and --race" >&2; exit 2; }
out=${1:-${OUT:-gpu-results}}
mkdir -p "$out"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
deadline=$((SECONDS + ${BUDGET_S:-$([ $race -eq 1 ] && echo 540 || echo 480)}))
status=0
summary=()
die() { echo "gpu_checks.sh: $*" >&2; exit 2; }
stage() {  # stage NAME SECONDS COMMAND...: run it for at most SECONDS (less if the budget is short), log to $out/NAME.log
    local name=$1 limit=$2; shift 2
    local left=$((deadline - SECONDS - 15))  # 15 s: timeout's grace period before it kills
    if [ $left -lt 30 ]; then
        echo "== $name: skipped, the time budget is spent"
        summary+=("$name: SKIPPED (time budget spent)")
        [ $status -ne 0 ] || status=124
        return
    fi
    [ "$limit" -le $left ] || limit=$left
    echo "== $name ($limit s at most): $*"
    local start=$SECONDS
    timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    tail -n 25 "$out/$name.log"
    local verdict="ok"
    [ $rc -eq 0 ] || verdict="FAILED (exit $rc$([ $rc -eq 124 ] && echo ', time limit'))"
    summary+=("$name: $verdict, $((SECONDS - start)) s, log $out/$name.log")
    [ $rc -eq 0 ] || [ $status -ne 0 ] || status=$rc
}

# Prerequisites: all checked before anything runs.
command -v timeout > /dev/null || die "needs coreutils' timeout"
command -v "$PY" > /dev/null || die "no $PY (set PYTHON=)"
if [ -z "${NO_WHEELS:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then  # NO_WHEELS=1: this Python has them
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || die "installing .whl/*.whl failed"
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import torch, megatron.core, pytest" 2> "$out/prerequisites.log" \
    || die "torch, megatron-core and pytest must be importable by $PY: $(tail -n 1 "$out/prerequisites.log")"
race_corpus=${RACE_CORPUS:-data/race}
[ $race -eq 0 ] || [ -f "$race_corpus/train.jsonl.xz" ] \
    || die "--race: no corpus in $race_corpus (python tools/race_corpus.py --output-dir $race_corpus, then carry it)"
if [ $gpu -eq 1 ]; then
    "$PY" -c "import torch; assert torch.cuda.is_available()" 2> /dev/null \
        || die "no CUDA device visible to torch (--no-gpu runs the CPU parts)"
    cuda_home=$("$PY" -c "from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or '')")
    [ -n "$cuda_home" ] && [ -x "$cuda_home/bin/nvcc" ] || die "no CUDA toolkit (nvcc) for building the kernels"
    command -v ninja > /dev/null || "$PY" -c "import ninja" 2> /dev/null \
        || echo "gpu_checks.sh: no ninja: the extension builds one file at a time"
    nvidia-smi > "$out/machine.log" 2>&1
    "$cuda_home/bin/nvcc" --version >> "$out/machine.log" 2>&1
fi
"$PY" -c "import sys, torch, megatron.core; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda',
torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU', 'megatron-core',
megatron.core.__version__)" | tee -a "$out/machine.log"
"$PY" -m angpt.pretrain --help > "$out/pretrain-help.txt" 2>&1 || die "angpt.pretrain --help failed: see $out/pretrain-help.txt"
te_bundle=""
if [ $te -eq 1 ] && [ $gpu -eq 1 ] && ! "$PY" -c "import transformer_engine.pytorch" 2> /dev/null; then
    te_bundle=$(compgen -G ".whl/te-*.tar.xz" | head -n 1)
    [ -n "$te_bundle" ] || die "--te: Transformer Engine is not installed and .whl/ has no bundle (tools/te_bundle.py prepare)"
    export PYTHONPATH=/tmp/site:$PYTHONPATH
fi

# Before/after: the flags of angpt.pretrain that switch the speed-ups of issue 13 on (after) or off (before),
# where this tree has them (both sides of an option that is on by default, such as torch's fused AdamW on
# CUDA, are tried). Features without a flag (megatron's grad norm through torch._foreach_norm) are in both.
has_flag() { grep -qE -- "(^|[[:space:][])$1([]=[:space:],]|$)" "$out/pretrain-help.txt"; }
detected_before="" detected_after=""
for flag in --cross-entropy-loss-fusion --rope-fusion --bias-swiglu-fusion --fused-adam --use-fused-adam; do
    if has_flag "$flag"; then detected_after+=" $flag"; fi
    if has_flag "--no-${flag#--}"; then detected_before+=" --no-${flag#--}"; fi
done
before=${BEFORE_FLAGS-$detected_before} after=${AFTER_FLAGS-$detected_after}
variants=(--variant "before=${before# }" --variant "after=${after# }")
if [ -z "${before// }" ] && [ -z "${after// }" ]; then variants=(--variant "default="); fi
# The same as "after", each layer's forward and backward replayed as CUDA graphs (megatron-core's local ones).
if [ $gpu -eq 1 ] && has_flag --cuda-graph-impl; then variants+=(--variant "graphs=${after# } --cuda-graph-impl local"); fi
read -ra families <<< "${FAMILIES:-gptplus angpt ngpt}"
other_features=$(grep -oE -- "--[a-z0-9-]*(fus|foreach|graph|compile)[a-z0-9-]*" "$out/pretrain-help.txt" | sort -u | tr '\n' ' ')

if [ -n "$te_bundle" ]; then
    stage te-install 300 "$PY" tools/te_bundle.py install "$te_bundle" --target /tmp/site --wheel-cache "$out/te-wheel"
fi
if [ $gpu -eq 1 ]; then
    # The extension for this GPU only (the Docker image builds sm_80 and sm_90).
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}
    export MAX_JOBS=${MAX_JOBS:-$(nproc)}
    stage build 150 bash -c "'$PY' setup.py build_ext --inplace && '$PY' -c \"import torch; from angpt import kernels; \
assert kernels.extension(torch.device('cuda')) is not None, 'the extension has no CUDA kernels'; print('CUDA kernels load')\""
    model=(--seq-length 2048 --warmup 2 --steps 5 --global-batch-size 128 --global-steps 1)
    step_model=(--seq-length 2048 --warmup 2 --steps 5)
    small=0.5b large=1b sizes=(4 16) large_sizes=(4 8)
else
    model=(--device cpu --seq-length 32 --vocab-size 256 --warmup 1 --steps 2 --global-batch-size 16 --global-steps 1)
    step_model=(--device cpu --seq-length 32 --vocab-size 256 --warmup 1 --steps 2)
    small=tiny large=tiny sizes=(2 8) large_sizes=(2 4)
fi
if [ $recompute -eq 1 ]; then
    # One-micro-batch steps at the largest micro-batch (where activations dominate the peak), no profile.
    base=${after# }
    recompute_run=("$PY" benchmarks/gpu_throughput.py --shapes $small --precisions bf16 --kernels on "${step_model[@]}"
                   --micro-batch-size "${sizes[-1]}" --profile-steps 0 --variant "none=$base")
    selective="$base --recompute-activations --recompute-modules"
    stage recompute-$small 270 "${recompute_run[@]}" --families "${families[@]}" \
        --variant "core_attn=$base --recompute-activations" --variant "mlp=$selective mlp" \
        --variant "core_attn,mlp=$selective core_attn mlp" --variant "qk_norm=$selective qk_norm" \
        --variant "full=$base --recompute-granularity full" \
        --output "$out/recompute-$small.json" --markdown "$out/recompute-$small.md"
    # The choices only some families have, one run each (a variant's flags apply to every family it runs).
    normalized=() gptplus=()
    for family in "${families[@]}"; do
        if [ "$family" = gptplus ]; then gptplus=(gptplus); else normalized+=("$family"); fi
    done
    norms=()
    [ ${#gptplus[@]} -eq 0 ] || norms+=("$(printf '%q ' "${recompute_run[@]}" --families gptplus \
        --variant "layernorm=$selective layernorm" --variant "layernorm,qk_norm=$selective layernorm qk_norm" \
        --output "$out/recompute-norms-gptplus.json" --markdown "$out/recompute-norms-gptplus.md")")
    [ ${#normalized[@]} -eq 0 ] || norms+=("$(printf '%q ' "${recompute_run[@]}" --families "${normalized[@]}" \
        --variant "residual_update=$selective residual_update" \
        --variant "qk_norm,residual_update=$selective qk_norm residual_update" \
        --output "$out/recompute-norms.json" --markdown "$out/recompute-norms.md")")
    stage recompute-norms 150 bash -c "status=0; $(printf '%s || status=$?; ' "${norms[@]}") exit \$status"
fi
if [ $race -eq 1 ]; then
    race_data=${RACE_DATA:-/tmp/race-data}
    stage race-data 120 "$PY" tools/race_corpus.py --prepare "$race_corpus" --output-dir "$race_data" \
        --workers "$(nproc)"
    # race.py sizes its tokens to what is left, less the stage's grace period and a margin.
    race_args=(--corpus "$race_data" --output-dir "$out/race" --time-budget $((deadline - SECONDS - 45)))
    [ $gpu -eq 1 ] || race_args+=(--tiny --max-train-tokens "${RACE_TOKENS:-12288}")
    stage race 600 "$PY" benchmarks/race.py "${race_args[@]}"
fi
if [ $recompute -eq 0 ] && [ $race -eq 0 ]; then
# --cuda-graph-scope full_iteration and --batch-invariant-mode, never run on a GPU before: a captured iteration
# trains as eager steps; a sample's logits alone equal, bit for bit, its logits in a batch of 4 (the difference
# without the mode is printed, as a control). Their own stage, out of the one below.
[ $te -eq 1 ] || stage gpu-flags 60 "$PY" -m pytest -q -s -m gpu -p no:cacheprovider -o addopts="-ra" \
    tests/test_gpu_only_flags.py
gpu_tests=$(grep -l "pytest.mark.gpu" tests/test_*.py | grep -v test_gpu_only_flags.py)
# Activation offloading needs Transformer Engine: its equal-loss checks run here (under a minute).
[ $te -eq 0 ] || gpu_tests="tests/test_transformer_engine.py tests/test_gpu_activation_offloading.py"
# shellcheck disable=SC2086  # one argument per file
stage tests 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors -o addopts="-ra" \
    --durations=15 $gpu_tests
# (The host-sync check, tests/test_graph_safety.py, passed on the H200 on 2026-11-30; the CUDA graph tests
# among the `gpu` tests above check graph safety by capturing.)
if [ $te -eq 1 ]; then
    # BF16 against FP8 on a real corpus first (the loss target), then FP8's throughput; "after" flags only.
    if [ -f data/shakespeare/train_text_document.idx ]; then
        stage fp8-training 240 "$PY" benchmarks/fp8_training.py --corpus data/shakespeare \
            --output-dir "$out/fp8-training" $([ $gpu -eq 1 ] || echo "--transformer-impl local --precisions bf16 \
            --train-iters 4 --num-layers 2 --hidden-size 64 --seq-length 32 --micro-batch-size 2 --log-interval 2")
    else
        echo "== fp8-training: skipped, no data/shakespeare (run make quickstart, and carry data/shakespeare)"
        summary+=("fp8-training: SKIPPED (no data/shakespeare)")
    fi
    precisions=(bf16 fp8)
    [ $gpu -eq 1 ] || precisions=(bf16)
    variants=(--variant "after=${after# }")
else
    precisions=(bf16)
fi
# 0.5B: every variant at the smallest and largest micro-batch, the global batch from the largest.
stage throughput-0.5b 200 "$PY" benchmarks/gpu_throughput.py --shapes $small --families "${families[@]}" \
    --precisions "${precisions[@]}" --kernels on "${model[@]}" --micro-batch-size "${sizes[@]}" \
    --global-micro-batch-size "${sizes[-1]}" "${variants[@]}" --profile-steps 1 --profile "$out/profile.txt" \
    --output "$out/throughput-0.5b.json" --markdown "$out/throughput-0.5b.md"
# FSDP2 against the distributed optimizer and DDP's 16-bit optimizer (issue 46): the bytes each rank holds and the
# step time, side by side in one process. One GPU: FSDP2 shards over one rank, so this row is its overhead; its
# memory per rank at DP 2 and 4 is measured on the CPU (docs/results/memory_dp*.json).
if [ $te -eq 0 ]; then
    fsdp2_shape=(--hidden-size 2048 --num-layers 8 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 2)
    [ $gpu -eq 1 ] || fsdp2_shape=(--hidden-size 64 --num-layers 2 --seq-length 32 --vocab-size 256)
    stage fsdp2 90 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/sixteen_bit_optimizer.py \
        --family angpt "${fsdp2_shape[@]}" --rounds 5 --variants "distributed optimizer" without fsdp2 \
        --output "$out/fsdp2.json"
    # Megatron-FSDP's four strategies (never run on a GPU before): step time and the device's peak against the
    # distributed optimizer's, in a stage of their own so that a failure leaves FSDP2's rows. Over one rank nothing
    # is sharded; their memory at DP 2 and 4 is measured on the CPU (docs/results/memory_dp*.json).
    stage megatron-fsdp 90 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
        benchmarks/sixteen_bit_optimizer.py --family angpt "${fsdp2_shape[@]}" --rounds 5 \
        --variants "megatron-fsdp no_shard" "megatron-fsdp optim" "megatron-fsdp optim_grads" \
        "megatron-fsdp optim_grads_params" \
        --output "$out/megatron-fsdp.json"
fi
large_variants=("${variants[@]}")
[ ${#variants[@]} -le 4 ] || large_variants=("${variants[@]: -4}")
# 1B: the last two variants, the global batch from micro-batches of 8 (16 took 118 GiB for GPT+ eagerly).
stage throughput-1b 150 "$PY" benchmarks/gpu_throughput.py --shapes $large --families "${families[@]}" \
    --precisions "${precisions[@]}" --kernels on "${model[@]}" --micro-batch-size "${large_sizes[@]}" \
    --global-micro-batch-size "${large_sizes[-1]}" "${large_variants[@]}" --profile-steps 1 \
    --profile "$out/profile-1b.txt" --output "$out/throughput-1b.json" --markdown "$out/throughput-1b.md"
fi

echo
echo "==================== summary ($SECONDS s) ===================="
grep -h "" "$out/machine.log" 2> /dev/null | tail -n 1
[ $recompute -eq 1 ] || [ $race -eq 1 ] || echo "compared: ${variants[*]}"
echo "speed-related flags in angpt.pretrain --help: ${other_features:-none}"
printf '%s\n' "${summary[@]}"
[ -f "$out/tests.log" ] && echo "gpu tests: $(grep -E "passed|failed|error|skipped|no tests ran" "$out/tests.log" | tail -n 1)"
[ -f "$out/gpu-flags.log" ] && echo "gpu-flags tests: $(grep -E "passed|failed|error|skipped|no tests ran" \
    "$out/gpu-flags.log" | tail -n 1)" && grep -h "largest difference" "$out/gpu-flags.log"
[ -f "$out/race/race.md" ] && { echo; cat "$out/race/race.md"; }
[ -f "$out/fsdp2.log" ] && { echo; echo "FSDP2 against the distributed optimizer"; grep -A6 "^per rank" "$out/fsdp2.log"; }
[ -f "$out/megatron-fsdp.log" ] && { echo; echo "Megatron-FSDP against the distributed optimizer"; \
    grep -A12 "^per rank" "$out/megatron-fsdp.log"; }
[ -f "$out/fp8-training/fp8_training.md" ] && { echo; echo "BF16 against FP8 on data/shakespeare"; cat "$out/fp8-training/fp8_training.md"; }
for name in recompute-$small recompute-norms-gptplus recompute-norms; do
    [ -f "$out/$name.md" ] && { echo; echo "activation recompute: $name"; cat "$out/$name.md"; }
done
for name in 0.5b 1b; do
    if [ -f "$out/throughput-$name.md" ]; then
        echo; echo "throughput $name ($(grep -m1 "fused kernels" "$out/throughput-$name.log" | sed 's/.*fused kernels/fused kernels/'))"
        cat "$out/throughput-$name.md"
    fi
done
# Per shape, family and micro-batch setting: ms per step (and before -> after), anGPT over GPT+, MFU.
for name in 0.5b 1b; do
    [ -f "$out/throughput-$name.json" ] || continue
    echo
    "$PY" - "$out/throughput-$name.json" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
keys = ("family", "micro_batch_size", "global_batch_size", "kernels")
def fmt(value, spec):
    return "-" if value is None else format(value, spec)
for r in rows:
    if r["variant"] == "before":
        continue
    before = [b for b in rows if b["variant"] == "before" and all(b[k] == r[k] for k in keys)]
    change = f" (before {before[0]['ms_per_step']:.1f}: x{before[0]['ms_per_step'] / r['ms_per_step']:.2f})" if before else ""
    print(f"{r['shape']} {r['family']:8} {r['variant']} micro-batch {r['micro_batch_size']:>2} global "
          f"{r['global_batch_size']:>3}: {r['ms_per_step']:8.1f} ms{change}, vs GPT+ {fmt(r['vs_gptplus'], '.3f')}, "
          f"MFU {fmt(r['mfu'], '.3f')}, GPU busy {fmt(r.get('device_busy_fraction'), '.2f')}, "
          f"kernels/step {fmt(r.get('device_ops_per_step'), '.0f')}")
EOF
done
[ -f "$out/profile.txt" ] && { echo; grep "^==" "$out/profile.txt"; }
exit $status
