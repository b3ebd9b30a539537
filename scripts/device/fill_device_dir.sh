#!/usr/bin/env bash
# Fills the ignored folder .device/ with what scripts/device/gpu_check.sh needs on a GPU machine
# without a package registry (docs/build.md, "On the GPU machine"): Catch2, fmt, gloo's and
# nlohmann-json's headers and CMake files copied from this machine's Debian packages, laid out as
# under /usr, and the [hf] cases' reference files. Run from the repository root after
# scripts/test.sh (which installs the packages and makes build/test/hf_reference).
set -euo pipefail
d=.device
for path in /usr/include/catch2 /usr/lib/cmake/Catch2 /usr/lib/libCatch2WithMain.a \
  /usr/include/fmt /usr/lib/x86_64-linux-gnu/cmake/fmt /usr/include/gloo/rendezvous/store.h \
  /usr/include/nlohmann /usr/share/cmake/nlohmann_json build/test/hf_reference; do
  if [ ! -e "$path" ]; then
    echo "fill_device_dir: $path is missing (run scripts/test.sh first)" >&2
    exit 1
  fi
done
rm -rf "$d/catch2" "$d/fmt" "$d/gloo" "$d/nlohmann" "$d/hf_reference"
mkdir -p "$d/catch2/include" "$d/catch2/lib/cmake" "$d/fmt/include" \
  "$d/fmt/lib/x86_64-linux-gnu/cmake" "$d/gloo/include" "$d/nlohmann/include" \
  "$d/nlohmann/share/cmake" "$d/hf_reference"
cp -r /usr/include/catch2 "$d/catch2/include/"
cp -r /usr/lib/cmake/Catch2 "$d/catch2/lib/cmake/"
cp /usr/lib/libCatch2WithMain.a "$d/catch2/lib/"
cp -r /usr/include/fmt "$d/fmt/include/"
cp -a /usr/lib/x86_64-linux-gnu/libfmt.so* "$d/fmt/lib/x86_64-linux-gnu/"
cp -r /usr/lib/x86_64-linux-gnu/cmake/fmt "$d/fmt/lib/x86_64-linux-gnu/cmake/"
cp -r /usr/include/gloo "$d/gloo/include/"
cp -r /usr/include/nlohmann "$d/nlohmann/include/"
cp -r /usr/share/cmake/nlohmann_json "$d/nlohmann/share/cmake/"
cp build/test/hf_reference/*.safetensors "$d/hf_reference/"
echo "filled $d ($(du -sh "$d" | cut -f1))"
