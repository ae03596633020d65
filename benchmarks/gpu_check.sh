#!/usr/bin/env bash
# GPU check: on an x86-64 machine with an NVIDIA GPU, install the CUDA builds of torch and of
# each ONNX Runtime backend, each in a venv of its own (the two builds cannot share one):
#
#   ort-training  onnxruntime-training 1.19.2 with the CUDA 11.8 / cuDNN 8 libraries from
#                 nvidia-*-cu11 wheels (`ort-autopatch[training-gpu]`), Python 3.8-3.11
#   ort           the plain backend: onnxruntime-gpu and onnxscript (`ort-autopatch[gpu]`), with
#                 torch's build for the CUDA major onnxruntime-gpu is built for (read from its
#                 build info once installed: 1.31 is CUDA 13 / cuDNN 9, so torch's cu130 wheels),
#                 whose CUDA and cuDNN libraries its CUDA provider loads
#
# For each (benchmarks/gpu_bench.py): the engine benchmark's models and a two-output module
# whose unused output gets a zero gradient, 3 SGD steps through the engine against eager on
# CUDA (losses, parameters, BatchNorm buffers); the zoo's parity on CUDA; BERT-base and GPT-2
# small training steps (batch 8, sequence 128, fp32 and fp16 autocast) eager vs ORT. The
# training build then runs FSDP2 (`fully_shard` on every block of a GPT, NCCL, one rank per
# GPU, up to 2) eager vs ORT: final parameters, peak memory and step time; its torch-calling
# nodes' CUDA tests, and autocast on CUDA (tests/test_autocast.py -k cuda: float16 and bfloat16
# autocast calls run in ORT with eager's dtypes and numbers). Results land in OUT_DIR/BACKEND/.
#
#   benchmarks/gpu_check.sh OUT_DIR [--backend ort|ort-training] [--dry-run] [--wheels DIR]
#
#   --backend B   check one backend only (default: both, the training build first)
#   --dry-run     check the machine and print the plan; install and run nothing
#   --wheels DIR  install from a folder of wheels only (machines without a package index)
#
# Exit status: 0 done, 1 a parity entry or a timed step failed, 2 the machine or a library is
# missing (the message says which), 124 a backend's 8-minute budget ran out.
set -euo pipefail

BUDGET_S=${GPU_CHECK_BUDGET_S:-470}  # per backend
TORCH_SPEC=${GPU_CHECK_TORCH:-torch==2.13.0}
# The training build brings CUDA 11.8 libraries of its own (no torch in range is built for 11),
# so its torch's CUDA is free; the plain backend's torch must match onnxruntime-gpu's major.
TORCH_INDEX_TRAINING=${GPU_CHECK_TORCH_INDEX:-https://download.pytorch.org/whl/cu126}
torch_index_for_cuda() {  # CUDA major of onnxruntime-gpu -> torch's wheel index (as runtime.py)
  if [ -n "${GPU_CHECK_TORCH_INDEX:-}" ]; then echo "$GPU_CHECK_TORCH_INDEX"; return; fi
  case "$1" in
    12) echo https://download.pytorch.org/whl/cu126 ;;
    13) echo https://download.pytorch.org/whl/cu130 ;;
    *) die "onnxruntime-gpu is built for CUDA '${1:-none}': no torch index known for it; set GPU_CHECK_TORCH_INDEX" ;;
  esac
}
TRAINING_SPEC="onnxruntime-training==1.19.2"
CUDA11_LIBS=(nvidia-cuda-runtime-cu11 nvidia-cublas-cu11 "nvidia-cudnn-cu11==8.9.*"
  nvidia-cufft-cu11 nvidia-curand-cu11 nvidia-cuda-nvrtc-cu11)
OTHERS=(transformers==4.57.6 onnx numpy pytest)

die() { echo "gpu_check: $*" >&2; exit 2; }
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

OUT="" DRY_RUN=0 WHEELS="" BACKENDS=(ort-training ort)
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --wheels) [ $# -ge 2 ] || die "--wheels needs a folder"; WHEELS=$2; shift ;;
    --backend)
      [ $# -ge 2 ] || die "--backend needs ort or ort-training"
      case "$2" in ort|ort-training) BACKENDS=("$2") ;; *) die "--backend $2: ort or ort-training" ;; esac
      shift ;;
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

# What each backend installs on top of torch's CUDA build, and which Pythons it takes.
ort_packages() {  # BACKEND -> pip arguments
  if [ "$1" = ort-training ]; then
    echo "$TRAINING_SPEC ${CUDA11_LIBS[*]} ${OTHERS[*]}"
  else
    echo "${OTHERS[*]}"  # onnxruntime-gpu and onnxscript come with ort-autopatch[gpu]
  fi
}
python_ok() {  # BACKEND PYTHON: onnxruntime-training 1.19.2 has wheels for 3.8-3.11
  if [ "$1" = ort-training ]; then
    "$2" -c 'import sys; assert (3, 8) <= sys.version_info[:2] <= (3, 11)' 2>/dev/null
  else
    "$2" -c 'import sys; assert sys.version_info[:2] >= (3, 10)' 2>/dev/null
  fi
}

