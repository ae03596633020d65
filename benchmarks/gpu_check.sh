#!/usr/bin/env bash
# GPU check: on an x86-64 machine with an NVIDIA GPU, install the CUDA builds (torch, and
# onnxruntime-training 1.19.2 with the CUDA 11.8 / cuDNN 8 libraries from nvidia-*-cu11 wheels),
# run the zoo's parity on CUDA and time BERT-base and GPT-2 small training steps (batch 8,
# sequence 128, fp32 and fp16 autocast) eager vs ORT, then FSDP2 (`fully_shard` on every block of a
# GPT, NCCL, one rank per GPU, up to 2) eager vs ORT: final parameters, peak memory and step time.
# Then the torch-calling nodes' CUDA tests, and autocast on CUDA (tests/test_autocast.py -k cuda:
# float16 and bfloat16 autocast calls run in ORT with eager's dtypes and numbers).
# Results land in OUT_DIR.
#
#   benchmarks/gpu_check.sh OUT_DIR [--dry-run] [--wheels DIR]
#
#   --dry-run     check the machine and print the plan; install and run nothing
#   --wheels DIR  install from a folder of wheels only (machines without a package index)
#
# Exit status: 0 done, 1 a parity entry or a timed step failed, 2 the machine or a library is
# missing (the message says which), 124 the 8-minute budget ran out.
set -euo pipefail

BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
TORCH_SPEC=${GPU_CHECK_TORCH:-torch==2.13.0}
TORCH_INDEX=${GPU_CHECK_TORCH_INDEX:-https://download.pytorch.org/whl/cu126}
ORT_SPEC="onnxruntime-training==1.19.2"
CUDA11_LIBS=(nvidia-cuda-runtime-cu11 nvidia-cublas-cu11 "nvidia-cudnn-cu11==8.9.*"
  nvidia-cufft-cu11 nvidia-curand-cu11 nvidia-cuda-nvrtc-cu11)
OTHERS=(transformers==4.57.6 onnx numpy pytest)

die() { echo "gpu_check: $*" >&2; exit 2; }
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

OUT="" DRY_RUN=0 WHEELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --wheels) [ $# -ge 2 ] || die "--wheels needs a folder"; WHEELS=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$OUT" ] || die "one OUT_DIR only"; OUT=$1 ;;
  esac
  shift
done
[ -n "$OUT" ] || { usage >&2; die "OUT_DIR is required"; }
[ -z "$WHEELS" ] || [ -d "$WHEELS" ] || die "--wheels $WHEELS is not a folder"

ROOT=$(cd "$(dirname "$0")/.." && pwd)
START=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - START))); }
step() { echo "gpu_check: [$(( $(date +%s) - START ))s] $*"; }

# -- the machine (no install, no GPU call beyond nvidia-smi) ---------------------------------
[ "$(uname -m)" = "x86_64" ] || die "needs x86-64 (onnxruntime-training CUDA wheels exist for it only), this is $(uname -m)"
PYTHON=${GPU_CHECK_PYTHON:-$(command -v python3.11 || true)}
[ -n "$PYTHON" ] || die "needs Python 3.11 (onnxruntime-training 1.19.2 has wheels for 3.8-3.11): set GPU_CHECK_PYTHON"
"$PYTHON" -c 'import sys; assert (3, 8) <= sys.version_info[:2] <= (3, 11)' 2>/dev/null \
  || die "$PYTHON is not Python 3.8-3.11, which onnxruntime-training 1.19.2 needs"
command -v nvidia-smi >/dev/null || die "no NVIDIA GPU: nvidia-smi is not on PATH (no driver on this machine)"
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1) \
  || die "nvidia-smi failed: no usable NVIDIA GPU or driver"
[ -n "$GPU" ] || die "nvidia-smi lists no GPU"
step "GPU: $GPU"

PIP_SOURCE=()
if [ -n "$WHEELS" ]; then PIP_SOURCE=(--no-index --find-links "$WHEELS"); fi
if [ "$DRY_RUN" = 1 ]; then
  echo "plan: venv $OUT/venv with $PYTHON"
  echo "plan: pip install ${PIP_SOURCE[*]} $TORCH_SPEC (index $TORCH_INDEX)"
  echo "plan: pip install ${PIP_SOURCE[*]} $ORT_SPEC ${CUDA11_LIBS[*]} ${OTHERS[*]} -e $ROOT"
  echo "plan: python benchmarks/gpu_bench.py --out $OUT --device cuda"
  echo "plan: python benchmarks/bench_fsdp2.py --device cuda --nproc <GPUs, at most 2> (NCCL)"
  echo "plan: pytest tests/test_torch_nodes.py (CUDA cases), tests/test_autocast.py -k cuda"
  exit 0
fi

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

