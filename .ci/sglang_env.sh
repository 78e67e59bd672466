#!/usr/bin/env bash
# Real SGLang 0.5.23, CPU only, in its own virtualenv: the server of the real-SGLang suite (tests/sglang/).
#
#   bash .ci/sglang_env.sh                 # builds .venv-sglang ($SGLANG_VENV to move it)
#   python -m pytest -q tests/sglang       # the suite finds the venv and launches one server per session
#
# sglang pins a CUDA build of torch plus its CUDA kernel package, which needs libcuda.so.1 when it is
# imported; the CPU engine imports it unconditionally. A stand-in libcuda.so.1 (three functions that answer
# CUDA_ERROR_NO_DEVICE) is compiled into $VENV/cuda-stand-in; the suite puts that directory on the server's
# LD_LIBRARY_PATH only (see ../shared/notes/sglang-cpu.md for how this was found). Nothing in sglang is patched.
# .ci/sglang-lock.txt pins every package the resolver picked for sglang==0.5.23, so a rebuild does not
# resolve again. A second run with the same script and lock file only checks the import and returns.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${SGLANG_VENV:-$ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3}"
LOCK="$ROOT/.ci/sglang-lock.txt"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
export PIP_NO_CACHE_DIR=1  # its CUDA wheels (GBs, downloaded where no local index is) serve no other virtualenv
source "$ROOT/.ci/venv_lib.sh"
# sglang 0.5.23 pins torch 2.14.1; the machine-wide cap (torch<=2.14.1) allows it, nothing else applies.
export PIP_CONSTRAINT=""

stamp="$VENV/.agentfsm-sglang-env"
want="$(cat "$0" "$LOCK" 2>/dev/null | sha256sum | cut -d' ' -f1 || true)"
stub="$VENV/cuda-stand-in/libcuda.so.1"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -f "$stub" ] \
  && LD_LIBRARY_PATH="$VENV/cuda-stand-in" SGLANG_USE_CPU_ENGINE=1 \
     "$VENV/bin/python" -c "import sglang.srt.entrypoints.http_server" 2>/dev/null; then
  echo "sglang env: $VENV is up to date"
  exit 0
fi

start=$SECONDS
venv_fresh sglang "$VENV" "$PYTHON"
pip=("$VENV/bin/python" -m pip install -q)
if [ -f "$LOCK" ]; then
  "${pip[@]}" --no-deps -r "$LOCK"      # every pin the resolver picked once: nothing left to resolve
  "$VENV/bin/python" -m pip check
else
  "${pip[@]}" "sglang==0.5.23"
  "$VENV/bin/python" -m pip freeze --all --exclude pip --exclude-editable > "$LOCK"   # --all: setuptools too
  echo "sglang env: wrote $LOCK; commit it"
fi

# The stand-in driver: cuInit, cuDriverGetVersion and cuPointerGetAttribute answer 100
# (CUDA_ERROR_NO_DEVICE), which is what the kernel package's loader needs to import on a machine with no GPU.
mkdir -p "$VENV/cuda-stand-in"
cat > "$VENV/cuda-stand-in/stand_in.c" <<'C'
int cuInit(unsigned int flags) { (void)flags; return 100; }
int cuDriverGetVersion(int *version) { if (version) *version = 0; return 100; }
int cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
  (void)data; (void)attribute; (void)ptr; return 100;
}
C
"${CC:-cc}" -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o "$stub" "$VENV/cuda-stand-in/stand_in.c"

LD_LIBRARY_PATH="$VENV/cuda-stand-in" SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c \
  "import sglang, sglang.srt.entrypoints.http_server; assert sglang.__version__ == '0.5.23', sglang.__version__"
venv_done sglang "$VENV" "$(cat "$0" "$LOCK" | sha256sum | cut -d' ' -f1)" "$start"  # the stamp is "$stamp"