# -- the machine (no install, no GPU call beyond nvidia-smi) ---------------------------------
[ "$(uname -m)" = "x86_64" ] || die "needs x86-64 (onnxruntime-training CUDA wheels exist for it only), this is $(uname -m)"
PYTHON=${GPU_CHECK_PYTHON:-$(command -v python3.11 || command -v python3 || true)}
[ -n "$PYTHON" ] || die "needs Python 3.11 (onnxruntime-training 1.19.2 has wheels for 3.8-3.11): set GPU_CHECK_PYTHON"
for backend in "${BACKENDS[@]}"; do
  python_ok "$backend" "$PYTHON" || die "$PYTHON cannot run the $backend backend (ort-training: Python 3.8-3.11, ort: 3.10 or newer): set GPU_CHECK_PYTHON"
done
command -v nvidia-smi >/dev/null || die "no NVIDIA GPU: nvidia-smi is not on PATH (no driver on this machine)"
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1) \
  || die "nvidia-smi failed: no usable NVIDIA GPU or driver"
[ -n "$GPU" ] || die "nvidia-smi lists no GPU"
step "GPU: $GPU"

PIP_SOURCE=()
if [ -n "$WHEELS" ]; then PIP_SOURCE=(--no-index --find-links "$WHEELS"); fi
EXTRA() { if [ "$1" = ort-training ]; then echo training-gpu; else echo gpu; fi; }
if [ "$DRY_RUN" = 1 ]; then
  for backend in "${BACKENDS[@]}"; do
    echo "plan ($backend): venv $OUT/$backend/venv with $PYTHON"
    if [ "$backend" = ort-training ]; then
      echo "plan ($backend): pip install ${PIP_SOURCE[*]} $TORCH_SPEC (index $TORCH_INDEX_TRAINING)"
    else
      echo "plan ($backend): pip install ${PIP_SOURCE[*]} onnxruntime-gpu, then $TORCH_SPEC from the index of its CUDA major (12: cu126, 13: cu130)"
    fi
    echo "plan ($backend): pip install ${PIP_SOURCE[*]} $(ort_packages "$backend") -e $ROOT[$(EXTRA "$backend")]"
    echo "plan ($backend): python benchmarks/gpu_bench.py --out $OUT/$backend --device cuda --backend $backend"
    if [ "$backend" = ort-training ]; then
      echo "plan ($backend): python benchmarks/bench_fsdp2.py --device cuda --nproc <GPUs, at most 2> (NCCL)"
      echo "plan ($backend): pytest tests/test_torch_nodes.py (CUDA cases), tests/test_autocast.py -k cuda"
    fi
  done
  exit 0
fi

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

