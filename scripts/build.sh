#!/usr/bin/env bash
# Installs what is missing (Debian packages, LibTorch from the torch==2.11.0 wheel in .venv), then
# configures and builds torchmoe into build/. Safe to re-run: every step is skipped when done.
#
# usage: scripts/build.sh [TARGET...]
#   With no target it builds everything (library, tests, examples, benchmarks); with targets, only
#   those and what they depend on, e.g. scripts/build.sh moe_lm. A target the build directory does
#   not define (its TORCHMOE_BUILD_* option is OFF) is skipped with a note.
#
# Environment: TORCHMOE_BUILD_DIR (default build), TORCHMOE_JOBS (default: all cores),
# TORCHMOE_CMAKE_ARGS (extra configure arguments, used when the build directory is configured),
# TORCHMOE_PYTHON_REQUIREMENTS (pip requirement files to install beside torch).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build_dir=${TORCHMOE_BUILD_DIR:-build}
torch_version=2.11.0

# ---- system packages ------------------------------------------------------------------------
packages=(cmake ninja-build ccache g++ catch2 libfmt-dev libgloo-dev nlohmann-json3-dev python3
          python3-venv)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "== installing Debian packages: ${missing[*]}"
  sudo_cmd=(); [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q "${missing[@]}"
fi
if [ ! -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  echo "error: the CUDA 13 toolkit (nvcc, cuBLASLt) is required in /usr/local/cuda" >&2
  exit 1
fi
export PATH=/usr/local/cuda/bin:$PATH

# ---- LibTorch (the torch wheel's C++ distribution) ------------------------------------------
has_torch() { "$1" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; }
if has_torch "$root/.venv/bin/python"; then
  python=$root/.venv/bin/python
elif has_torch python3; then
  python=$(command -v python3)
else
  echo "== installing torch==$torch_version into .venv (a few GB, once)"
  python3 -m venv "$root/.venv"
  "$root/.venv/bin/python" -m pip install -q --upgrade pip
  # Not quiet: the download is a few GB and pip's progress bar shows it is moving. No cache: it
  # would keep a second copy of those GB on a disk that may be short of space.
  "$root/.venv/bin/python" -m pip install --no-cache-dir "torch==$torch_version"
  python=$root/.venv/bin/python
fi
torch_cmake=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
# Python packages beside torch (scripts/test.sh: the pinned reference models' test/reference/
# requirements.txt); pip skips what is already installed at the pinned versions.
for requirements in ${TORCHMOE_PYTHON_REQUIREMENTS:-}; do
  echo "== installing $requirements into $python's environment"
  "$python" -m pip install -q --disable-pip-version-check -r "$requirements"
done

# ---- configure + build ----------------------------------------------------------------------
if [ ! -f "$build_dir/build.ninja" ]; then
  echo "== configuring $build_dir"
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_cmake" ${TORCHMOE_CMAKE_ARGS:-}
fi
targets=()
for t in "$@"; do
  if ninja -C "$build_dir" -t query "$t" >/dev/null 2>&1; then
    targets+=("$t")
  else
    echo "== skipping target $t: $build_dir does not define it (a TORCHMOE_BUILD_* option OFF?)"
  fi
done
if (($# && !${#targets[@]})); then
  echo "== nothing to build"
  exit 0
fi
jobs=${TORCHMOE_JOBS:-$(nproc)}
echo "== building ${targets[*]:-all targets} in $build_dir ($jobs jobs)"
# Ninja prints one [done/total elapsed] line per step when its output is not a terminal.
export NINJA_STATUS=${NINJA_STATUS:-"[%f/%t %es] "}
build_args=(--build "$build_dir" -j "$jobs")
((${#targets[@]})) && build_args+=(--target "${targets[@]}")
cmake "${build_args[@]}"