# -- install ----------------------------------------------------------------------------------
step "creating $OUT/venv"
"$PYTHON" -m venv "$OUT/venv"
PY="$OUT/venv/bin/python"
PIP=("$PY" -m pip install --quiet --disable-pip-version-check "${PIP_SOURCE[@]}")
step "installing $TORCH_SPEC (CUDA build)"
if [ -n "$WHEELS" ]; then
  timeout "$(left)" "${PIP[@]}" "$TORCH_SPEC" || die "could not install $TORCH_SPEC from $WHEELS"
else
  timeout "$(left)" "${PIP[@]}" --index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple "$TORCH_SPEC" \
    || die "could not install $TORCH_SPEC from $TORCH_INDEX"
fi
step "installing $ORT_SPEC, CUDA 11.8 / cuDNN 8 libraries, transformers"
timeout "$(left)" "${PIP[@]}" "$ORT_SPEC" "${CUDA11_LIBS[@]}" "${OTHERS[@]}" \
  || die "could not install $ORT_SPEC and the nvidia-*-cu11 wheels"
timeout "$(left)" "${PIP[@]}" --no-deps -e "$ROOT" || die "could not install ort_autopatch from $ROOT"

# ORT's CUDA provider loads libcudart.so.11.0, libcublas*.so.11, libcudnn.so.8 ... by name.
NVIDIA_LIBS=$("$PY" - <<'PY'
import glob, os, site
roots = site.getsitepackages()
print(":".join(sorted({d for r in roots for d in glob.glob(os.path.join(r, "nvidia", "*", "lib"))})))
PY
)
export LD_LIBRARY_PATH="$NVIDIA_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OMP_WAIT_POLICY=PASSIVE

# -- libraries present? ----------------------------------------------------------------------
step "checking torch CUDA and ORT's CUDA provider"
"$PY" - <<'PY' || exit 2
import glob, os, subprocess, sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device (CPU-only build or driver too old)")
import onnxruntime as ort
if "CUDAExecutionProvider" not in ort.get_available_providers():
    sys.exit(f"gpu_check: onnxruntime {ort.__version__} has no CUDAExecutionProvider (CPU build installed?)")
lib = glob.glob(os.path.join(os.path.dirname(ort.__file__), "capi", "libonnxruntime_providers_cuda.so"))
if lib:
    missing = [l.split()[0] for l in subprocess.run(["ldd", lib[0]], capture_output=True, text=True).stdout.splitlines() if "not found" in l]
    if missing:
        sys.exit("gpu_check: ORT's CUDA provider cannot load " + ", ".join(missing) + " (install the matching nvidia-*-cu11 wheel)")
print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}; onnxruntime {ort.__version__}")
PY

# -- run --------------------------------------------------------------------------------------
step "zoo parity on CUDA, then BERT-base and GPT-2 small steps"
set +e
(cd "$ROOT" && timeout "$(left)" "$PY" benchmarks/gpu_bench.py --out "$OUT" --device cuda)
status=$?
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
NPROC=$(( GPUS >= 2 ? 2 : 1 ))  # NCCL wants one GPU per rank
step "FSDP2 (fully_shard, NCCL, $NPROC rank(s)): eager vs ORT"
(cd "$ROOT" && timeout "$(left)" "$PY" benchmarks/bench_fsdp2.py --device cuda --nproc "$NPROC" --repeat 1)
fsdp_status=$?
if [ -f "$ROOT/benchmarks/results/fsdp2-cuda.json" ]; then cp "$ROOT/benchmarks/results/fsdp2-cuda.json" "$OUT/"; fi
[ "$status" -ne 0 ] || status=$fsdp_status
step "torch-calling nodes on CUDA: Functions, routed operators, fused attention (SDPA by rule), stream order"
(cd "$ROOT" && timeout "$(left)" "$PY" -m pytest -q -p no:cacheprovider tests/test_torch_nodes.py \
    -k "cuda or unet or dcgan or straight_through" 2>&1 | tee "$OUT/torch_nodes-cuda.log")
nodes_status=${PIPESTATUS[0]}
[ "$status" -ne 0 ] || status=$nodes_status
step "autocast on CUDA: float16 and bfloat16 calls run in ORT with eager's dtypes and numbers"
(cd "$ROOT" && timeout "$(left)" "$PY" -m pytest -q -p no:cacheprovider tests/test_autocast.py \
    -k cuda 2>&1 | tee "$OUT/autocast-cuda.log")
autocast_status=${PIPESTATUS[0]}
[ "$status" -ne 0 ] || status=$autocast_status
set -e
step "done (exit $status); results in $OUT: gpu_parity.json gpu_steps.json fsdp2-cuda.json torch_nodes-cuda.log autocast-cuda.log gpu_check.log"
exit $status