# -- one backend: install, check the libraries, run ------------------------------------------
check_backend() {  # BACKEND -> exit status of its runs (0, 1 or 124); dies on a missing library
  local backend=$1 dir="$OUT/$1" status
  START=$(date +%s)  # each backend has its own budget
  mkdir -p "$dir"
  step "$backend: creating $dir/venv"
  "$PYTHON" -m venv "$dir/venv"
  PY="$dir/venv/bin/python"
  PIP=("$PY" -m pip install --quiet --disable-pip-version-check "${PIP_SOURCE[@]}")
  local torch_index=$TORCH_INDEX_TRAINING ort_cuda
  if [ "$backend" = ort ]; then
    step "$backend: installing onnxruntime-gpu, to read the CUDA major it is built for"
    timeout "$(left)" "${PIP[@]}" onnxruntime-gpu || die "could not install onnxruntime-gpu"
    ort_cuda=$("$PY" - <<'PY'
import importlib.util, os, re
folder = importlib.util.find_spec("onnxruntime").submodule_search_locations[0]
with open(os.path.join(folder, "capi", "build_and_package_info.py")) as info:
    found = re.search(r"^cuda_version\s*=\s*['\"](\d+)", info.read(), re.M)
print(found[1] if found else "")
PY
)
    torch_index=$(torch_index_for_cuda "$ort_cuda")
  fi
  step "$backend: installing $TORCH_SPEC (CUDA build)"
  if [ -n "$WHEELS" ]; then
    timeout "$(left)" "${PIP[@]}" "$TORCH_SPEC" || die "could not install $TORCH_SPEC from $WHEELS"
  else
    timeout "$(left)" "${PIP[@]}" --index-url "$torch_index" --extra-index-url https://pypi.org/simple "$TORCH_SPEC" \
      || die "could not install $TORCH_SPEC from $torch_index"
  fi
  step "$backend: installing $(ort_packages "$backend") and ort-autopatch[$(EXTRA "$backend")]"
  # shellcheck disable=SC2046  # word splitting wanted: a list of requirements
  timeout "$(left)" "${PIP[@]}" $(ort_packages "$backend") || die "could not install $(ort_packages "$backend")"
  timeout "$(left)" "${PIP[@]}" -e "$ROOT[$(EXTRA "$backend")]" \
    || die "could not install ort-autopatch[$(EXTRA "$backend")] from $ROOT"

  # ORT's CUDA provider loads libcudart, libcublas, libcudnn ... by name: the training build's
  # CUDA 11 ones from the nvidia-*-cu11 wheels, onnxruntime-gpu's from torch's (same major).
  local libs
  libs=$("$PY" - <<'PY'
import glob, os, site
roots = site.getsitepackages()
print(":".join(sorted({d for r in roots for d in glob.glob(os.path.join(r, "nvidia", "*", "lib"))})))
PY
)
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export OMP_WAIT_POLICY=PASSIVE

  step "$backend: checking torch CUDA and ORT's CUDA provider"
  "$PY" - "$backend" <<'PY' || exit 2
import glob, os, subprocess, sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device (CPU-only build or driver too old)")
from ort_autopatch.engine import runtime
if runtime.resolve("auto") != sys.argv[1]:
    sys.exit(f"gpu_check: the {sys.argv[1]} backend cannot run: {runtime.unavailable_reason(sys.argv[1])}")
mismatch = runtime.cuda_mismatch(torch.version.cuda, sys.argv[1])
if mismatch is not None and mismatch[1]:
    sys.exit(f"gpu_check: {mismatch[0]}")
import onnxruntime as ort
if "CUDAExecutionProvider" not in ort.get_available_providers():
    sys.exit(f"gpu_check: onnxruntime {ort.__version__} has no CUDAExecutionProvider (CPU build installed?)")
lib = glob.glob(os.path.join(os.path.dirname(ort.__file__), "capi", "libonnxruntime_providers_cuda.so"))
if lib:
    missing = [l.split()[0] for l in subprocess.run(["ldd", lib[0]], capture_output=True, text=True).stdout.splitlines() if "not found" in l]
    if missing:
        sys.exit("gpu_check: ORT's CUDA provider cannot load " + ", ".join(missing) + " (install the matching nvidia-* wheel)")
print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}; onnxruntime {ort.__version__} ({sys.argv[1]})")
PY

  set +e
  step "$backend: engine models and the zoo's parity on CUDA, then BERT-base and GPT-2 small steps"
  (cd "$ROOT" && timeout "$(left)" "$PY" benchmarks/gpu_bench.py --out "$dir" --device cuda --backend "$backend")
  status=$?
  if [ "$backend" = ort-training ]; then
    local gpus nproc other
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    nproc=$(( gpus >= 2 ? 2 : 1 ))  # NCCL wants one GPU per rank
    step "$backend: FSDP2 (fully_shard, NCCL, $nproc rank(s)): eager vs ORT"
    (cd "$ROOT" && timeout "$(left)" "$PY" benchmarks/bench_fsdp2.py --device cuda --nproc "$nproc" --repeat 1)
    other=$?
    if [ -f "$ROOT/benchmarks/results/fsdp2-cuda.json" ]; then cp "$ROOT/benchmarks/results/fsdp2-cuda.json" "$dir/"; fi
    [ "$status" -ne 0 ] || status=$other
    step "$backend: torch-calling nodes on CUDA: Functions, routed operators, fused attention (SDPA by rule), stream order"
    (cd "$ROOT" && timeout "$(left)" "$PY" -m pytest -q -p no:cacheprovider tests/test_torch_nodes.py \
        -k "cuda or unet or dcgan or straight_through" 2>&1 | tee "$dir/torch_nodes-cuda.log")
    other=${PIPESTATUS[0]}
    [ "$status" -ne 0 ] || status=$other
    step "$backend: autocast on CUDA: float16 and bfloat16 calls run in ORT with eager's dtypes and numbers"
    (cd "$ROOT" && timeout "$(left)" "$PY" -m pytest -q -p no:cacheprovider tests/test_autocast.py \
        -k cuda 2>&1 | tee "$dir/autocast-cuda.log")
    other=${PIPESTATUS[0]}
    [ "$status" -ne 0 ] || status=$other
  fi
  step "$backend: done (exit $status); results in $dir"
  return "$status"
}

# Each backend in a subshell: its venv's PATH-like settings stay its own, and a library missing
# for one (exit 2) does not keep the other from being checked.
overall=0
for backend in "${BACKENDS[@]}"; do
  set +e
  (set -e; check_backend "$backend")
  status=$?
  set -e
  [ "$overall" -ne 0 ] || overall=$status
done
step "done (exit $overall): $OUT/<backend>/ holds gpu_engine_models.json gpu_parity.json gpu_steps.json (and for ort-training fsdp2-cuda.json torch_nodes-cuda.log autocast-cuda.log); log in $OUT/gpu_check.log"
exit $overall
